"""One process, plain torch: what `backend=deepspeed` runs when the run is one process and asks
nothing of DeepSpeed's engine (ZeRO-0, fp32, no offload, no native checkpoint). There DeepSpeed's
engine adds no arithmetic: megaframe already measures and clips the gradient norm and gates the
step itself, and the optimizer is torch's fused AdamW. This engine does the same step without
importing DeepSpeed (about half a second of start-up, and its per-step bookkeeping); its losses are
DeepSpeed's, bit for bit (tests/unit/backends/test_plain.py). backends/registry.py picks it
(run_engine); `backend.plain_one_process=false` keeps DeepSpeed's engine."""

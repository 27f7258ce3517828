"""to_ds_config(): the only place where DeepSpeed JSON keys are written."""
from __future__ import annotations

from typing import Any, Optional

from megaframe.config.schema import TrainConfig
from megaframe.config.validate import Layout

# DeepSpeed prints its own progress every N steps; our trainer owns the console.
_NEVER = 10**9


def _offload_block(kind: str, device: str, cfg: TrainConfig, swap_dir: Optional[str],
                   pin_memory: bool) -> dict[str, Any]:
    """offload_optimizer (kind "optimizer") or offload_param (kind "param")."""
    off = cfg.offload
    block: dict[str, Any] = {"device": device, "pin_memory": pin_memory}
    if device == "nvme":
        # DeepSpeed adds its own zero_stage_3/{optimizer,fp32params}/rankN folders below this
        block["nvme_path"] = swap_dir or off.nvme_path
        if kind == "optimizer":
            block["buffer_count"] = off.optimizer_buffer_count
        else:
            block.update(buffer_count=off.param_buffer_count, buffer_size=off.param_buffer_size,
                         max_in_cpu=off.param_max_in_cpu)
    return block


def zero_block(cfg: TrainConfig, swap_dir: Optional[str] = None, pin_memory: bool = False) -> dict[str, Any]:
    """The zero_optimization section, offload included (swap_dir: this process's NVMe folder)."""
    z = cfg.zero
    block: dict[str, Any] = {"stage": z.stage}
    if z.stage == 0:
        return block
    block.update(
        overlap_comm=z.overlap_comm,
        contiguous_gradients=z.contiguous_gradients,
        reduce_bucket_size=z.reduce_bucket_size,
        allgather_bucket_size=z.allgather_bucket_size,
    )
    if z.stage == 3:
        block.update(
            stage3_prefetch_bucket_size=z.stage3_prefetch_bucket_size,
            stage3_param_persistence_threshold=z.stage3_param_persistence_threshold,
            stage3_max_live_parameters=z.stage3_max_live_parameters,
        )
    if cfg.offload.optimizer != "none":
        block["offload_optimizer"] = _offload_block("optimizer", cfg.offload.optimizer, cfg, swap_dir, pin_memory)
    if cfg.offload.param != "none":
        block["offload_param"] = _offload_block("param", cfg.offload.param, cfg, swap_dir, pin_memory)
    return block


def precision_block(cfg: TrainConfig) -> dict[str, Any]:
    """bf16 / fp16 sections (fp32 needs none)."""
    p = cfg.precision
    if p.dtype == "bf16":
        return {"bf16": {"enabled": True}}
    if p.dtype == "fp16":
        return {"fp16": {"enabled": True, "loss_scale": 0,  # 0 = dynamic loss scaling
                         "initial_scale_power": p.initial_scale_power,
                         "loss_scale_window": p.loss_scale_window,
                         "hysteresis": p.hysteresis, "min_loss_scale": p.min_loss_scale}}
    return {}


def to_ds_config(cfg: TrainConfig, layout: Layout, swap_dir: Optional[str] = None,
                 pin_memory: bool = False) -> dict[str, Any]:
    """Translate the typed config into DeepSpeed's config dict.

    swap_dir: where this process's NVMe swap files go (backends/deepspeed/nvme.py); None = offload.nvme_path.
    pin_memory: offload.pin_memory as backends/common.pinned_offload resolves it for the rank's device.

    The LR schedule is not here: it is a torch LambdaLR handed to deepspeed.initialize (see
    training/schedule.py), because DeepSpeed's built-in schedulers warm up from min_lr (linear decay)
    or logarithmically, unlike Megatron's linear warmup from 0.
    """
    o = cfg.optim
    optimizer_params: dict[str, Any] = {"lr": o.lr, "betas": list(o.betas), "eps": o.eps,
                                        "weight_decay": o.weight_decay}
    if cfg.offload.optimizer == "none":
        # torch's fused AdamW, on every accelerator: one kernel per step over all parameters (CUDA)
        # and one pass per element on the CPU (torch >= 2.4; 3.6x faster than the CPU default, a loop
        # over tensors, on the bench model: 7.1 vs 25.4 ms per step, tools/bench_adamw.py). DeepSpeed's
        # own FusedAdam is the same math behind a JIT build (~45 s on CPU, nvcc on a GPU).
        # With offload DeepSpeed uses its CPU Adam (JIT-built once into TORCH_EXTENSIONS_DIR).
        optimizer_params["torch_adam"] = True
        optimizer_params["fused"] = True
    ds: dict[str, Any] = {
        # DeepSpeed's data-parallel world is dp x cp (it reduces gradients over both), so in its
        # arithmetic each cp rank's shard of a sample counts as a sample
        "train_batch_size": layout.global_batch_size * layout.cp,
        "train_micro_batch_size_per_gpu": layout.micro_batch_size,
        "gradient_accumulation_steps": layout.grad_accum_steps,
        # DeepSpeed's default when the key is absent is 1.0, not "off": always write it.
        "gradient_clipping": o.grad_clip,
        "optimizer": {"type": "AdamW", "params": optimizer_params},
        "zero_optimization": zero_block(cfg, swap_dir, pin_memory),
        "steps_per_print": _NEVER,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if o.name != "adamw":  # another optimizer is megaframe's, handed to deepspeed.initialize (engine.py)
        del ds["optimizer"]
    ds.update(precision_block(cfg))
    if layout.pp > 1 and cfg.parallel.sequence_parallel:
        # The pipeline engine assumes activations are replicated across TP ranks and sends each rank
        # a 1/tp slice, re-gathered on arrival. Under SP every TP rank holds a different sequence
        # shard, already 1/tp of the activation: slicing and re-gathering would mix shards.
        ds["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    if "nvme" in (cfg.offload.optimizer, cfg.offload.param):
        off = cfg.offload
        ds["aio"] = {"block_size": off.aio_block_size, "queue_depth": off.aio_queue_depth,
                     "intra_op_parallelism": off.aio_intra_op_parallelism,
                     "single_submit": off.aio_single_submit, "overlap_events": off.aio_overlap_events}
    return ds

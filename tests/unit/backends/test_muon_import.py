"""DeepSpeed's Muon module is imported without building inductor (megaframe/backends/deepspeed/muon_import.py),
and its kernels still go through torch.compile when Muon runs."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from tests.support.helpers import REPO, cli_env, free_port
from megaframe.backends.deepspeed.muon_import import compile_on_first_call


def test_a_zero_rank_imports_muon_without_inductor_and_deepspeed_still_accepts_adamw():
    # A fresh interpreter: the pytest worker may have imported inductor for other tests.
    probe = textwrap.dedent("""
        import sys
        import torch, deepspeed
        from deepspeed.runtime import compiler
        original = compiler.compile
        from megaframe.backends.deepspeed.muon_import import import_muon_lazily
        import_muon_lazily()
        from deepspeed import ops
        ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as megaframe's engine: no JIT build of it
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # DeepSpeed's checks ask for the rank
        from deepspeed.runtime.zero.utils import is_zero_supported_optimizer
        adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
        print("muon", "deepspeed.runtime.zero.muon.muon_optimizer" in sys.modules)
        print("inductor", "torch._inductor.compile_fx" in sys.modules)
        print("restored", compiler.compile is original)
        print("supported", is_zero_supported_optimizer(adamw))
        # Muon's kernels still go through torch.compile, on their first call (recorded here: a real
        # inductor build would need a C++ compiler run).
        from deepspeed.runtime.zero.muon import original_muon
        compiled = []
        torch.compile = lambda fn: compiled.append(fn.__name__) or fn
        g = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
        out = original_muon.zeropower_via_newtonschulz5(g, steps=5)
        print("compiled", ",".join(compiled) or "-")
        plain = original_muon.zeropower_via_newtonschulz5.__wrapped__(g, steps=5)
        print("same", torch.equal(out, plain) and out.shape == g.shape)
    """)
    run = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=cli_env(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                                                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    keys = ("muon", "inductor", "restored", "supported", "compiled", "same")
    said = dict(line.split() for line in run.stdout.splitlines() if line.split(" ")[0] in keys)
    assert said == {"muon": "True", "inductor": "False", "restored": "True", "supported": "True",
                    "compiled": "zeropower_via_newtonschulz5", "same": "True"}, run.stdout


def test_compilation_moves_to_the_first_call_with_the_same_function(monkeypatch):
    compiled_functions = []

    def fake_compile(fn):
        compiled_functions.append(fn)
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    monkeypatch.setattr(torch, "compile", fake_compile)

    def double(x, *, times=2):
        return x * times

    deferred = compile_on_first_call(double)
    assert compiled_functions == [] and deferred.__wrapped__ is double
    assert deferred(3) == ("compiled", 6)
    assert deferred(3, times=3) == ("compiled", 9)
    assert compiled_functions == [double]  # compiled once, on the first call

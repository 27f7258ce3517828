"""Import DeepSpeed's Muon module without building torch.compile's inductor wrapper at import.

DeepSpeed checks every ZeRO optimizer against its Muon class (`is_zero_supported_optimizer`) and
its bf16 optimizer does too, so every ZeRO or bf16 rank imports `deepspeed.runtime.zero.muon`.
That module decorates three functions with `torch.compile` at import, which imports inductor's
compiler: about 1.9 CPU-seconds on every rank before its first step (torch 2.13, DeepSpeed 0.19.8,
measured on the 2-core CPU host; BENCHMARKS.md), for an optimizer megaframe does not use.

Importing it once, with DeepSpeed's `compiler.compile()` answering a decorator that calls
`torch.compile(fn)` on the function's first call instead of at import, leaves Muon as it was (the
same function compiled with the same default arguments, only later) and takes the cost off every
rank's start. Later imports find the module in `sys.modules` and run nothing.
"""
from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable

import torch

MUON_MODULES = ("deepspeed.runtime.zero.muon.original_muon", "deepspeed.runtime.zero.muon.muon_optimizer")


def compile_on_first_call(fn: Callable[..., Any], **compile_kwargs: Any) -> Callable[..., Any]:
    """`torch.compile(fn, **compile_kwargs)`, built when the function is first called rather than now."""
    compiled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn, **compile_kwargs)
        return compiled(*args, **kwargs)

    return call


def import_muon_lazily() -> None:
    """Import DeepSpeed's Muon modules (if this DeepSpeed has them) with compilation deferred."""
    if all(name in sys.modules for name in MUON_MODULES):
        return
    from deepspeed.runtime import compiler

    original = compiler.compile
    # what `@compiler.compile(...)` reads at import: the same arguments, applied on the first call
    compiler.compile = lambda **kwargs: functools.partial(compile_on_first_call, **kwargs)
    try:
        for name in MUON_MODULES:
            importlib.import_module(name)
    except ImportError:  # an older DeepSpeed without Muon: nothing imports it either
        pass
    finally:
        compiler.compile = original

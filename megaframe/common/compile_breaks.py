"""Functions that run eagerly inside compiled blocks (train.compile): a graph break at each.

torch.compiler.disable as a decorator imports torch._dynamo, which took 2.3 s of every process's
start-up (each rank of every run, the CLI, every test) though only train.compile=true compiles.
Functions are marked here at import for free, and disabled when compilation is first asked for
(model/factory.py compile_blocks, before any block is traced). A marked function must be looked up
where it is called (a module global or a class attribute), so the disabled one replaces it there.
"""
from __future__ import annotations

import importlib
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)
_MARKED: list[tuple[str, str]] = []  # (module, qualified name) of each marked function


def run_eagerly(fn: F) -> F:
    """Mark fn (a module-level function or a method) to run outside torch.compile's graphs."""
    _MARKED.append((fn.__module__, fn.__qualname__))
    return fn


def disable_marked() -> int:
    """torch.compiler.disable every marked function in place; returns how many it replaced."""
    import torch

    replaced = 0
    for module_name, qualname in _MARKED:
        owner = importlib.import_module(module_name)
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        current = vars(owner)[name]
        if not getattr(current, "_torchdynamo_disable", False):
            setattr(owner, name, torch.compiler.disable(current))
            replaced += 1
    return replaced

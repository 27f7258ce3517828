"""The device's random generators: one per device, apart from the CPU's (own seed, own state), as
CUDA keeps them. They are CPU generator objects that only this tier hands out; a random op on a
device tensor draws from its device's, and refuses any other generator passed to it."""
from __future__ import annotations

import torch

from tests.support.fakecuda.tensor import resolve_index, state

_generators: list[torch.Generator] = []
DEFAULT_SEED = 67280421310721  # CUDA's default seed, as c10 uses


def generators() -> list[torch.Generator]:
    if not _generators:
        _generators.extend(torch.Generator().manual_seed(DEFAULT_SEED) for _ in range(state["count"]))
    return _generators


def is_device_generator(generator: torch.Generator, index: int | None = None) -> bool:
    """Whether this is one of the device's generators. The dispatcher hands an op a new Python object
    for the same generator, so identity cannot tell: the state does (a CPU generator holding exactly a
    device generator's state passes; one seeded or drawn otherwise does not). index: that device's only."""
    candidates = generators() if index is None else [generators()[index]]
    if any(generator is g for g in candidates):
        return True
    state = generator.get_state()
    return any(torch.equal(state, g.get_state()) for g in candidates)


def _generator(device="cuda") -> torch.Generator:
    index = resolve_index(device)
    if index is None:
        raise ValueError(f"not a cuda device: {device!r}")
    return generators()[index]


def get_rng_state(device="cuda") -> torch.Tensor:
    return _generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device="cuda") -> None:
    _generator(device).set_state(new_state.clone())


def get_rng_state_all() -> list[torch.Tensor]:
    return [g.get_state() for g in generators()]


def set_rng_state_all(new_states) -> None:
    for g, s in zip(generators(), new_states):
        g.set_state(s.clone())


def manual_seed(seed: int) -> None:
    _generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for g in generators():
        g.manual_seed(int(seed))


def seed() -> None:
    _generator().seed()


def seed_all() -> None:
    first = generators()[0].seed()
    for g in generators()[1:]:
        g.manual_seed(first)


def initial_seed() -> int:
    return _generator().initial_seed()


def install(cuda) -> None:
    """The torch.cuda RNG functions (torch.manual_seed calls torch.cuda.manual_seed_all)."""
    for f in (get_rng_state, set_rng_state, get_rng_state_all, set_rng_state_all, manual_seed, manual_seed_all,
              seed, seed_all, initial_seed):
        setattr(cuda, f.__name__, f)
        if hasattr(cuda, "random"):
            setattr(cuda.random, f.__name__, f)
    cuda.default_generators = tuple(generators())

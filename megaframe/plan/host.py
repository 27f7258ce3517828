"""Host memory per node: what the ranks keep in the node's RAM on purpose, against cluster.host_memory_gb.

A layout can fit the GPUs and still be killed by the host's OOM killer in its first step or its
first save: ZeRO-Offload keeps the optimizer states in RAM (12 bytes a parameter over the data-
parallel ranks, for every rank of the node), a background save (train.async_save) copies the rank's
checkpoint shard into host buffers it keeps for the run (checkpoint/staging.py), and the fast tier
(train.fast_save_interval) keeps checkpoint parts in node memory (/dev/shm). The planner counts:

- offloaded: the states offload=cpu moves to RAM (NVMe-offloaded states are on the drive);
- async copies: the rank's shard of a checkpoint in its live dtypes (weights in the compute dtype,
  the fp32 master unless the run is fp32, the optimizer's fp32 tensors), the bytes the staging
  fills; its buffers round this up to 256 MiB slabs, and a piece beyond a slab to a power of two;
- fast tier: the rank's part as written (weights widened to fp32), four times: its own and its
  buddy's, the previous step's kept until the new one is everywhere (checkpoint/fast_tier.py).

On cluster=local without a GPU, the ranks' "device" memory is this RAM too: their whole peak counts.
What the processes hold for themselves (Python, torch's and CUDA's libraries, data loaders, the page
cache) is not counted: set cluster.host_memory_gb to what the job may use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megaframe.config.schema import TrainConfig

FAST_TIER_PARTS = 4  # own + buddy's, the previous step's and the new one's while a save completes


@dataclass(frozen=True)
class CheckpointCopies:
    """What the run's saves keep in host memory (train.async_save, train.fast_save_interval)."""

    async_save: bool = False
    fast_tier: bool = False


def checkpoint_copies(cfg: TrainConfig) -> CheckpointCopies:
    return CheckpointCopies(async_save=cfg.train.async_save, fast_tier=cfg.train.fast_save_interval > 0)


def saved_bytes_per_parameter(dtype: str, state_tensors: int, widened: bool) -> int:
    """Bytes a parameter's checkpoint entries take: its weight (the compute dtype as held, fp32 as
    written), the fp32 master unless the run is fp32 (both engines: their fp32 tensor is the weight
    then), and the optimizer's fp32 tensors (Adam's 2, Muon's matrices 1)."""
    weight = 4 if widened or dtype == "fp32" else 2
    return weight + (0 if dtype == "fp32" else 4) + 4 * state_tensors


@dataclass(frozen=True)
class HostMemory:
    """Per node: what the ranks keep in host memory, against what the node has (None: unknown)."""

    ranks: int  # ranks on one node
    offloaded: float  # per rank
    async_copies: float  # per rank
    fast_tier: float  # per rank
    device_in_ram: float  # per rank: the whole peak of a rank whose device is this host's RAM
    capacity: Optional[float]  # per node

    @property
    def per_rank(self) -> float:
        return self.offloaded + self.async_copies + self.fast_tier + self.device_in_ram

    @property
    def peak(self) -> float:
        return self.ranks * self.per_rank

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.peak <= self.capacity

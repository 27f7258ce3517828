"""The launcher's variables (torchrun, srun via slurm.adopt_slurm_env, Ray, or set by hand) checked
before a rank joins its process group: torch's env:// join took `RANK >= WORLD_SIZE` and ended in
C++ stack dumps, `WORLD_SIZE=0` in a Python traceback. One line, exit 2, instead. Imports no torch:
megaframe-train asks before it composes anything."""
from __future__ import annotations

import os
from typing import Mapping, Optional

_INT_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def usable_cores() -> int:
    """The cores this process may run on (os.sched_getaffinity: a SLURM job's or a container's share,
    not the whole machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity mask
        return os.cpu_count() or 1


def _as_int(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name)
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def launch_env_problem(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """What is wrong with the launcher's variables (torchrun, srun, Ray, or set by hand), or None.
    Unset RANK and WORLD_SIZE mean no launcher: a world of one."""
    fix = "; the launcher (torchrun, srun) sets them: unset them to run one process, or fix the launch"
    try:
        rank, world, local_rank, local_world = (_as_int(env, name) for name in _INT_VARS)
    except ValueError as err:
        return f"{err}{fix}"
    if rank is None and world is None:
        return None
    if rank is None or world is None:
        have, missing = ("RANK", "WORLD_SIZE") if world is None else ("WORLD_SIZE", "RANK")
        return f"{have}={env[have]} is set but {missing} is not{fix}"
    if world < 1:
        return f"WORLD_SIZE={world} must be >= 1{fix}"
    if not 0 <= rank < world:
        return f"RANK={rank} must be in [0, WORLD_SIZE={world}){fix}"
    if local_world is not None and not 1 <= local_world <= world:
        return f"LOCAL_WORLD_SIZE={local_world} must be in [1, WORLD_SIZE={world}]{fix}"
    if local_rank is not None and local_rank < 0:
        return f"LOCAL_RANK={local_rank} must be >= 0{fix}"
    if local_rank is not None and local_world is not None and local_rank >= local_world:
        return f"LOCAL_RANK={local_rank} must be in [0, LOCAL_WORLD_SIZE={local_world}){fix}"
    if world > 1:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(name, "").strip():
                return (f"{name} is not set, and WORLD_SIZE={world} ranks need it to find rank 0's rendezvous{fix}")
        port = env["MASTER_PORT"].strip()
        if not (port.isdigit() and 1 <= int(port) <= 65535):
            return f"MASTER_PORT={env['MASTER_PORT']!r} must be a TCP port in [1, 65535]{fix}"
    return None

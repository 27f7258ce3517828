"""The engine's own checkpoint files (DeepSpeed names no paths) are hashed for the manifest by every
rank, each its share: rank 0 lists them and scatters the shares. Every rank listing and stat-ing every
file was world² metadata operations on a parallel file system's metadata server each native save
(9M at 3,072 ranks). Real gloo ranks; what the file system says to rank 0 reaches every rank."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest

from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow


def _shares(rank: int, world: int, tmp: str, fail: bool) -> tuple[list[str], int]:
    from megaframe.checkpoint import store

    listed = []
    real = Path.rglob

    def rglob(self, pattern):
        listed.append(str(self))
        if fail:
            raise OSError(errno.EIO, "Input/output error", str(self))
        return real(self, pattern)
    Path.rglob = rglob
    try:
        share = store._native_share(Path(tmp), rank, world)
    except OSError as err:
        return [f"raised {err.errno}"], len(listed)
    finally:
        Path.rglob = real
    return [path.relative_to(tmp).as_posix() for path in share], len(listed)


@pytest.mark.parametrize("fail", [False, True])
def test_rank_0_lists_the_engine_files_once_and_every_rank_hashes_its_share(tmp_path, fail):
    tmp = tmp_path / "tmp-global_step4"
    names = sorted([f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)] + ["mp_rank_00_model_states.pt",
                                                                                          "sub/extra.bin"])
    for name in names:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(b"x")
    (tmp / ".hidden").write_bytes(b"not the engine's")
    results = run_ranks(_shares, 3, tmp_path, tmp=str(tmp), fail=fail)
    listings = [listed for _, listed in results]
    assert listings == [1, 0, 0], listings  # rank 0 alone lists the directory
    shares = [share for share, _ in results]
    if fail:  # the storage's error on every rank, none left waiting in the scatter
        assert shares == [[f"raised {errno.EIO}"]] * 3, shares
        return
    assert sorted(n for share in shares for n in share) == names and all(len(s) == 2 for s in shares), shares

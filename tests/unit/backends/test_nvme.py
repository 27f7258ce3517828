"""NVMe swap folders: removed at exit (also without an explicit remove), and a killed run's debris is
removed when the next run starts, while the folders of live runs are left alone."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from tests.support.helpers import REPO, cli_env
from megaframe.backends.deepspeed.nvme import SWAP_FOLDER, NvmeSwap

# A process that opens its swap folder, writes a 2 MiB "swap file", reports the folder and waits.
CHILD = """
import sys, time
from megaframe.backends.deepspeed.nvme import NvmeSwap
swap = NvmeSwap(sys.argv[1])
(swap.path / "zero_stage_3" / "optimizer").mkdir(parents=True)
(swap.path / "zero_stage_3" / "optimizer" / "0.tensor.swp").write_bytes(bytes(2 << 20))
print(swap.path, flush=True)
if sys.argv[2] == "wait":
    time.sleep(600)
"""


def _child(nvme_path, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(nvme_path), mode], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, env=cli_env(PYTHONPATH=str(REPO)))


def test_folder_is_removed_at_interpreter_exit(tmp_path):
    child = _child(tmp_path, "exit")
    folder = child.stdout.readline().strip()
    assert child.wait(timeout=60) == 0
    assert folder.startswith(str(tmp_path / SWAP_FOLDER)) and not os.path.exists(folder)


def test_killed_run_debris_is_removed_at_next_start_but_live_runs_are_kept(tmp_path):
    killed, alive = _child(tmp_path, "wait"), _child(tmp_path, "wait")
    try:
        killed_folder, alive_folder = killed.stdout.readline().strip(), alive.stdout.readline().strip()
        killed.send_signal(signal.SIGKILL)  # no atexit, no finally: the swap file stays behind
        killed.wait(timeout=60)
        assert os.path.getsize(os.path.join(killed_folder, "zero_stage_3", "optimizer", "0.tensor.swp")) == 2 << 20
        other_host = tmp_path / SWAP_FOLDER / "some-other-host-1"
        other_host.mkdir()
        swap = NvmeSwap(tmp_path)
        assert [str(p) for p in swap.removed_stale] == [killed_folder]
        assert not os.path.exists(killed_folder)
        assert os.path.exists(alive_folder) and other_host.exists(), "a live run's (or another host's) folder was removed"
        assert swap.path.name == f"{socket.gethostname()}-{os.getpid()}" and swap.files() == {}
        (swap.path / "x.swp").write_bytes(b"1234")
        assert swap.files() == {"x.swp": 4}
        swap.remove()
        swap.remove()  # idempotent (atexit calls it again)
        assert not swap.path.exists() and alive_folder and os.path.exists(alive_folder)
    finally:
        for child in (killed, alive):
            if child.poll() is None:
                child.kill()
                child.wait(timeout=60)

"""megaframe/common/startup.py: the collector paused at megaframe-train's entry and resumed (with start-up's
objects frozen) where start-up ends; a no-op where the entry point did not pause it."""
from __future__ import annotations

import gc
import subprocess
import sys

from tests.support.helpers import TINY, cli_env


def test_resume_undoes_only_its_own_pause():
    from megaframe.common import startup

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    startup.resume_collector()  # not paused by us: nothing happens, nothing is frozen
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    try:
        startup.pause_collector()
        assert not gc.isenabled()
        startup.resume_collector()
        assert gc.isenabled() and gc.get_freeze_count() > frozen
        gc.unfreeze()
        startup.resume_collector()  # once only
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        gc.enable()


PROBE = """
import atexit, gc, sys
atexit.register(lambda: print("collector on:", gc.isenabled(), flush=True))
sys.argv = ["megaframe-train", *sys.argv[1:]]
from megaframe.train import main
main()
"""


def test_a_process_that_only_launches_collects_again(tmp_path):
    """launcher=slurm's dry run writes the job script and ends in this process: start-up ended there."""
    done = subprocess.run([sys.executable, "-c", PROBE, *TINY, "launcher=slurm", "cluster=h100_80g",
                           "launcher.dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, env=cli_env(), timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "collector on: True"

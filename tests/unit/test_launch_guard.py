"""A rank dies with its launcher (megaframe/launch/guard.py), also when an external torchrun is
killed while the rank is still importing: the parent noted at the entry point's first line is the
one die_with_launcher holds the rank to. Before, under an external torchrun nothing named the
launcher, and a rank orphaned during its imports trained on under PID 1."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

RANK = textwrap.dedent("""
    import os, sys, time
    from megaframe.launch.guard import die_with_launcher, remember_parent
    remember_parent()  # what megaframe/train.py's main() does first
    first_parent = os.getppid()
    open(sys.argv[1], "w").write(str(os.getpid()))
    while os.getppid() == first_parent:  # 'the imports': meanwhile the launcher is killed outright
        time.sleep(0.01)
    die_with_launcher()
    open(sys.argv[2], "w").write("trained on")
""")
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], start_new_session=True,
                     env={**os.environ, "TORCHELASTIC_RUN_ID": "job"})
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.01)
    os._exit(137)  # killed outright, after the rank began
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_rank_whose_torchrun_is_killed_during_its_imports_exits_at_once(tmp_path):
    ready, survived = tmp_path / "ready", tmp_path / "survived"
    subprocess.run([sys.executable, "-c", LAUNCHER, RANK, str(ready), str(survived)], check=False, timeout=60,
                   cwd=os.getcwd())
    pid = int(ready.read_text())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}") and not survived.exists():
        time.sleep(0.05)
    assert not survived.exists(), "the orphaned rank went on"
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"

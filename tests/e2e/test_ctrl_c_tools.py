"""Ctrl-C while megaframe-convert, megaframe-plan or megaframe-eval has no stop handling of its own
(its imports, a composition, an evaluation): one line and exit 130, not a KeyboardInterrupt traceback
(found by review: 12 to 93 lines). The console scripts run as a user runs them; a module the tool
imports is made slow (sitecustomize) so that the signal lands inside that import every time."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.helpers import cli_env

_SLOW_IMPORT = """
import importlib.abc, os, pathlib, sys, time
class _SlowImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == os.environ.get("MEGAFRAME_TEST_SLOW_IMPORT"):
            sys.meta_path.remove(self)
            pathlib.Path(os.environ["MEGAFRAME_TEST_MARKER"]).touch()
            time.sleep(30)
        return None
sys.meta_path.insert(0, _SlowImport())
"""


@pytest.mark.parametrize("tool, args, slow", [
    ("megaframe-convert", ["from-hf", "hf", "out"], "megaframe.convert.hf"),  # torch, as cli.py loads
    ("megaframe-plan", ["recipe=llama2_7b"], "megaframe.config.compose"),  # the composition
    ("megaframe-eval", ["run/checkpoints"], "megaframe.common.failures"),  # the first of main's imports
])
def test_ctrl_c_before_a_tool_handles_it_is_one_line_and_130(tool, args, slow, tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_SLOW_IMPORT)
    env = cli_env()
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), env.get("PYTHONPATH", "")]),
               MEGAFRAME_TEST_SLOW_IMPORT=slow, MEGAFRAME_TEST_MARKER=str(tmp_path / "importing"))
    script = Path(sys.executable).parent / tool
    process = subprocess.Popen([str(script), *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "importing").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process.poll() is None, process.communicate()
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert (process.returncode, err) == (130, f"{tool}: interrupted\n")

"""A tool's result on stdout (common/result_output.py): a reader that closed the pipe is exit 0, a
write that fails (a full disk behind a redirect) or a closed stdout one line and exit 1; never a
BrokenPipeError or OSError traceback (review: megaframe-eval, -plan and -sample printed them)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import cli_env

PLAN = str(Path(sys.executable).parent / "megaframe-plan")


def _plan(stdout, tmp_path, pass_fds=()) -> subprocess.CompletedProcess:
    return subprocess.run([PLAN, "--json"], cwd=tmp_path, env=cli_env(), stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=120, pass_fds=pass_fds)


def test_a_full_disk_behind_the_redirect_is_one_line_and_exit_1(tmp_path):
    with open("/dev/full", "w") as full:
        done = _plan(full, tmp_path)
    assert (done.returncode, done.stderr.splitlines()[-1:]) == (1, [
        "megaframe-plan: error: cannot write the result to standard output (No space left on device); free space "
        "where it goes (a full disk or a quota) or print it elsewhere"]), done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


def test_a_reader_that_closed_the_pipe_is_exit_0_without_a_traceback(tmp_path):
    reader = subprocess.Popen(["true"], stdin=subprocess.PIPE)
    reader.wait()  # the pipe's read end closed before the tool writes: EPIPE on its first write
    done = _plan(reader.stdin, tmp_path)
    reader.stdin.close()
    assert done.returncode == 0 and "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, \
        done.stderr


@pytest.mark.parametrize("tool, args", [("megaframe-plan", "--json"), ("megaframe-eval", "no-such-checkpoint"),
                                        ("megaframe-sample", "no-such-checkpoint")])
def test_a_closed_stdout_is_one_line_and_exit_1_before_the_work(tmp_path, tool, args):
    """Said first: an evaluation or a generation ran to its end, then printed nothing (review)."""
    done = subprocess.run(f"exec {Path(sys.executable).parent / tool} {args} >&-", shell=True, cwd=tmp_path,
                          env=cli_env(), stderr=subprocess.PIPE, text=True, timeout=120)
    assert (done.returncode, done.stderr.splitlines()) == (1, [
        f"{tool}: error: standard output is closed, so the result cannot be printed; run it with stdout "
        "open (a file or a pipe)"]), done.stderr


def test_a_failed_write_in_the_block_is_the_same_line(monkeypatch, capsys):
    from megaframe.common import result_output

    class Full:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

        def fileno(self):
            return sys.__stdout__.fileno()

    monkeypatch.setattr(result_output, "_stdout_to_devnull", lambda: None)  # the test's own stdout stays
    monkeypatch.setattr(sys, "stdout", Full())
    with pytest.raises(SystemExit) as ended:
        with result_output.printed_to_stdout("tool"):
            print("result")
    assert ended.value.code == 1
    assert capsys.readouterr().err == ("tool: error: cannot write the result to standard output (No space left on "
                                       "device); free space where it goes (a full disk or a quota) or print it "
                                       "elsewhere\n")

"""megaframe-preprocess --valid-fraction (nanoGPT's prepare.py in one line), --workers capped at the
cores, and a stop signal that leaves no temp files and the previous dataset untouched (issues 50, 51)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megaframe.data import open_dataset, preprocess
from megaframe.data.preprocess_cli import main
from megaframe.data.preprocess_stop import Stopped, signals_deferred, stop_on_signals

EOD = 256


def _tokens(prefix: Path) -> list[list[int]]:
    dataset = open_dataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


def test_one_text_file_splits_as_nanogpt_prepare_does(tmp_path, capsys):
    """One .txt: the last 10% of its bytes are validation, as nanoGPT's prepare.py splits
    (data[:int(n*0.9)], data[int(n*0.9):]), each part a document that ends with the end-of-document id."""
    text = "".join(f"line {i}: to be or not to be\n" for i in range(300))
    (tmp_path / "book.txt").write_text(text)
    assert main(["--input", str(tmp_path / "book.txt"), "--output-prefix", str(tmp_path / "book"),
                 "--valid-fraction", "0.1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == (f"megaframe-preprocess: train on them with data.path={tmp_path / 'book'} "
                       f"data.valid_path={tmp_path / 'book'}_val")
    data = text.encode()
    n = len(data)
    assert _tokens(tmp_path / "book") == [list(data[:int(n * 0.9)]) + [EOD]]
    assert _tokens(tmp_path / "book_val") == [list(data[int(n * 0.9):]) + [EOD]]


def test_many_documents_hold_out_whole_documents(tmp_path):
    """Several documents: the last ceil(f x n) of them, whole, as data.valid_fraction; the prefix of
    the held-out part is the one named."""
    docs = [f"document {i} " * (i + 1) for i in range(25)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    summary = preprocess([tmp_path / "docs.jsonl"], tmp_path / "train", "byte", valid_fraction=0.1,
                         valid_prefix=tmp_path / "held" / "val")
    as_tokens = [list(d.encode()) + [EOD] for d in docs]
    assert _tokens(tmp_path / "train") == as_tokens[:22] and _tokens(tmp_path / "held" / "val") == as_tokens[22:]
    assert (summary["num_documents"], summary["valid"]["num_documents"]) == (22, 3)


@pytest.mark.parametrize("args, says", [
    (["--valid-fraction", "1"], "--valid-fraction 1.0: must be at least 0 and below 1"),
    (["--valid-fraction", "0.999"], "--valid-fraction 0.999 leaves no training text of the input's 2 tokens"),
    (["--valid-output-prefix", "v"], "--valid-output-prefix needs --valid-fraction"),
    (["--valid-fraction", "0.1", "--valid-output-prefix", "{tmp}/a"], "is --output-prefix too"),
])
def test_a_split_that_cannot_be_made_is_one_line(tmp_path, capsys, args, says):
    (tmp_path / "a.txt").write_text("ab")
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    assert main(["--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "a"), *args]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert says in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]  # nothing written, no temp file left


def test_workers_are_capped_at_the_cores_available(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    (tmp_path / "a.txt").write_text("some text")
    assert main(["--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "a"), "--workers", "500"]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip() == ("megaframe-preprocess: --workers 500: capped at 1, the cores this process may use "
                                    "(os.sched_getaffinity)")
    assert "1 workers" in captured.out
    assert main(["--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "a"), "--workers", "1"]) == 0
    assert capsys.readouterr().err == ""


def test_a_signal_while_the_dataset_moves_into_place_waits_for_it():
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signals():
        moved = False
        with pytest.raises(Stopped) as stopped:
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                moved = True  # reached: the signal did not interrupt the block
        assert moved and stopped.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back


def test_a_signal_ignored_at_start_stays_ignored_as_nohup_asks():
    """`nohup megaframe-preprocess ... &` then logging out: SIGHUP used to stop the tool (exit 129)."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup leaves to the process it starts
    try:
        with stop_on_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)  # ignored: the block goes on
            with pytest.raises(Stopped):  # the others still stop it
                os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGHUP, before)


# the tool run as a user runs it, slowed down in the parent (each document takes 20 ms to write) so
# that the signal lands while the temp files grow; the first document written (by then the workers
# have started and sent it) leaves the file named by argv[1]
_SLOW = """
import pathlib, sys, time
from megaframe.data import indexed
end, started = indexed.IndexedDatasetWriter.end_document, pathlib.Path(sys.argv.pop(1))
def slow(self):
    end(self)
    started.touch()
    time.sleep(0.02)
indexed.IndexedDatasetWriter.end_document = slow
from megaframe.data.preprocess_cli import console_main
sys.argv = ["megaframe-preprocess", *sys.argv[1:]]
console_main()
"""


@pytest.mark.parametrize("signum, workers, group", [(signal.SIGTERM, 1, False), (signal.SIGINT, 2, True)],
                         ids=["sigterm", "ctrl-c-with-workers"])
def test_a_stopped_preprocess_leaves_no_temp_files_and_the_old_dataset(tmp_path, signum, workers, group):
    """SIGTERM to the tool, or Ctrl-C to its whole process group (what a terminal sends, workers
    included): one line, exit 128+N, no hidden temp file, no process left, the old dataset intact."""
    (tmp_path / "old.txt").write_text("the previous dataset")
    preprocess([tmp_path / "old.txt"], tmp_path / "ds", "byte")
    before = {p.name: p.read_bytes() for p in tmp_path.glob("ds.*")}
    (tmp_path / "new.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(2000)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    started = tmp_path.parent / f"{tmp_path.name}.started"
    tool = subprocess.Popen([sys.executable, "-c", _SLOW, str(started), "--input", str(tmp_path / "new.jsonl"), "--output-prefix",
                             str(tmp_path / "ds"), "--workers", str(workers), "--valid-fraction", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    assert tool.poll() is None and list(tmp_path.glob(".ds.bin.*.tmp")) and list(tmp_path.glob(".ds_val.bin.*.tmp"))
    (os.killpg if group else os.kill)(tool.pid, signum)
    _, err = tool.communicate(timeout=60)
    assert tool.returncode == 128 + signum, err
    assert err.strip().splitlines() == [f"megaframe-preprocess: stopped by {signal.Signals(signum).name}: nothing "
                                        f"written, temporary files removed; a dataset already at {tmp_path / 'ds'} "
                                        f"is untouched"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.bin", "ds.idx", "ds.json", "new.jsonl", "old.txt"]
    assert {p.name: p.read_bytes() for p in tmp_path.glob("ds.*")} == before
    with pytest.raises(ProcessLookupError):  # no worker outlived the tool
        for _ in range(50):
            os.killpg(tool.pid, 0)
            time.sleep(0.1)


# a spawned worker (its argv ends in --multiprocessing-fork) that is slow to start: it leaves its pid in
# the folder named by MEGAFRAME_TEST_WORKER_STARTS and sleeps before megaframe's initializer can run
_SLOW_WORKER_START = """
import os, pathlib, sys, time
if "--multiprocessing-fork" in sys.argv:
    pathlib.Path(os.environ["MEGAFRAME_TEST_WORKER_STARTS"], str(os.getpid())).touch()
    time.sleep(2)
"""


def test_ctrl_c_while_a_worker_is_still_starting_prints_one_line(tmp_path):
    """Ctrl-C to the process group while a tokenizer worker is still importing Python, before its
    initializer ignores SIGINT (CI caught the race once: the worker's KeyboardInterrupt traceback)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_SLOW_WORKER_START)
    (tmp_path / "starts").mkdir()
    (tmp_path / "new.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(2000)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), *sys.path]),
           "MEGAFRAME_TEST_WORKER_STARTS": str(tmp_path / "starts")}
    tool = subprocess.Popen([sys.executable, "-m", "megaframe.data.preprocess_cli",
                             "--input", str(tmp_path / "new.jsonl"),
                             "--output-prefix", str(tmp_path / "ds"), "--workers", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while not any((tmp_path / "starts").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert tool.poll() is None
    os.killpg(tool.pid, signal.SIGINT)  # a worker is asleep in its start-up
    _, err = tool.communicate(timeout=60)
    assert tool.returncode == 128 + signal.SIGINT, err
    assert err.strip().splitlines() == [f"megaframe-preprocess: stopped by SIGINT: nothing written, temporary files "
                                        f"removed; a dataset already at {tmp_path / 'ds'} is untouched"]
    assert not list(tmp_path.glob("ds.*")) and not list(tmp_path.glob(".ds.*"))
    with pytest.raises(ProcessLookupError):  # no worker outlived the tool
        for _ in range(50):
            os.killpg(tool.pid, 0)
            time.sleep(0.1)


# the tool run as a user runs it, a SIGINT sent to itself alone as a tokenizer worker is being
# started: just after its process is spawned (argv[1] "spawn") or just after Process.start returns
# ("start"), before the pool has sent it its start-up data or counted it; a short sleep widens the window
_STOP_WHILE_SPAWNING = """
import os, signal, sys, time
from multiprocessing import process, util
where = sys.argv.pop(1)
spawn, start = util.spawnv_passfds, process.BaseProcess.start
def stop_now():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
def spawning(path, args, passfds):
    pid = spawn(path, args, passfds)
    if where == "spawn" and args[-1] == "--multiprocessing-fork":
        stop_now()
    return pid
def starting(self):
    start(self)
    if where == "start":
        stop_now()
util.spawnv_passfds, process.BaseProcess.start = spawning, starting
from megaframe.data.preprocess_cli import console_main
sys.argv = ["megaframe-preprocess", *sys.argv[1:]]
console_main()
"""


@pytest.mark.parametrize("where", ["spawn", "start"])
def test_a_stop_while_a_worker_is_being_started_waits_for_the_start(tmp_path, where):
    """Another thread (tqdm's monitor) may take the signal and Python runs the handler in the main
    thread inside pool.submit: a worker then read a broken pipe, or outlived the pool uncounted, and
    printed a traceback (found by review)."""
    (tmp_path / "new.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(200)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    tool = subprocess.Popen([sys.executable, "-c", _STOP_WHILE_SPAWNING, where, "--input", str(tmp_path / "new.jsonl"),
                             "--output-prefix", str(tmp_path / "ds"), "--workers", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    _, err = tool.communicate(timeout=120)  # until every process holding stderr (a worker too) is gone
    assert tool.returncode == 128 + signal.SIGINT, err
    assert err.strip().splitlines() == [f"megaframe-preprocess: stopped by SIGINT: nothing written, temporary "
                                        f"files removed; a dataset already at {tmp_path / 'ds'} is untouched"]
    with pytest.raises(ProcessLookupError):  # no worker outlived the tool
        for _ in range(50):
            os.killpg(tool.pid, 0)
            time.sleep(0.1)


def test_the_temp_files_of_a_killed_run_are_removed_by_the_next(tmp_path, capsys):
    """SIGKILL runs no handler: the next megaframe-preprocess of the prefix removes what the killed
    one left, and only that (not a live writer's, nor another host's on a shared file system)."""
    (tmp_path / "new.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(2000)))
    started = tmp_path.parent / f"{tmp_path.name}.started"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    tool = subprocess.Popen([sys.executable, "-c", _SLOW, str(started), "--input", str(tmp_path / "new.jsonl"),
                             "--output-prefix", str(tmp_path / "ds")], env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    tool.kill()
    tool.wait(timeout=60)
    left = sorted(p.name for p in tmp_path.glob(".ds.*.tmp"))
    assert left and all(f"-{tool.pid}." in name for name in left)
    host = socket.gethostname().replace(".", "_")
    kept = [f".ds.bin.{host}-1.abcd1234.tmp", f".ds.bin.other_node-{tool.pid}.abcd1234.tmp", ".dsx.bin.h-1.a.tmp"]
    for name in kept:  # pid 1 lives; another node's writer cannot be judged from here
        (tmp_path / name).write_bytes(b"x")
    assert main(["--input", str(tmp_path / "new.jsonl"), "--output-prefix", str(tmp_path / "ds")]) == 0
    assert capsys.readouterr().err == (f"megaframe-preprocess: removed {len(left)} temporary files that a killed "
                                       f"megaframe-preprocess left beside {tmp_path / 'ds'}\n")
    assert sorted(p.name for p in tmp_path.glob(".*.tmp")) == sorted(kept)


def _old_pair(tmp_path: Path) -> dict[str, bytes]:
    """A train/validation pair already at tmp/ds and tmp/ds_val, and new input at tmp/new.jsonl."""
    (tmp_path / "old.jsonl").write_text("".join(json.dumps({"text": f"old {i}"}) + "\n" for i in range(20)))
    preprocess([tmp_path / "old.jsonl"], tmp_path / "ds", "byte", valid_fraction=0.1)
    (tmp_path / "new.jsonl").write_text("".join(json.dumps({"text": f"new {i}"}) + "\n" for i in range(20)))
    return {p.name: p.read_bytes() for p in tmp_path.glob("ds*.*")}


def test_a_signal_once_the_datasets_are_in_place_reports_them_complete(tmp_path, capsys, monkeypatch):
    """The signal waited for the renames, then the tool said "nothing written ... untouched" (exit
    143) about the datasets it had just replaced."""
    from megaframe.data.indexed import IndexedDatasetWriter

    _old_pair(tmp_path)
    commit = IndexedDatasetWriter.commit

    def signalled(self):
        os.kill(os.getpid(), signal.SIGTERM)  # lands while the datasets move into place
        return commit(self)

    monkeypatch.setattr(IndexedDatasetWriter, "commit", signalled)
    assert main(["--input", str(tmp_path / "new.jsonl"), "--output-prefix", str(tmp_path / "ds"),
                 "--valid-fraction", "0.1"]) == 0
    out, err = capsys.readouterr()
    assert f"megaframe-preprocess: wrote {tmp_path / 'ds'}.{{bin,idx,json}}" in out
    assert f"data.path={tmp_path / 'ds'} data.valid_path={tmp_path / 'ds'}_val" in out
    assert err.strip().splitlines() == ["megaframe-preprocess: stopped by SIGTERM after the datasets were written "
                                        "and in place: they are complete"]
    assert _tokens(tmp_path / "ds")[0] == list(b"new 0") + [EOD] and len(_tokens(tmp_path / "ds_val")) == 2


def test_the_pair_is_published_only_once_both_are_complete(tmp_path, capsys, monkeypatch):
    """--valid-fraction moved the training set into place, then failed on the held-out one: a new
    training set beside the old validation set, and the tool said nothing of it."""
    from megaframe.data.indexed import IndexedDatasetWriter

    before = _old_pair(tmp_path)
    argv = ["--input", str(tmp_path / "new.jsonl"), "--output-prefix", str(tmp_path / "ds"), "--valid-fraction", "0.1"]
    prepare, commit = IndexedDatasetWriter.prepare, IndexedDatasetWriter.commit

    def full_disk(step):
        def failing(self, *args):
            if self.prefix.name == "ds_val":
                raise OSError(28, "No space left on device")
            return step(self, *args)
        return failing

    monkeypatch.setattr(IndexedDatasetWriter, "prepare", full_disk(prepare))  # writing the second set's index
    assert main(argv) == 1  # a full disk: no fault of the input (2)
    assert {p.name: p.read_bytes() for p in tmp_path.glob("ds*.*")} == before  # both previous sets stand
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp file left
    monkeypatch.setattr(IndexedDatasetWriter, "prepare", prepare)
    monkeypatch.setattr(IndexedDatasetWriter, "commit", full_disk(commit))  # the renames of the second set
    capsys.readouterr()
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"megaframe-preprocess: error: {tmp_path / 'ds'} was replaced, but moving {tmp_path / 'ds_val'} "
                    "into place failed (No space left on device): the two no longer match; run megaframe-preprocess "
                    "again")


def test_renames_that_fail_midway_do_not_claim_the_old_dataset_untouched(tmp_path, capsys, monkeypatch):
    """The first dataset's renames remove its old .json first: a failure after that left the old
    dataset without it, and the line said it was untouched (review)."""
    import errno

    from megaframe.data.indexed import IndexedDatasetWriter

    _old_pair(tmp_path)
    commit = IndexedDatasetWriter._commit

    def fails_after_the_json_went(self):
        (self.prefix.parent / f"{self.prefix.name}.json").unlink()
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(IndexedDatasetWriter, "_commit", fails_after_the_json_went)
    assert main(["--input", str(tmp_path / "new.jsonl"), "--output-prefix", str(tmp_path / "ds")]) == 2
    assert capsys.readouterr().err == (
        f"megaframe-preprocess: error: moving {tmp_path / 'ds'} into place failed (Input/output error): a dataset "
        "that was there may be incomplete now (its .json goes first, so it will not load unnoticed); run "
        "megaframe-preprocess again\n")
    monkeypatch.setattr(IndexedDatasetWriter, "_commit", commit)


def test_a_signal_while_the_report_prints_reports_the_datasets_complete(tmp_path, capsys, monkeypatch):
    """The report printed after the stop handlers were put back: a Ctrl-C there ended a complete run
    with "interrupted" and 130 (a SIGTERM killed it, 143), against data.md's exit 0 (review)."""
    from megaframe.data import preprocess_cli

    _old_pair(tmp_path)
    report = preprocess_cli._report
    signalled = []

    def report_then_signal(summary):
        if not signalled:  # the first report only: the one the signal interrupts
            signalled.append(True)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)  # bytecodes, where the handler runs
        report(summary)
    monkeypatch.setattr(preprocess_cli, "_report", report_then_signal)
    assert main(["--input", str(tmp_path / "new.jsonl"), "--output-prefix", str(tmp_path / "ds")]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"megaframe-preprocess: wrote {tmp_path / 'ds'}.{{bin,idx,json}}: 20 documents")
    assert err.endswith("stopped by SIGINT after the datasets were written and in place: they are complete\n")


def test_a_report_that_cannot_be_printed_is_not_taken_for_a_failed_write(tmp_path, capsys, monkeypatch):
    """With the report under the tool's error handling, stdout closed by `| head -0` (BrokenPipeError)
    would have said "nothing was published" of datasets in place (reread)."""
    from megaframe.data import preprocess_cli

    _old_pair(tmp_path)

    def closed_pipe(summary):
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(preprocess_cli, "_report", closed_pipe)
    assert main(["--input", str(tmp_path / "new.jsonl"), "--output-prefix", str(tmp_path / "ds")]) == 0
    assert capsys.readouterr().err == ""
    assert open_dataset(tmp_path / "ds").num_tokens > 0 and (tmp_path / "ds.json").is_file()


def test_a_full_disk_names_the_folder_to_free(tmp_path, capsys, monkeypatch):
    """The kernel's ENOSPC on a write to an open file names no file: the line said "[Errno 28] No space
    left on device" (exit 2, bad input), and not which of the disks the user should free."""
    from megaframe.data.indexed import IndexedDatasetWriter

    before = _old_pair(tmp_path)
    open_temp = IndexedDatasetWriter._open_temp

    def to_dev_full(self, suffix):  # the temp file made as ever, its bytes sent where a full disk sends them
        open_temp(self, suffix).close()
        return open("/dev/full", "wb", buffering=0)
    monkeypatch.setattr(IndexedDatasetWriter, "_open_temp", to_dev_full)
    prefix = tmp_path / "ds"
    argv = ["--input", str(tmp_path / "new.jsonl"), "--output-prefix", str(prefix), "--valid-fraction", "0.1"]
    assert main(argv) == 1
    assert capsys.readouterr().err == (
        f"megaframe-preprocess: error: No space left on device writing {prefix} and {prefix}_val; free space in "
        f"{tmp_path} or write elsewhere; nothing was published (a dataset already at {prefix} is untouched)\n")
    assert {p.name: p.read_bytes() for p in tmp_path.glob("ds*.*")} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp file left
    other = tmp_path / "other" / "held"  # on another disk, perhaps: the line named only the training set's folder
    assert main([*argv, "--valid-output-prefix", str(other)]) == 1
    assert f"writing {prefix} and {other}; free space in {tmp_path} or {other.parent} or write" \
        in capsys.readouterr().err


def test_a_worker_that_dies_ends_the_run_in_one_line_not_a_wait_for_good(tmp_path):
    """multiprocessing.Pool lost the task of a worker the OOM killer took: the tool waited for its
    result for good, deaf to the scheduler's SIGTERM. Now: one line, exit 2, nothing left behind."""
    (tmp_path / "new.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(2000)))
    started = tmp_path.parent / f"{tmp_path.name}.started"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    tool = subprocess.Popen([sys.executable, "-c", _SLOW, str(started), "--input", str(tmp_path / "new.jsonl"),
                             "--output-prefix", str(tmp_path / "ds"), "--workers", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        children = psutil.Process(tool.pid).children()
        workers = [child.pid for child in children if "spawn_main" in " ".join(child.cmdline())]
        assert workers, [child.cmdline() for child in children]
        os.kill(workers[0], signal.SIGKILL)
        _, err = tool.communicate(timeout=120)
    finally:
        if tool.poll() is None:  # the wait for good this test is about: leave no process behind
            os.killpg(tool.pid, signal.SIGKILL)
    assert tool.returncode == 2, err
    (line,) = err.strip().splitlines()
    assert "a tokenizer worker died (killed, out of memory on a long document?)" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.jsonl"]
    with pytest.raises(ProcessLookupError):  # no worker outlived the tool
        for _ in range(50):
            os.killpg(tool.pid, 0)
            time.sleep(0.1)

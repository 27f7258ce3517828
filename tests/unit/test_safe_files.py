"""Nothing megaframe writes or reads by name in a run or checkpoint dir follows a link it did not
make (megaframe/common/safe_files.py): the lock, `latest`, metrics.jsonl, the logs, the temp files of
atomic writes; and no error line quotes more than a few sanitised characters of a file."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from megaframe.common import run_lock
from megaframe.common.atomic_io import atomic_write_text
from megaframe.checkpoint import universal
from megaframe.checkpoint.universal import CheckpointError
from megaframe.common.failures import ExitCode, classify
from megaframe.common.safe_files import UnsafeFile, create_fresh, open_regular, quote, read_capped
from megaframe.tracking.metrics import MetricsLog
from megaframe.checkpoint import store as checkpoint
from megaframe.training.failure_report import append_to_log

SECRET = "root:x:0:0:secret-victim-line\n"


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file outside the run dir a planted link points at; it must come out unchanged and unquoted."""
    path = tmp_path / "victim"
    path.write_text(SECRET)
    return path


def _unchanged(victim: Path) -> None:
    assert victim.read_text() == SECRET


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_a_planted_lock_is_refused_in_one_line_and_its_target_untouched(kind, tmp_path, victim):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = run_dir / run_lock.LOCK_NAME
    {"symlink": lambda: lock.symlink_to(victim), "fifo": lambda: os.mkfifo(lock), "directory": lock.mkdir}[kind]()
    problem = run_lock.acquire(run_dir)  # a FIFO must not hang the open, a link must not be truncated
    assert problem is not None and "\n" not in problem and str(lock) in problem and "hydra.run.dir" in problem
    assert {"symlink": "symbolic link", "fifo": "FIFO", "directory": "directory"}[kind] in problem
    assert run_dir.resolve() not in run_lock._held
    _unchanged(victim)


def test_a_lock_holder_record_is_quoted_short_and_sanitised(tmp_path):
    fd = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT)
    os.write(fd, b'{"pid": 7, "host": "h\\u001b[31m' + b"x" * 500 + b'", "since": "now"}')
    text = run_lock._holder_text(fd)
    os.close(fd)
    assert "\x1b" not in text and len(text) < 120 and text.startswith(" by pid 7 on h\\x1b[31mxxx")


@pytest.mark.parametrize("name", ["metrics.jsonl", "logs", "checkpoints/latest", "wandb_run_id"])
def test_a_link_planted_where_megaframe_writes_refuses_the_run_dir(name, tmp_path, victim):
    run_dir = tmp_path / "run"
    (run_dir / name).parent.mkdir(parents=True)
    (run_dir / name).symlink_to(victim)
    problem = run_lock.acquire(run_dir)
    assert problem is not None and f"{name} is a symbolic link" in problem and "\n" not in problem
    assert run_dir.resolve() not in run_lock._held


def test_checkpoints_as_a_link_to_other_storage_is_the_users_and_accepted(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / "mounted").mkdir()
    (run_dir / "checkpoints").symlink_to(tmp_path / "mounted")
    assert run_lock.acquire(run_dir) is None
    run_lock.release(run_dir)


def test_metrics_and_logs_do_not_append_or_read_through_a_link(tmp_path, victim):
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    with pytest.raises(UnsafeFile, match="symbolic link"):
        metrics.append({"step": 1})
    with pytest.raises(UnsafeFile, match="symbolic link"):
        metrics.truncate_after(0)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank0.log").symlink_to(victim)
    with pytest.raises(UnsafeFile):
        append_to_log(tmp_path / "logs" / "rank0.log", "Traceback ...")
    _unchanged(victim)


def test_atomic_writes_do_not_follow_a_link_planted_at_their_temp_name(tmp_path, victim):
    import socket

    target = tmp_path / "latest"
    (tmp_path / f".latest.tmp.{socket.gethostname()}.{os.getpid()}").symlink_to(victim)
    atomic_write_text(target, "global_step2\n")
    assert target.read_text() == "global_step2\n" and not target.is_symlink()
    _unchanged(victim)
    (tmp_path / "stale").symlink_to(victim)
    os.close(create_fresh(tmp_path / "stale"))
    assert stat.S_ISREG(os.lstat(tmp_path / "stale").st_mode)
    _unchanged(victim)


def test_latest_as_a_link_to_etc_passwd_is_exit_5_without_its_content(tmp_path):
    save_dir = tmp_path / "checkpoints"
    save_dir.mkdir()
    (save_dir / "latest").symlink_to("/etc/passwd")
    with pytest.raises(CheckpointError) as error:
        checkpoint.find_latest(save_dir)
    message = str(error.value)
    assert "symbolic link" in message and "root:" not in message and "\n" not in message
    assert classify(error.value).exit_code == ExitCode.BAD_CHECKPOINT


def test_latest_as_a_1_gb_file_or_holding_garbage_is_refused_quoting_a_few_characters(tmp_path):
    save_dir = tmp_path / "checkpoints"
    save_dir.mkdir()
    with open(save_dir / "latest", "wb") as f:  # sparse: 1 GB that costs no disk
        f.truncate(1 << 30)
    with pytest.raises(CheckpointError, match=r"holds 1073741824 bytes, more than the 4096"):
        universal.latest_pointer(save_dir)
    (save_dir / "latest").write_bytes(b"\x1b]0;pwned\x07" + b"A" * 3000)
    with pytest.raises(CheckpointError) as error:
        universal.latest_pointer(save_dir)
    message = str(error.value)
    assert "\x1b" not in message and "\x07" not in message and "A" * 61 not in message and "..." in message


def test_open_regular_and_read_capped(tmp_path):
    (tmp_path / "file").write_bytes(b"12345")
    assert read_capped(tmp_path / "file", 5) == b"12345"
    with pytest.raises(UnsafeFile, match="holds 5 bytes, more than the 4"):
        read_capped(tmp_path / "file", 4)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UnsafeFile, match="is a FIFO"):  # O_RDONLY on a FIFO with no writer: no hang
        read_capped(tmp_path / "fifo", 10)
    with pytest.raises(UnsafeFile, match="is a FIFO"):
        open_regular(tmp_path / "fifo", os.O_WRONLY)
    assert quote("a\nb" + "c" * 100, 5) == "a\\nbcc..."

"""The stop record an earlier attempt leaves in the run dir (parallel/elastic.py): megaframe's own
or nothing; a planted one neither writes the job log nor chooses the exit code."""
from __future__ import annotations

import json
import os

from megaframe.parallel import elastic


def test_a_recorded_stop_is_read_back(tmp_path, monkeypatch):
    path = tmp_path / ".job_stop" / "megaframe-1.json"
    monkeypatch.setenv(elastic.STOP_FILE_ENV, str(path))
    assert elastic.record_job_stop(4, "data.path=x: token id 300 is outside the model's vocabulary")
    assert elastic.job_stop() == (4, "data.path=x: token id 300 is outside the model's vocabulary")


def test_a_planted_stop_record_is_ignored(tmp_path, monkeypatch):
    path = tmp_path / "stop.json"
    monkeypatch.setenv(elastic.STOP_FILE_ENV, str(path))
    (tmp_path / "victim").write_text(json.dumps({"exit_code": 4, "message": "secret"}))
    path.symlink_to(tmp_path / "victim")
    assert elastic.job_stop() is None  # a link: not read through
    path.unlink()
    for record in ({"exit_code": 0, "message": "fake success"}, {"exit_code": 137, "message": "x"},
                   {"exit_code": "4", "message": ["not", "text"]}, [4, "x"]):
        path.write_text(json.dumps(record))
        assert elastic.job_stop() is None, record
    os.mkfifo(tmp_path / "fifo")
    monkeypatch.setenv(elastic.STOP_FILE_ENV, str(tmp_path / "fifo"))
    assert elastic.job_stop() is None  # no hang
    monkeypatch.setenv(elastic.STOP_FILE_ENV, str(path))
    path.write_text(json.dumps({"exit_code": 5, "message": "\x1b]0;pwned\x07" + "y" * 5000}))
    code, message = elastic.job_stop()
    assert code == 5 and "\x1b" not in message and len(message) < 1100 and message.endswith("y...")

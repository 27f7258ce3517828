"""logging.progress_bar: a bar on a terminal, plain lines in a log file, or as forced."""
from __future__ import annotations

import io

import pytest

from megaframe.tracking.progress import Progress, wants_bar


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_by_default_the_bar_follows_whether_stderr_is_a_terminal(monkeypatch, tty):
    monkeypatch.setattr("sys.stderr", _Stream(tty))
    assert wants_bar(None) is tty
    assert wants_bar(True) is True and wants_bar(False) is False  # forced either way


def test_without_the_bar_each_log_step_is_one_plain_line(capsys):
    progress = Progress(10, 0, enabled=False)
    progress.update(5, {"loss": 2.5, "loss_avg": 2.75, "tokens_per_s": 1000.0, "tflops": 0.01, "lr": 1e-3})
    progress.write("step 5: eval_loss 2.4000")
    out = capsys.readouterr()
    assert out.out.splitlines() == ["step 5: loss=2.5000 loss_avg=2.7500 tok/s=1000 TFLOP/s=0.01 lr=1.00e-03",
                                    "step 5: eval_loss 2.4000"]
    assert "\r" not in out.out + out.err

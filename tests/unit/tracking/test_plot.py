"""tools/plot_run.py on two runs writes a real PNG."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.support.helpers import REPO


def _fake_run(path, scale: float) -> None:
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(1, 21):
            f.write(json.dumps({"step": step, "loss": scale * 5 / step ** 0.3, "tokens_per_s": 1000 + 10 * step,
                                "consumed_tokens": step * 4096}) + "\n")
            if step % 5 == 0:
                f.write(json.dumps({"step": step, "eval_loss": scale * 5.2 / step ** 0.3, "consumed_tokens": step * 4096}) + "\n")


def test_plot_two_runs(tmp_path):
    _fake_run(tmp_path / "a", 1.0)
    _fake_run(tmp_path / "b", 1.1)
    out = tmp_path / "plots" / "runs.png"
    result = subprocess.run([sys.executable, "tools/plot_run.py", str(tmp_path / "a"), str(tmp_path / "b"),
                             "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_plot_refuses_a_directory_without_metrics(tmp_path):
    result = subprocess.run([sys.executable, "tools/plot_run.py", str(tmp_path)], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "no metrics.jsonl" in result.stderr

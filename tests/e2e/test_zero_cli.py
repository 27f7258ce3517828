"""docs/parallelism.md's offload commands run as written (shortened to a few steps), and a refused
combination in a multi-rank layout stops before any rank is launched."""
from __future__ import annotations

import re
import shlex

import pytest

from tests.support.helpers import REPO, assert_ok, read_metrics, run_cli
from megaframe.backends.deepspeed.compat import Combination, refusal

pytestmark = pytest.mark.slow
SHORT = ["train.max_steps=3", "train.log_interval=1", "train.eval_interval=0", "logging.wandb.mode=disabled", "logging.progress_bar=false"]


def _guide_commands() -> list[list[str]]:
    section = (REPO / "docs" / "parallelism.md").read_text().split("## Fit more on fewer GPUs with offload", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [[a for a in shlex.split(line.split("#", 1)[0])[1:] if not a.startswith("train.max_steps=")]
            for line in block.splitlines() if line.startswith("megaframe-train")]


def test_the_guides_offload_commands_run(tmp_path, deepspeed_ops):
    commands = _guide_commands()
    deepspeed_ops(*commands)  # built here, outside the runs' time limits
    assert any("offload=cpu" in c for c in commands) and any("offload=nvme" in c for c in commands)
    for i, args in enumerate(commands):
        nvme = tmp_path / f"nvme{i}"
        args = [re.sub(r"^offload\.nvme_path=.*", f"offload.nvme_path={nvme}", a) for a in args]
        run_dir = tmp_path / f"run{i}"
        result = run_cli([*args, *SHORT, f"hydra.run.dir={run_dir}"], timeout=900)
        assert_ok(result)
        assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2, 3]
        if "offload=nvme" in args:
            assert not (nvme / "megaframe-swap").exists(), "the run left its swap folder behind"


def test_refused_combination_stops_before_launching_ranks(tmp_path):
    combo = Combination(3, "cpu", "cpu", "fp32", "pp=2 × dp=2")
    result = run_cli([*combo.overrides(), "train.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"], timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == f"megaframe-train: error: {refusal(combo)}"
    assert "launching" not in result.stdout and not (tmp_path / "run").exists()

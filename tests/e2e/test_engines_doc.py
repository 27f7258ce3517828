"""docs/engines.md as a user reads it: its FSDP2 command trains, and the refusal it quotes is the
one the CLI prints."""
from __future__ import annotations

import re
import shlex

import pytest

from tests.support.helpers import REPO, assert_ok, read_metrics, run_cli

pytestmark = pytest.mark.slow
DOC = (REPO / "docs" / "engines.md").read_text()


COMMANDS = [line for line in DOC.replace("\\\n", " ").splitlines() if line.startswith("megaframe-train backend=fsdp2")]


@pytest.mark.parametrize("command", COMMANDS, ids=["plain", "pipeline"])
def test_the_documented_fsdp2_commands_train(command, tmp_path):
    args = shlex.split(command)[1:]
    result = run_cli([*args, "train.eval_interval=10", f"hydra.run.dir={tmp_path}"])
    assert_ok(result)
    assert "| backend=fsdp2 zero=" in result.stdout  # the start-up line names the engine that ran
    losses = [r["loss"] for r in read_metrics(tmp_path) if "loss" in r]
    assert len(losses) >= 2 and losses[-1] < losses[0]  # logged every train.log_interval=10 steps


def test_the_quoted_refusal_is_what_the_cli_prints():
    quoted = re.search(r"\$ megaframe-train (.*)\n(megaframe-train: error: .*)\n", DOC)
    result = run_cli(shlex.split(quoted.group(1)))
    assert result.returncode == 2
    assert result.stderr.strip() == quoted.group(2)

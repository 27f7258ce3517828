"""One name, one number: the loss names a real run shows in its step lines, closing line,
metrics.jsonl, W&B run and a sweep's table are those docs/metrics.md's "Which loss is which" table
lists for each place, every metrics.jsonl key is documented there, and `loss` is the same number
(the step's) in each place. The step lines and the closing line once showed two different "loss"
numbers for one step (the log interval's mean and the last step's)."""
from __future__ import annotations

import math
import re

import pytest

from tests.support.helpers import REPO, TINY, assert_ok, read_metrics, run_cli
from hydra_plugins.megaframe_launcher.local_launcher import _last_values, _table
from megaframe.tracking.wandb_offline import read_offline_run

pytestmark = pytest.mark.slow
LOSS_NAMES = {"loss", "loss_avg", "eval_loss"}
DOC = REPO / "docs" / "metrics.md"


def documented_places() -> dict[str, set[str]]:
    """{name: the places its row of docs/metrics.md's loss-names table lists}."""
    text = DOC.read_text()
    table = text.split("<!-- loss-names", 1)[1].split("\n\n", 1)[0]
    places = {}
    for row in table.splitlines()[3:]:  # the comment, the header and its rule
        name, shown = (cell.strip() for cell in row.strip("|").split("|")[:2])
        places[name.strip("`")] = {place.strip() for place in shown.split(",")}
    return places


def shown_in(places: dict[str, set[str]], where: str) -> set[str]:
    return {name for name, shown in places.items() if where in shown}


def test_the_loss_names_of_every_place_are_those_docs_metrics_md_lists(tmp_path):
    run_dir = tmp_path / "run"
    args = [a for a in TINY if not a.startswith(("logging.wandb", "train.log_interval"))]
    # log_interval=3 over 4 steps: records at step 3 (three steps averaged) and step 4 (one)
    result = run_cli([*args, "train.max_steps=4", "train.log_interval=3", "train.eval_interval=4",
                      "logging.wandb.mode=offline", f"hydra.run.dir={run_dir}"])
    assert_ok(result)
    places = documented_places()
    assert set(places) == LOSS_NAMES, places
    records = read_metrics(run_dir)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [3, 4]

    # metrics.jsonl: every key documented; the loss names those the table gives it
    doc = DOC.read_text()
    keys = {key for r in records for key in r}
    assert not {k for k in keys if f"`{k}`" not in doc}, "metrics.jsonl keys docs/metrics.md does not describe"
    assert keys & LOSS_NAMES == shown_in(places, "metrics.jsonl")
    # the step's loss, and the interval's mean beside it: equal over one step, not over three
    assert train[1]["loss_avg"] == train[1]["loss"] and train[0]["loss_avg"] != train[0]["loss"]

    # step lines: `step N: loss=... loss_avg=...`, the same numbers as the records
    lines = [line for line in result.stdout.splitlines() if re.match(r"step \d+: \w+=", line)]
    for line, record in zip(lines, train, strict=True):
        values = dict(item.split("=", 1) for item in line.split(": ", 1)[1].split())
        assert set(values) & LOSS_NAMES == shown_in(places, "step lines"), line
        assert float(values["loss"]) == pytest.approx(record["loss"], abs=5e-5), line
        assert float(values["loss_avg"]) == pytest.approx(record["loss_avg"], abs=5e-5), line
        assert all(f"{name}=" in doc for name in values), f"step-line names docs/metrics.md does not show: {line}"
    evals = [line for line in result.stdout.splitlines() if re.match(r"step \d+: eval_loss ", line)]
    assert evals and "eval_loss" in shown_in(places, "eval lines")

    # the closing line: `loss X eval_loss Y (uniform ..., ... bits/byte)`, the last record's loss
    closing = result.stdout.strip().splitlines()[-1].split(" | ")[1]
    named = dict(re.findall(r"(\w+) (-?[\d.]+)", closing.split(" (")[0]))
    assert set(named) == shown_in(places, "closing line"), closing
    assert float(named["loss"]) == pytest.approx(train[-1]["loss"], abs=5e-5)
    assert f"(uniform {math.log(257):.4f}, " in closing

    # W&B: the history rows carry the same names and numbers
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history = read_offline_run(run_file)["history"]
    assert {k for row in history for k in row} & LOSS_NAMES == shown_in(places, "W&B")
    assert [row["loss"] for row in history if "loss" in row] == [r["loss"] for r in train]

    # a sweep's table and summary rows: the last record's step loss and eval loss
    row = {"point": 0, "exit_code": 0, "overrides": ["optim.lr=0.001"], **_last_values(run_dir / "metrics.jsonl")}
    header = _table([row]).splitlines()[1].split()
    assert set(header) & LOSS_NAMES == shown_in(places, "sweep table"), header
    assert row["loss"] == train[-1]["loss"]

"""Stop-and-resume reproduces the uninterrupted run exactly, and metrics.jsonl stays one record."""
from __future__ import annotations

import json

import pytest

from tests.support.helpers import TINY, assert_ok, read_metrics, run_cli

pytestmark = pytest.mark.slow
CURVES = ("loss", "grad_norm", "lr", "eval_loss")


def _values(records: list[dict]) -> list[tuple]:
    """Everything but wall-clock measurements, record by record."""
    return [(r["step"], *(r.get(k) for k in CURVES), r["consumed_samples"]) for r in records]


def test_stop_and_resume_reproduces_uninterrupted_curve(tmp_path):
    """The CLI path of a resume (train.resume=auto, metrics.jsonl repair). Multi-rank resumes are
    covered with real ranks in tests/dist (tp2 x pp2, ZeRO-2 dp2 -> ZeRO-3 dp4, every layout change)
    and through torchrun restarts in test_fault_tolerance.py."""
    args = [*TINY, "train.max_steps=8", "train.save_interval=3", "model.dropout=0.1"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert_ok(run_cli([*args, f"hydra.run.dir={whole}"]))

    # first leg stops at step 5 (saving there) with the schedule of an 8-step run
    assert_ok(run_cli([*args, "train.exit_at_step=5", f"hydra.run.dir={parts}"]))
    assert (parts / "checkpoints" / "latest").read_text().strip() == "global_step5"
    first_leg = read_metrics(parts)
    assert max(r["step"] for r in first_leg) == 5
    # a run killed after logging step 6 but before its next save leaves records past the checkpoint
    with open(parts / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 6, "loss": 123.0, "consumed_samples": 0}) + "\n")

    result = run_cli([*args, f"hydra.run.dir={parts}"])  # train.resume=auto is the default
    assert_ok(result)
    assert "resumed from" in result.stdout and "at step 5" in result.stdout
    assert "dropped 1 metrics records" in result.stdout

    uninterrupted, resumed = read_metrics(whole), read_metrics(parts)
    assert _values(resumed) == _values(uninterrupted)  # exact: fp32 on CPU is deterministic
    assert sorted({r["step"] for r in resumed}) == list(range(0, 9))


def test_resume_none_starts_fresh(tmp_path):
    args = [*TINY, "train.max_steps=2", f"hydra.run.dir={tmp_path}"]
    assert_ok(run_cli(args))
    result = run_cli([*args, "train.resume=none", "train.max_steps=3"])
    assert_ok(result)
    assert "resumed from" not in result.stdout


def test_without_latest_the_run_resumes_from_its_newest_checkpoint_and_overwrites_nothing(tmp_path):
    """checkpoints/latest deleted (or checkpoints copied to a new run dir without it): resuming
    from the newest verifying checkpoint, never starting over on top of the complete ones."""
    args = [*TINY, "train.max_steps=6", "train.save_interval=2", f"hydra.run.dir={tmp_path}"]
    assert_ok(run_cli([*args, "train.exit_at_step=4"]))
    checkpoints = tmp_path / "checkpoints"
    manifests = {name: (checkpoints / name / "manifest.json").read_bytes() for name in ("global_step2", "global_step4")}
    (checkpoints / "latest").unlink()

    result = run_cli(args)
    assert_ok(result)
    assert "resumed from" in result.stdout and "at step 4" in result.stdout, result.stdout[-2000:]
    assert "latest is missing" in result.stderr and "global_step4" in result.stderr
    for name, manifest in manifests.items():  # the complete checkpoints were not rewritten by a new run
        assert (checkpoints / name / "manifest.json").read_bytes() == manifest, name
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == list(range(1, 7))


def test_a_resume_into_another_model_shape_is_refused_naming_the_key(tmp_path):
    """A 4-layer checkpoint loaded into model.num_layers=2 would drop two blocks without a word."""
    from megaframe.common.failures import ExitCode

    args = [*TINY, "train.max_steps=4", "train.save_interval=2", f"hydra.run.dir={tmp_path}"]
    assert_ok(run_cli([*args, "model.num_layers=4", "train.exit_at_step=2"]))
    result = run_cli([*args, "model.num_layers=2"])
    assert result.returncode == ExitCode.BAD_CHECKPOINT, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("megaframe-train: error")]
    assert len(errors) == 1 and "model.num_layers=4 (this run: 2)" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    # what does not change a parameter's shape may change on resume
    assert_ok(run_cli([*args, "model.num_layers=4", "model.dropout=0.1"]))


def test_a_changed_global_batch_size_is_refused_unless_the_move_is_accepted(tmp_path):
    """Step k's samples are a function of (seed, k, global batch): another global batch size moved the
    data position without a word (samples skipped when it grew)."""
    from megaframe.common.failures import ExitCode

    args = [*TINY, "train.max_steps=4", "train.save_interval=2", "train.eval_interval=0", f"hydra.run.dir={tmp_path}"]
    assert_ok(run_cli([*args, "train.exit_at_step=2"]))
    result = run_cli([*args, "parallel.global_batch_size=16"])
    assert result.returncode == ExitCode.BAD_CHECKPOINT, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("megaframe-train: error")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "parallel.global_batch_size=8 (16 samples consumed)" in errors[0], errors[0]
    assert "this run's 16 would move the data position to sample 32" in errors[0]
    assert "train.on_batch_size_change=move_position" in errors[0]
    closing = result.stdout.strip().splitlines()[-1]  # the refused resume's step, not 0 (as before the manager)
    assert closing.startswith("megaframe: failed at step 2/4"), result.stdout[-2000:]
    moved = run_cli([*args, "parallel.global_batch_size=16", "train.on_batch_size_change=move_position"])
    assert_ok(moved)
    assert "the data position moves from sample 16 to 32" in moved.stderr, moved.stderr[-2000:]
    assert [r["consumed_samples"] for r in read_metrics(tmp_path) if "loss" in r] == [8, 16, 48, 64]


def test_a_checkpoint_written_with_a_gpus_vocabulary_padding_resumes_on_the_cpus(tmp_path):
    """make_vocab_size_divisible_by=null pads the 257-byte vocabulary to 384 rows on a GPU and not at
    all on a CPU: a checkpoint holds the unpadded rows, so a run saved with the GPU's padding resumes
    on the CPU, and its curve is the padded run's (the padded logits never enter the loss)."""
    from tests.support.helpers import curve

    args = [*TINY, "train.max_steps=8", "train.save_interval=4"]
    padded, resumed = tmp_path / "padded", tmp_path / "resumed"
    result = run_cli([*args, "model.make_vocab_size_divisible_by=128", f"hydra.run.dir={padded}"])
    assert_ok(result)
    assert "vocab=257 padded to 384" in result.stdout
    result = run_cli([*args, f"train.resume={padded / 'checkpoints' / 'global_step4'}", f"hydra.run.dir={resumed}"])
    assert_ok(result)
    summary = next(line for line in result.stdout.splitlines() if line.startswith("megaframe: gpt2"))
    assert "vocab=257)" in summary, summary  # no padding on the CPU
    want = [(s, v) for s, v in curve(read_metrics(padded), "loss") if s > 4]
    got = curve(read_metrics(resumed), "loss")
    assert [s for s, _ in got] == [s for s, _ in want] and got
    for (step, a), (_, b) in zip(got, want):
        assert a == pytest.approx(b, rel=1e-5), f"loss at step {step}: unpadded {a} vs padded {b}"


def test_a_changed_data_order_is_refused_unless_accepted_and_the_resume_says_what_changed(tmp_path):
    """A new train.seed or model.seq_length changes which samples every later step trains on (as a
    new global batch does): refused in one line (exit 5) unless train.resume_accept_data_change=true,
    which says what changes. The resume names, old -> new, what it changes of the run's schedule.
    Unmounted checkpoints under a run with records: refused before launch (exit 2), records kept."""
    import shutil

    from megaframe.common.failures import ExitCode

    args = [*TINY, "model.position_embedding=rope", "train.max_steps=4", "train.save_interval=2",
            "train.eval_interval=0", f"hydra.run.dir={tmp_path}"]
    assert_ok(run_cli([*args, "train.exit_at_step=2"]))
    records = (tmp_path / "metrics.jsonl").read_bytes()
    result = run_cli([*args, "train.seed=7", "model.seq_length=16"])
    assert result.returncode == ExitCode.BAD_CHECKPOINT, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("megaframe-train: error")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "model.seq_length 32 -> 16; train.seed 1234 -> 7" in errors[0], errors[0]
    assert "train.resume_accept_data_change=true" in errors[0]
    assert (tmp_path / "metrics.jsonl").read_bytes() == records

    accepted = run_cli([*args, "train.seed=7", "train.resume_accept_data_change=true", "train.max_steps=5"])
    assert_ok(accepted)
    assert "from step 3 the samples of each step follow the new data order (train.seed 1234 -> 7)" in accepted.stderr
    assert "changed since global_step2: train.max_steps 4 -> 5;" in accepted.stdout, accepted.stdout[-2000:]
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4, 5]

    records = (tmp_path / "metrics.jsonl").read_bytes()
    shutil.move(tmp_path / "checkpoints", tmp_path / "elsewhere")
    (tmp_path / "checkpoints").symlink_to(tmp_path / "not-mounted")
    refused = run_cli([*args, "train.seed=7", "train.max_steps=6"])
    assert refused.returncode == 2, refused.stderr[-2000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("megaframe-train: error")]
    assert len(errors) == 1 and "checkpoints is a link to" in errors[0] and "train.resume=none" in errors[0], errors
    assert (tmp_path / "metrics.jsonl").read_bytes() == records and not (tmp_path / "not-mounted").exists()

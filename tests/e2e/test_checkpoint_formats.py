"""train.universal_checkpoint=false: DeepSpeed's files alone resume in the same layout, on the user's
word (train.trust_pickled_checkpoint=true: they load by unpickling), and a resume in another layout
is refused with one line that says why."""
from __future__ import annotations

import pytest

from tests.support.helpers import TINY, assert_ok, read_metrics, run_cli
from megaframe.common.failures import ExitCode

pytestmark = pytest.mark.slow


def test_engine_only_checkpoint_resumes_in_its_layout_and_refuses_another(tmp_path):
    args = [*TINY, "train.max_steps=4", "train.universal_checkpoint=false", f"hydra.run.dir={tmp_path}"]
    first = run_cli([*args, "train.exit_at_step=2"])
    assert_ok(first)
    # DeepSpeed's warning (its rules, through the plug) before launch
    assert ("megaframe-train: warning: train.universal_checkpoint=false: checkpoints hold DeepSpeed's pickled files "
            "only") in first.stderr, first.stderr[-3000:]
    saved = tmp_path / "checkpoints" / "global_step2"
    assert not (saved / "index.json").exists() and (saved / "manifest.json").is_file()

    other_layout = run_cli([*args, "zero=stage1"])
    assert other_layout.returncode == ExitCode.BAD_CHECKPOINT, other_layout.stderr[-3000:]
    errors = [line for line in other_layout.stderr.splitlines() if line.startswith("megaframe-train: error:")]
    assert len(errors) == 1 and "holds no layout-free tensors" in errors[0] \
        and "'zero_stage': 0" in errors[0] and "train.universal_checkpoint=true" in errors[0], other_layout.stderr[-3000:]

    untrusted = run_cli(args)  # DeepSpeed's loader unpickles: only on the user's word
    assert untrusted.returncode == ExitCode.BAD_CHECKPOINT, untrusted.stderr[-3000:]
    errors = [line for line in untrusted.stderr.splitlines() if line.startswith("megaframe-train: error:")]
    assert len(errors) == 1 and "train.trust_pickled_checkpoint=true" in errors[0], untrusted.stderr[-3000:]
    assert "Traceback" not in untrusted.stderr

    same_layout = run_cli([*args, "train.trust_pickled_checkpoint=true"])
    assert_ok(same_layout)
    assert "resumed from" in same_layout.stdout and "at step 2" in same_layout.stdout
    assert max(r["step"] for r in read_metrics(tmp_path)) == 4


def test_one_copy_by_default_and_deepspeeds_files_when_asked(tmp_path):
    """By default a checkpoint holds the layout-free files only (and resumes exactly from them:
    tests/e2e/test_resume.py); train.native_checkpoint=true adds DeepSpeed's own files."""
    def saved(run_dir):
        return {p.name for p in (run_dir / "checkpoints" / "global_step2").iterdir()}

    for native in (False, True):
        run_dir = tmp_path / f"native-{native}"
        assert_ok(run_cli([*TINY, "train.max_steps=2", "zero=stage1", f"train.native_checkpoint={str(native).lower()}",
                           f"hydra.run.dir={run_dir}"]))
        files = saved(run_dir)
        assert {"index.json", "shards", "state.json", "manifest.json", "rng_rank0.pt"} <= files
        deepspeed_files = {name for name in files if name.endswith("_states.pt")}
        assert bool(deepspeed_files) == native, files


class _Payload:
    """What a crafted checkpoint file holds: unpickling it runs code (here: it writes a file)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_engine_checkpoint_runs_nothing_without_the_users_word(tmp_path):
    """A checkpoint of DeepSpeed's files whose model states carry a payload, with a manifest that
    matches them (a crafted checkpoint comes with one): resuming it with default settings refuses
    before anything is unpickled."""
    import json

    import torch

    from megaframe.checkpoint import universal

    args = [*TINY, "train.max_steps=4", "train.universal_checkpoint=false", f"hydra.run.dir={tmp_path / 'run'}"]
    assert_ok(run_cli([*args, "train.exit_at_step=2"]))
    saved = tmp_path / "run" / "checkpoints" / "global_step2"
    states = next(saved.glob("*model_states.pt"))
    marker = tmp_path / "payload-ran"
    torch.save({"module": _Payload(str(marker))}, states)
    manifest = json.loads((saved / "manifest.json").read_text())
    manifest["files"][states.relative_to(saved).as_posix()] = universal.file_entry(states)
    (saved / "manifest.json").write_text(json.dumps(manifest))

    result = run_cli(args)
    assert result.returncode == ExitCode.BAD_CHECKPOINT, result.stderr[-3000:]
    assert "train.trust_pickled_checkpoint=true" in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists(), "the crafted checkpoint's code ran"


def test_an_engine_only_resume_follows_the_new_schedule_as_its_change_line_says(tmp_path):
    """A resume from DeepSpeed's own files with a longer train.max_steps (and another optim.lr): its
    loader put the saved schedule back whole (LambdaLR.load_state_dict), so the run went on along the
    old cosine while the resume's line said the new values were followed. The lr of each resumed
    step is docs/configuration.md's formula at the new values (tests/unit/training/test_schedule.py)."""
    import pytest

    from megaframe.config.compose import compose
    from tests.unit.training.test_schedule import documented_lr

    args = [*TINY, "train.universal_checkpoint=false", f"hydra.run.dir={tmp_path}"]
    assert_ok(run_cli([*args, "train.max_steps=4", "train.exit_at_step=2"]))
    resumed = run_cli([*args, "train.max_steps=8", "optim.lr=2e-3", "train.trust_pickled_checkpoint=true"])
    assert_ok(resumed)
    o = compose(TINY)[0].optim  # its warmup and min_lr
    lrs = [r["lr"] for r in read_metrics(tmp_path) if "loss" in r and r["step"] > 2]
    assert lrs == pytest.approx([documented_lr(2e-3, o.min_lr, o.warmup_steps, 8, o.lr_decay, applied)
                                 for applied in range(2, 8)]), resumed.stdout[-2000:]

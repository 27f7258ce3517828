"""train.universal_checkpoint=false: DeepSpeed's files alone resume in the same layout, and a
resume in another layout is refused with one line that says why."""
from __future__ import annotations

import pytest

from helpers import TINY, assert_ok, read_metrics, run_cli
from megaframe.failures import ExitCode

pytestmark = pytest.mark.slow


def test_engine_only_checkpoint_resumes_in_its_layout_and_refuses_another(tmp_path):
    args = [*TINY, "train.max_steps=4", "train.universal_checkpoint=false", f"hydra.run.dir={tmp_path}"]
    assert_ok(run_cli([*args, "train.exit_at_step=2"]))
    saved = tmp_path / "checkpoints" / "global_step2"
    assert not (saved / "index.json").exists() and (saved / "manifest.json").is_file()

    other_layout = run_cli([*args, "zero=stage1"])
    assert other_layout.returncode == ExitCode.BAD_CHECKPOINT, other_layout.stderr[-3000:]
    errors = [line for line in other_layout.stderr.splitlines() if line.startswith("megaframe-train: error:")]
    assert len(errors) == 1 and "holds no layout-free tensors" in errors[0] \
        and "'zero_stage': 0" in errors[0] and "train.universal_checkpoint=true" in errors[0], other_layout.stderr[-3000:]

    same_layout = run_cli(args)
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

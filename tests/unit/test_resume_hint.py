"""The closing line's resume command and train.resume=latest-run (megaframe/resume_hint.py);
tests/e2e/test_resume_hint.py runs a printed command."""
from __future__ import annotations

import os
import shlex

import pytest

from megaframe import resume_hint
from megaframe.config.validate import UNRESOLVED, ConfigError

PATTERN = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"


def test_the_resume_command_repeats_the_users_arguments_and_names_the_run_dir(monkeypatch, tmp_path):
    monkeypatch.delenv(resume_hint.ARGS_ENV, raising=False)
    run_dir = tmp_path / "outputs" / "2026-11-28" / "12-00-00"
    # a rank of another launcher: that launcher's command line is not known
    assert resume_hint.resume_command(run_dir) == f"run this job's launch command again with hydra.run.dir={run_dir}"
    resume_hint.remember_command(["model=llama_tiny", "optim.betas=[0.9,0.99]", "train.resume=none",
                                  "train.exit_at_step=10", "hydra.run.dir=old", "--config-dir", "my conf"])
    command = resume_hint.resume_command(run_dir)
    # what a resume must not repeat is gone: a fresh start, an exit step already reached, the old run dir
    assert shlex.split(command) == ["megaframe-train", "model=llama_tiny", "optim.betas=[0.9,0.99]", "--config-dir",
                                    "my conf", f"hydra.run.dir={run_dir}"]
    odd = tmp_path / "a b,c=d"  # Hydra's grammar and the shell's both keep it one value
    assert shlex.split(resume_hint.resume_command(odd))[-1] == f"hydra.run.dir='{odd}'"
    os.environ[resume_hint.ARGS_ENV] = "not json"
    assert resume_hint.resume_command(run_dir).startswith("run this job's launch command again")


def _run(root, name: str, mtime: int, checkpoint: bool = True):
    run_dir = root / "outputs" / name
    (run_dir / "checkpoints").mkdir(parents=True)
    if checkpoint:
        (run_dir / "checkpoints" / "latest").write_text("global_step4")
        os.utime(run_dir / "checkpoints" / "latest", (mtime, mtime))
    return run_dir


def test_latest_run_is_the_newest_checkpointed_run_under_the_default_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["train.max_steps=20", "train.resume=latest-run"]
    with pytest.raises(ValueError, match=r"no run under outputs/ has a checkpoint \(looked for "
                                         r"outputs/\*/\*/checkpoints/latest\)"):
        resume_hint.resolve_latest_run(args, lambda _: PATTERN)
    older = _run(tmp_path, "2026-11-27/09-00-00", 1_000)
    newer = _run(tmp_path, "2026-11-28/10-00-00", 2_000)
    _run(tmp_path, "2026-11-28/11-00-00", 3_000, checkpoint=False)  # crashed before its first checkpoint
    (tmp_path / "outputs" / "2026-11-28" / "12-00-00").symlink_to(older)  # a link megaframe did not make
    os.utime(older / "checkpoints" / "latest", (4_000, 4_000))
    got, run_dir = resume_hint.resolve_latest_run(args, lambda _: PATTERN)
    assert run_dir == str(older.resolve())  # written last; the link to it is not a run of its own
    assert got == ["train.max_steps=20", "train.resume=auto", f"hydra.run.dir={older.resolve()}"]
    os.utime(newer / "checkpoints" / "latest", (5_000, 5_000))
    assert resume_hint.resolve_latest_run(args, lambda _: PATTERN)[1] == str(newer.resolve())
    # with hydra.run.dir given, that run is the one; without a checkpoint it is refused, where it said
    # "resuming mine" and started a fresh run (found by review)
    with pytest.raises(ValueError, match=r"^train.resume=latest-run: hydra.run.dir mine has no checkpoint to "
                                         r"resume \(no checkpoints/latest\); leave train.resume out"):
        resume_hint.resolve_latest_run([*args, "hydra.run.dir=mine"], lambda _: PATTERN)
    (tmp_path / "mine" / "checkpoints").mkdir(parents=True)
    (tmp_path / "mine" / "checkpoints" / "latest").write_text("global_step2\n")
    assert resume_hint.resolve_latest_run([*args, "hydra.run.dir=mine"], lambda _: PATTERN) == \
        (["train.max_steps=20", "hydra.run.dir=mine", "train.resume=auto"], "mine")
    (tmp_path / "my run" / "checkpoints").mkdir(parents=True)  # quoted as resume commands print it (review)
    (tmp_path / "my run" / "checkpoints" / "latest").write_text("global_step2\n")
    assert resume_hint.resolve_latest_run([*args, "hydra.run.dir='my run'"], lambda _: PATTERN)[1] == "'my run'"


def test_latest_run_reads_the_default_root_from_the_composed_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert resume_hint.latest_run(["train.max_steps=2"]) == ["train.max_steps=2"]  # nothing asked: unchanged
    with pytest.raises(ConfigError, match="train.resume=latest-run: no run under outputs/ has a checkpoint"):
        resume_hint.latest_run(["train.resume=latest-run"])
    run_dir = _run(tmp_path, "2026-11-28/10-00-00", 1_000)
    assert resume_hint.latest_run(["train.resume=latest-run"]) == ["train.resume=auto",
                                                                  f"hydra.run.dir={run_dir.resolve()}"]
    assert capsys.readouterr().out == f"megaframe-train: train.resume=latest-run: resuming {run_dir.resolve()}\n"


def test_latest_run_where_megaframe_train_does_not_choose_it_is_refused_not_read_as_a_directory(
        tmp_path, monkeypatch, capsys):
    """A -m sweep point and a rank of torchrun or srun (`python -m megaframe.train`) handed the
    trainer Path("latest-run"); under a launcher each rank would also pick a run on its own, and
    each printed "resuming". One line naming the fix instead, and no rank prints a choice."""
    from megaframe.launch.sweep import check_sweep_point as _check_sweep_point

    monkeypatch.chdir(tmp_path)
    _run(tmp_path, "2026-11-28/10-00-00", 1_000)  # a run latest-run would find
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as refused:
        resume_hint.latest_run(["train.resume=latest-run"])
    assert str(refused.value) == UNRESOLVED and "hydra.run.dir=DIR" in str(refused.value)
    assert capsys.readouterr().out == ""
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ConfigError) as refused:  # the config a sweep point (or any unresolved path) validates
        _check_sweep_point(["train.resume=latest-run", "train.max_steps=2"])
    assert str(refused.value) == UNRESOLVED

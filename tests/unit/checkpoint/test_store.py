"""Checkpoint publication is atomic: a save that dies half-way leaves the previous one in charge."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from megaframe.checkpoint import store as checkpoint


class FakeEngine:
    """A backend whose native save writes a file per save like DeepSpeed does; can be told to die
    in the middle of a save."""

    def __init__(self, crash: bool = False):
        self.crash = crash

    def save_native(self, save_dir, tag, client_state):
        path = Path(save_dir) / tag
        path.mkdir(parents=True)
        (path / "mp_rank_00_model_states.pt").write_text(str(client_state["step"]))
        if self.crash:
            raise RuntimeError("killed mid-save")


def test_save_publishes_tag_and_latest(tmp_path):
    checkpoint.save(FakeEngine(), tmp_path, 4, {"step": 4})
    assert checkpoint.find_latest(tmp_path) == tmp_path / "global_step4"
    assert (tmp_path / "global_step4" / "rng_rank0.pt").is_file()
    assert not list(tmp_path.glob("tmp-*"))


def test_a_failed_save_says_what_a_restart_continues_from(tmp_path):
    """It promised "the previous checkpoint is untouched: train.resume=auto continues from it" when
    there was none, when the run had started from train.resume=PATH, and of the checkpoint that
    failed itself (an error after its publish, while pruning) (reviews)."""
    assert checkpoint.restart_point(tmp_path, "global_step2", "auto") == \
        "no earlier checkpoint was written: a run started again begins at step 0"
    assert checkpoint.restart_point(tmp_path, "global_step2", "/runs/a/checkpoints/global_step9") == (
        "the checkpoint this run started from, /runs/a/checkpoints/global_step9, is untouched: the same command "
        "starts from it again")
    checkpoint.save(FakeEngine(), tmp_path, 2, {"step": 2})
    assert checkpoint.restart_point(tmp_path, "global_step4", "/runs/a/checkpoints/global_step9") == \
        "the previous checkpoint, global_step2, is untouched: train.resume=auto continues from it"
    (tmp_path / "latest").unlink()  # what find_latest falls back to: the newest published checkpoint
    assert checkpoint.restart_point(tmp_path, "global_step4", "auto").startswith(
        "the previous checkpoint, global_step2")
    assert checkpoint.restart_point(tmp_path, "global_step2", "auto") == \
        "global_step2 itself was published before the error: train.resume=auto continues from it"


def test_crash_during_save_keeps_previous_checkpoint(tmp_path):
    checkpoint.save(FakeEngine(), tmp_path, 4, {"step": 4})
    with pytest.raises(RuntimeError, match="killed mid-save"):
        checkpoint.save(FakeEngine(crash=True), tmp_path, 8, {"step": 8})
    assert checkpoint.find_latest(tmp_path) == tmp_path / "global_step4"
    assert not (tmp_path / "global_step8").exists()
    # the next save clears the debris and publishes normally
    checkpoint.save(FakeEngine(), tmp_path, 8, {"step": 8})
    assert checkpoint.find_latest(tmp_path) == tmp_path / "global_step8"
    assert not list(tmp_path.glob("tmp-*"))


def test_resave_of_same_step_replaces_it(tmp_path):
    checkpoint.save(FakeEngine(), tmp_path, 4, {"step": 4})
    checkpoint.save(FakeEngine(), tmp_path, 4, {"step": 4})
    assert checkpoint.find_latest(tmp_path) == tmp_path / "global_step4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step4", "latest"]


def test_resolve_resume(tmp_path):
    assert checkpoint.resolve_resume("auto", tmp_path) is None
    assert checkpoint.resolve_resume("none", tmp_path) is None
    checkpoint.save(FakeEngine(), tmp_path, 2, {"step": 2})
    assert checkpoint.resolve_resume("auto", tmp_path) == tmp_path / "global_step2"
    assert checkpoint.resolve_resume(str(tmp_path), tmp_path / "elsewhere") == tmp_path / "global_step2"
    assert checkpoint.resolve_resume(str(tmp_path / "global_step2"), tmp_path) == tmp_path / "global_step2"


def test_save_writes_a_manifest_that_load_verifies(tmp_path):
    def write_extra(directory):
        (directory / "extra.bin").write_bytes(b"x" * 10)  # a file no rank record lists: rank 0 hashes it

    path = checkpoint.save(FakeEngine(), tmp_path, 4, {"step": 4}, write_extra=write_extra)
    checkpoint.verify(path)  # complete: passes
    (path / "extra.bin").write_bytes(b"y" + b"x" * 9)
    with pytest.raises(checkpoint.CheckpointError, match="global_step4 is corrupted: extra.bin"):
        checkpoint.verify(path)


def test_keep_prunes_older_checkpoints_after_latest_moves(tmp_path):
    for step in (2, 4, 6, 8):
        checkpoint.save(FakeEngine(), tmp_path, step, {"step": step}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step6", "global_step8", "latest"]
    assert checkpoint.find_latest(tmp_path) == tmp_path / "global_step8"


def test_pruning_deletes_what_an_earlier_prune_could_not_and_renames_past_it(tmp_path, tmp_path_factory, monkeypatch):
    """A prune whose delete did not finish (a crash between rename and delete; a file held open on NFS,
    here a delete that fails) left tmp-del-global_stepN with a checkpoint's bytes: a later prune deletes
    it, and a step saved again whose trash name is still taken is renamed past it instead of failing
    the save ('Directory not empty')."""
    checkpoint.save(FakeEngine(), tmp_path, 2, {"step": 2})
    checkpoint.save(FakeEngine(), tmp_path, 4, {"step": 4})
    (tmp_path / "global_step2").rename(tmp_path / "tmp-del-global_step2")  # the crashed prune's rename
    (tmp_path / "tmp-del-global_step6").mkdir()  # an earlier global_step6's delete that cannot finish yet
    (tmp_path / "tmp-del-global_step6" / "big.pt").write_bytes(b"x" * 1024)
    # the delete is an rm child (store.empty_trash): one that cannot delete tmp-del-global_step6
    held = tmp_path_factory.mktemp("bin") / "rm"
    held.write_text('#!/bin/sh\nfor p in "$@"; do case "$p" in -*|*/tmp-del-global_step6) ;; '
                    '*) /bin/rm -rf -- "$p";; esac; done\nexit 1\n')
    held.chmod(0o755)
    monkeypatch.setenv("PATH", f"{held.parent}{os.pathsep}{os.environ['PATH']}")
    for step in (6, 8, 10):  # 6 is pruned at 10's save, its trash name still taken
        checkpoint.save(FakeEngine(), tmp_path, step, {"step": step}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step10", "global_step8", "latest",
                                                          "tmp-del-global_step6"]
    assert (tmp_path / "tmp-del-global_step6" / "big.pt").is_file()  # the old one, not the pruned 6
    monkeypatch.undo()  # the file is closed now: the next prune deletes it
    checkpoint.save(FakeEngine(), tmp_path, 12, {"step": 12}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step10", "global_step12", "latest"]


def test_a_rollback_sets_the_abandoned_steps_aside_and_pruning_keeps_the_resumed_lineage(tmp_path):
    """A loss spike: the run resumes from global_step4 while 6 and 8 (diverged) remain. Set aside, they
    are kept under other names and out of the lineage: the saves at 5 and 7 with keep=2 keep 5 and 7.
    Counted by step, pruning kept 6 and 8 and deleted 4, then 5: only the newest good one survived."""
    for step in (4, 6, 8):
        checkpoint.save(FakeEngine(), tmp_path, step, {"step": step}, keep=3)
    moved = checkpoint.set_aside_newer(tmp_path, 4, tmp_path / "global_step4")
    assert [p.name.split("-")[-1] for p in moved] == ["global_step6", "global_step8"]
    assert all(p.name.startswith(checkpoint.ROLLED_BACK_PREFIX) and p.is_dir() for p in moved)
    assert checkpoint.find_latest(tmp_path) == tmp_path / "global_step4"  # `latest` named 8
    for step in (5, 7):
        checkpoint.save(FakeEngine(), tmp_path, step, {"step": step}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("rolled")) == [
        "global_step5", "global_step7", "latest"]
    assert all(p.is_dir() for p in moved) and checkpoint.find_latest(tmp_path) == tmp_path / "global_step7"
    assert checkpoint.set_aside_newer(tmp_path, 7, tmp_path / "global_step7") == []  # the usual resume


def test_latest_pointing_at_a_vanished_dir_falls_back_to_newest_complete(tmp_path):
    for step in (2, 4):
        checkpoint.save(FakeEngine(), tmp_path, step, {"step": step})
    (tmp_path / "tmp-global_step6").mkdir()  # debris is never a candidate
    (tmp_path / "latest").write_text("global_step6\n")
    assert checkpoint.find_latest(tmp_path) == tmp_path / "global_step4"


def test_the_accelerators_generator_is_saved_and_restored(tmp_path, monkeypatch):
    """On CUDA, dropout outside TP regions draws from the device's default generator: a resume that
    restored only the CPU's would leave the uninterrupted curve. A stand-in CUDA generator here
    (the CUDA-shaped device tier runs the whole dropout resume)."""
    import torch

    device_generator = {"state": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": device_generator["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": device_generator.update(state=state))
    checkpoint.save(FakeEngine(), tmp_path, 4, {"step": 4})
    cpu_at_save = torch.get_rng_state()
    torch.rand(3)  # both generators move on after the save
    device_generator["state"] = torch.tensor([9, 9, 9], dtype=torch.uint8)
    checkpoint._load_rng(tmp_path / "global_step4")
    assert torch.equal(device_generator["state"], torch.tensor([1, 2, 3], dtype=torch.uint8))
    assert torch.equal(torch.get_rng_state(), cpu_at_save)


def test_a_read_error_while_verifying_fails_the_attempt_in_one_line_without_going_back(tmp_path, monkeypatch):
    """EIO or ESTALE from shared storage during the resume's verification escaped on that rank as a
    traceback while the others waited in the gather until the collective timeout. Every rank now
    raises the same one-line OSError (exit 1: a restart reads again); taking it for "does not
    verify" would resume an older checkpoint and set the newest aside over a passing error."""
    from megaframe.checkpoint import universal
    from megaframe.common.failures import classify

    path = checkpoint.save(FakeEngine(), tmp_path, 4, {"step": 4})

    def broken(file):
        raise OSError(5, "Input/output error", str(file))

    monkeypatch.setattr(universal, "hash_file", broken)
    with pytest.raises(OSError) as err:
        checkpoint.newest_verified(tmp_path)
    failure = classify(err.value)
    assert failure.exit_code == 1 and "Input/output error" in str(failure) and "\n" not in str(failure)
    assert (tmp_path / "global_step4").is_dir()

"""What a resume refuses or names (checkpoint/resume_checks.py): starting over on top of an earlier
run's history, a changed data order, and the one line of layout, engine and schedule changes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from megaframe.checkpoint.universal import CheckpointError
from megaframe.config.schema import DataConfig
from megaframe.data import IndexedDatasetWriter
from megaframe.tracking.metrics import MetricsLog, read_metrics
from megaframe.checkpoint import resume_checks, store as checkpoint
from megaframe.training.data_setup import build_data
from megaframe.checkpoint.resume_checks import (UNSAVED_MARKER, change_line, data_change_problem, data_changes,
                                              data_record, gone_latest_warning, prelaunch_problem, start_over)


# ---- starting over ---------------------------------------------------------------------------
def _trained(run_dir: Path, steps: int = 3, eval_at_0: bool = True) -> Path:
    """A run dir whose metrics.jsonl holds `steps` trained steps (and the step-0 evaluation)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    records = ([{"step": 0, "eval_loss": 5.5}] if eval_at_0 else []) + [{"step": s, "loss": 5.0} for s in
                                                                         range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def _publish(checkpoints: Path, step: int) -> Path:
    """A checkpoint published as a save publishes it (no model: what it holds does not matter here)."""
    return checkpoint.save(None, checkpoints, step, {"step": step}, native=False)


def test_checkpoints_that_no_save_can_use_are_refused_in_every_resume_mode(tmp_path):
    run = _trained(tmp_path / "run")
    (run / "checkpoints").write_text("not a directory")
    for mode in ("auto", "none", "/elsewhere"):
        problem = prelaunch_problem(run, mode)
        assert problem and "checkpoints is a file, not a directory" in problem and f"train.resume={mode}" in problem
    (run / "checkpoints").unlink()
    (run / "checkpoints").symlink_to(tmp_path / "unmounted" / "ckpt")
    for mode in ("auto", "none"):
        problem = prelaunch_problem(run, mode)
        assert problem and "is a link to" in problem and "unmounted/ckpt, which does not exist" in problem
    # even a run dir with no history: the first save would fail on them
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "checkpoints").symlink_to(tmp_path / "gone")
    assert "which does not exist" in prelaunch_problem(fresh, "auto")


@pytest.mark.parametrize("storage", ["missing", "empty dir", "link to empty dir", "only tmp saves"])
def test_trained_steps_without_a_readable_checkpoint_are_refused(tmp_path, storage):
    run = _trained(tmp_path / "run", steps=7)
    checkpoints = run / "checkpoints"
    if storage == "empty dir":
        checkpoints.mkdir()
    elif storage == "link to empty dir":
        (tmp_path / "mount").mkdir()
        checkpoints.symlink_to(tmp_path / "mount")
    elif storage == "only tmp saves":
        (checkpoints / "tmp-global_step5").mkdir(parents=True)
    problem = prelaunch_problem(run, "auto")
    assert problem is not None and "\n" not in problem
    assert f"{run / 'metrics.jsonl'} holds records up to step 7" in problem and str(checkpoints) in problem
    assert "train.resume=none" in problem
    want = {"missing": "does not exist", "empty dir": "is empty", "link to empty dir": "is empty",
            "only tmp saves": "only unfinished saves (tmp-global_step5)"}[storage]
    assert want in problem
    assert prelaunch_problem(run, "none") is None  # starting over, said explicitly
    # the trainer's own check (after launch): exit 5, and the records are left alone
    before = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(CheckpointError, match="holds records up to step 7"):
        start_over(run, checkpoints, "auto", MetricsLog(run / "metrics.jsonl"), True)
    assert (run / "metrics.jsonl").read_bytes() == before


def test_a_crash_before_the_first_checkpoint_starts_over_and_drops_its_records(tmp_path, capsys):
    """The marker a fresh start writes says no checkpoint was ever published: the records of that
    attempt are dropped (they would repeat); the first publication removes the marker, after which
    records without a checkpoint mean lost storage."""
    run = tmp_path / "run"
    run.mkdir()
    start_over(run, run / "checkpoints", "auto", MetricsLog(run / "metrics.jsonl"), True)
    assert (run / UNSAVED_MARKER).is_file()
    _trained(run, steps=4)
    (run / "checkpoints" / "tmp-global_step4").mkdir(parents=True)  # killed during its first save
    assert prelaunch_problem(run, "auto") is None
    start_over(run, run / "checkpoints", "auto", MetricsLog(run / "metrics.jsonl"), True)
    assert "dropped 5 metrics records of an earlier attempt that saved none" in capsys.readouterr().out
    assert (run / "metrics.jsonl").read_text() == ""
    _publish(run / "checkpoints", 2)
    assert not (run / UNSAVED_MARKER).exists()
    _trained(run, steps=3)
    (run / "checkpoints").rename(run / "away")
    assert "holds records up to step 3" in prelaunch_problem(run, "auto")


def test_what_is_not_evidence_of_earlier_steps(tmp_path):
    """An evaluation at step 0 trained nothing; a planted marker link is not megaframe's marker;
    a planted metrics.jsonl link is not read through but counts as records."""
    run = _trained(tmp_path / "run", steps=0)
    assert prelaunch_problem(run, "auto") is None
    run = _trained(tmp_path / "planted", steps=2)
    (tmp_path / "elsewhere").write_text("x")
    (run / UNSAVED_MARKER).symlink_to(tmp_path / "elsewhere")
    assert "holds records up to step 2" in prelaunch_problem(run, "auto")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "metrics.jsonl").symlink_to(tmp_path / "elsewhere")
    problem = prelaunch_problem(linked, "auto")
    assert problem and "holds records of earlier steps" in problem


def test_a_fifo_planted_as_metrics_is_not_waited_on(tmp_path):
    """A FIFO in metrics.jsonl's place blocked the pre-launch check's open until someone wrote to it:
    it counts as evidence of earlier steps (-1), at once."""
    import os
    import threading

    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "metrics.jsonl")
    result = []
    reader = threading.Thread(target=lambda: result.append(resume_checks.last_logged_step(run / "metrics.jsonl")),
                              daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # release the blocked open, so the failure does not leave a thread hanging
        os.close(os.open(run / "metrics.jsonl", os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=10)
    assert result == [-1]
    problem = prelaunch_problem(run, "auto")
    assert problem and "holds records of earlier steps" in problem


def test_metrics_are_read_from_their_tail(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps({"step": s, "loss": 1.0, "pad": "x" * 200}) for s in range(1, 2001)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 2001, "lo')  # torn by a crash
    assert resume_checks.last_logged_step(run / "metrics.jsonl") == 2000


def test_a_latest_naming_a_deleted_checkpoint(tmp_path):
    """The resume falls back to the newest that remains, saying so; with none left, it is refused."""
    run = _trained(tmp_path / "run", steps=6)
    checkpoints = run / "checkpoints"
    _publish(checkpoints, 2)
    _publish(checkpoints, 4)
    shutil.rmtree(checkpoints / "global_step4")
    path, _ = checkpoint.newest_verified(checkpoints)
    assert path == checkpoints / "global_step2"
    warning = gone_latest_warning(checkpoints, path)
    assert warning and "names global_step4, which is gone" in warning and "global_step2" in warning
    assert gone_latest_warning(checkpoints, checkpoints / "global_step4") is None
    assert prelaunch_problem(run, "auto") is None
    shutil.rmtree(checkpoints / "global_step2")
    assert "holds no complete checkpoint" in prelaunch_problem(run, "auto")


# ---- the data order --------------------------------------------------------------------------
def _source(prefix: Path, documents: int) -> str:
    with IndexedDatasetWriter(prefix) as writer:
        for i in range(documents):
            writer.add_document(np.arange(i, i + 40) % 256)
        writer.finalize({"tokenizer": "byte", "vocab_size": 257, "eod_id": 256})
    return str(prefix)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sources")
    return {name: _source(root / name, n) for name, n in (("web", 30), ("code", 20), ("books", 12))}


def _record(sources, seq=16, seed=1234, **data) -> dict:
    cfg = DataConfig(**data) if data else DataConfig(path=sources["web"])
    return data_record(seq, seed, build_data(cfg, seq))


def _saved(record: dict, step: int = 10) -> dict:
    """A checkpoint's client state holding `record`, through JSON as state.json keeps it."""
    return json.loads(json.dumps({"step": step, "data": record}))


def test_changes_that_move_the_data_order_are_named(sources):
    blend = dict(blend=[0.3, sources["web"], 0.7, sources["code"]])
    base = _record(sources, **blend)
    assert data_changes(_saved(base), _record(sources, **blend)) == []
    cases = {
        "model.seq_length 16 -> 8": _record(sources, seq=8, **blend),
        "train.seed 1234 -> 99": _record(sources, seed=99, **blend),
        "data.blend weights [0.3, 0.7] -> [0.5, 0.5]": _record(sources, blend=[1, sources["web"], 1, sources["code"]]),
        "data.blend sources [web, code] -> [web, code, books]":
            _record(sources, blend=[0.3, sources["web"], 0.7, sources["code"], 0.1, sources["books"]]),
        "data.blend sources [web, code] -> [code, web]":
            _record(sources, blend=[0.3, sources["code"], 0.7, sources["web"]]),
        "data.blend weights [0.3, 0.7] -> [0.3, 0.7] then [0.5, 0.5] from step 20":
            _record(sources, blend_schedule=[[20, [0.5, 0.5]]], **blend),
    }
    for expected, now in cases.items():
        changes = data_changes(_saved(base), now)
        assert any(expected in change for change in changes), (expected, changes)
    # equal weights written another way are the same blend (Megatron normalises them)
    assert data_changes(_saved(base), _record(sources, blend=[3, sources["web"], 7, sources["code"]])) == []


def test_a_bin_copied_over_another_of_the_same_size_is_named(sources, tmp_path):
    """`cp B.bin A.bin` with identical indexes: the build checksum comes from A's sidecar, unchanged, and
    the resume trained on B's text, exit 0 (hostile-data review). The tokens sampled at 16 places differ."""
    import shutil

    copy = tmp_path / "web"
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(sources["web"] + suffix, f"{copy}{suffix}")
    base = _record(sources, path=str(copy))
    tokens = np.memmap(f"{copy}.bin", dtype="<u2", mode="r+")
    tokens[:] = (tokens.astype(np.int64) + 13) % 256  # rot13-like: the same sizes, other tokens
    tokens.flush()
    del tokens
    now = _record(sources, path=str(copy))
    assert now["checksums"] == base["checksums"] and now["sources"] == base["sources"]
    assert data_changes(_saved(base), now) == ["data.path web: its tokens differ from those trained on, under the "
                                               "same build checksum (a .bin copied over or rewritten in place)"]


def test_a_single_dataset_changing_its_training_samples(sources):
    base = _record(sources)
    changes = data_changes(_saved(base), _record(sources, path=sources["web"], valid_fraction=0.3))
    assert len(changes) == 1 and changes[0].startswith("data.path web: ") and "training samples" in changes[0]
    assert data_changes(_saved(base), _record(sources, path=sources["books"])) == ["data.path sources [web] -> [books]"]


def test_another_file_of_the_same_name_and_sample_count_is_named(sources, tmp_path):
    """Keyed by file name and sample count alone, a dataset replaced by another file of both went
    unnoticed; the build checksum the dataset read on opening tells them apart (blend sources too).
    A checkpoint whose record predates checksums still resumes."""
    other = tmp_path / "other"
    other.mkdir()
    with IndexedDatasetWriter(other / "web") as writer:  # web's name and document count, other tokens
        for i in range(30):
            writer.add_document((np.arange(i, i + 40) + 7) % 256)
        writer.finalize({"tokenizer": "byte", "vocab_size": 257, "eod_id": 256})
    base = _record(sources)
    now = _record(sources, path=str(other / "web"))
    assert now["sources"] == base["sources"]
    changes = data_changes(_saved(base), now)
    assert len(changes) == 1 and changes[0].startswith("data.path web: another file of the same name and ")
    assert "build checksum" in changes[0]
    old = {key: value for key, value in base.items() if key not in ("checksums", "tokens_sampled")}
    assert data_changes(_saved(old), now) == []
    blend = _record(sources, blend=[1, sources["web"], 1, sources["code"]])
    swapped = _record(sources, blend=[1, str(other / "web"), 1, sources["code"]])
    changes = data_changes(_saved(blend), swapped)
    assert len(changes) == 1 and changes[0].startswith("data.blend web: another file")


def test_old_and_imported_checkpoints_resume(sources):
    """No refusal on what a checkpoint does not record; an older layout-free state.json still
    names its sequence length and seed; a step-0 checkpoint (from-hf) has drawn no sample."""
    now = _record(sources, seq=8, seed=5)
    assert data_changes({"step": 10, "consumed_samples": 80}, now) == []
    old = {"step": 10, "model": {"seq_length": 16}, "data_seed": 1234}
    assert data_changes(old, now) == ["model.seq_length 16 -> 8", "train.seed 1234 -> 5"]
    assert data_changes({**old, "step": 0}, now) == []


def test_the_refusal_and_the_opt_in(tmp_path):
    path = tmp_path / "checkpoints" / "global_step10"
    refusal, warning = data_change_problem(path, ["train.seed 1 -> 2"], accept=False)
    assert warning is None and str(path) in refusal and "train.seed 1 -> 2" in refusal
    assert "train.resume_accept_data_change=true" in refusal and "\n" not in refusal
    refusal, warning = data_change_problem(path, ["train.seed 1 -> 2"], accept=True)
    assert refusal is None and warning.startswith("megaframe: warning:") and "from step 11" in warning
    assert "train.seed 1 -> 2" in warning
    assert data_change_problem(path, [], accept=False) == (None, None)


# ---- what changed ----------------------------------------------------------------------------
NOW = {"backend": "deepspeed", "tp": 2, "pp": 1, "dp": 2, "cp": 1, "ep": 1, "zero": 2, "max_steps": 40,
       "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 10, "lr_decay": "cosine"}


def test_the_change_line_names_what_changed_old_to_new():
    saved = {**NOW, "backend": "fsdp2", "tp": 1, "dp": 4, "zero": 3, "max_steps": 20, "warmup_steps": 5}
    line = change_line(Path("c/global_step10"), {"run": saved}, NOW)
    assert line.startswith("changed since global_step10: ")
    for said in ("backend fsdp2 -> deepspeed", "parallel.tp 1 -> 2", "parallel.dp 4 -> 2", "zero.stage 3 -> 2",
                 "train.max_steps 20 -> 40", "optim.warmup_steps 5 -> 10"):
        assert said in line, said
    assert "parallel.pp" not in line and "optim.lr " not in line and "\n" not in line
    assert "schedule" in line
    assert change_line(Path("global_step10"), {"run": dict(NOW)}, NOW) is None


def test_the_change_line_of_a_checkpoint_that_records_only_its_layout():
    """Written before the run record: the layout record says tp, pp, dp, cp, ep, ZeRO stage and,
    for fsdp2, the engine; nothing is said of what it does not record."""
    line = change_line(Path("global_step4"), {"layout": {"tp": 1, "pp": 2, "dp": 2, "zero_stage": 1, "ep": 2}}, NOW)
    assert line == ("changed since global_step4: parallel.tp 1 -> 2, parallel.pp 2 -> 1, "
                    "parallel.ep 2 -> 1, zero.stage 1 -> 2")
    line = change_line(Path("global_step4"), {"layout": {"engine": "fsdp2", "tp": 2, "pp": 1, "dp": 2,
                                                         "zero_stage": 2}}, NOW)
    assert line == "changed since global_step4: backend fsdp2 -> deepspeed"
    assert change_line(Path("global_step0"), {"step": 0}, NOW) is None  # an imported model


def test_run_record_reads_the_config_and_layout():
    from megaframe.config.compose import compose
    from megaframe.config.validate import validate

    cfg, _ = compose(["parallel.tp=2", "parallel.dp=2", "zero=stage1", "train.max_steps=40"])
    record = resume_checks.run_record(cfg, validate(cfg, 4))
    assert {k: record[k] for k in ("backend", "tp", "pp", "dp", "zero", "max_steps")} == \
        {"backend": "deepspeed", "tp": 2, "pp": 1, "dp": 2, "zero": 1, "max_steps": 40}


def test_an_unreadable_run_dir_before_a_fresh_start_ends_every_rank(tmp_path):
    """start_over's check reads the run dir on rank 0; an OSError there was raised on rank 0 alone and
    the other ranks waited in their broadcast until the collective timeout. Now every rank raises it."""
    from tests.support.ranks import run_ranks

    results = run_ranks(_start_over_on_unreadable_storage, 2, tmp_path, timeout=120, run=str(tmp_path / "run"))
    assert results == [("OSError", "EIO")] * 2, results


def _start_over_on_unreadable_storage(rank: int, world: int, run: str):
    from pathlib import Path

    from megaframe.checkpoint import resume_checks

    def unreadable(*args):
        raise OSError(5, "EIO")
    resume_checks.start_over_problem = unreadable
    try:
        resume_checks.start_over(Path(run), Path(run) / "checkpoints", "auto", None, rank == 0)
    except OSError as err:
        return type(err).__name__, err.strerror
    return None


def test_a_resume_path_naming_a_run_dir_or_a_hugging_face_model_says_what_to_name(tmp_path):
    """Both failed after launch with "no manifest.json: ... resume from an earlier checkpoint" (exit 5)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "global_step4").mkdir(parents=True)
    problem = prelaunch_problem(tmp_path / "new", str(run))
    assert problem == (f"train.resume={run}: a run directory, not a checkpoint; resume from its checkpoints with "
                       f"train.resume={run / 'checkpoints'} (the newest), or a checkpoint in it such as "
                       f"{run / 'checkpoints' / 'global_stepN'}")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert prelaunch_problem(tmp_path / "new", str(hf)) == (
        f"train.resume={hf}: a Hugging Face model, not a megaframe checkpoint; convert it first "
        f"(megaframe-convert from-hf {hf} OUT) and resume from OUT")
    (hf / "manifest.json").write_text("{}")  # megaframe-convert from-hf's own output: a checkpoint
    assert prelaunch_problem(tmp_path / "new", str(hf)) is None
    (run / "checkpoints" / "latest").write_text("global_step4\n")  # checkpoints/ with its pointer
    assert prelaunch_problem(tmp_path / "new", str(run / "checkpoints")) is None


def test_starting_over_drops_the_line_a_crash_cut_short_and_keeps_the_earlier_records(tmp_path, capsys):
    """train.resume=none keeps the earlier run's records and appends the new run's: a last line cut
    short by a crash swallowed the new run's first record, and the file no longer read as JSON lines."""
    run = _trained(tmp_path / "run", steps=3)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')
    log = MetricsLog(run / "metrics.jsonl")
    start_over(run, run / "checkpoints", "none", log, True)
    assert "dropped 1 line(s) of" in capsys.readouterr().out
    log.append({"step": 1, "loss": 5.0})
    assert [record["step"] for record in read_metrics(run / "metrics.jsonl")] == [0, 1, 2, 3, 1]

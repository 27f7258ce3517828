"""The layout-free format: round trip, manifest verification (flipped byte, truncation, missing
file), atomic replacement, and the pipeline-name mapping."""
from __future__ import annotations

import json
import re

import pytest
import torch

from megaframe.checkpoint import sharded, universal
from megaframe.backends.deepspeed.pipeline import canonical_name
from megaframe.config.schema import ModelConfig
from megaframe.model.dims import resolve_dims
from megaframe.model.spec import ModelSpec
from megaframe.checkpoint.universal import CheckpointError

STATE = {"step": 7, "consumed_samples": 56, "model": {"num_layers": 2, "vocab_size": 5}}


def _write(path, **extra):
    model = {"embed.tok.weight": torch.randn(5, 4), "final_norm.weight": torch.ones(4)}
    optim = {f"{k}.{n}": torch.randn_like(t) for n, t in model.items() for k in universal.MOMENT_KEYS}
    return universal.write_universal(path, model, {**STATE, **extra}, optim), model, optim


def test_round_trip_and_manifest(tmp_path):
    path, model, optim = _write(tmp_path / "ckpt", optim_step=7)
    state, got_model, got_optim = sharded.read_universal(path)
    assert state["format"] == "megaframe-universal" and state["version"] == 1 and state["optim_step"] == 7
    assert all(torch.equal(got_model[k], v) for k, v in model.items()) and set(got_model) == set(model)
    assert all(torch.equal(got_optim[k], v) for k, v in optim.items()) and set(got_optim) == set(optim)
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "optimizer.safetensors", "state.json"}
    assert manifest["tensors"]["model.safetensors"]["embed.tok.weight"] == {"shape": [5, 4], "dtype": "F32"}
    assert not list(tmp_path.glob("tmp-*"))


def test_model_only_checkpoint_has_no_optimizer_file(tmp_path):
    path = universal.write_universal(tmp_path / "m", {"head.weight": torch.zeros(5, 4)}, STATE)
    state, model, optim = sharded.read_universal(path)
    assert optim is None and list(model) == ["head.weight"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "no_manifest"])
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path, damage):
    path, _, _ = _write(tmp_path / "ckpt")
    target = path / "optimizer.safetensors"
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
        expect = "corrupted: optimizer.safetensors does not match its sha256"
    elif damage == "truncate":
        target.write_bytes(bytes(data[: len(data) // 2]))
        expect = "truncated or corrupted: optimizer.safetensors has"
    elif damage == "delete":
        target.unlink()
        expect = "incomplete: optimizer.safetensors is missing"
    else:
        (path / "manifest.json").unlink()
        expect = "has no manifest.json"
    with pytest.raises(CheckpointError, match=expect) as err:
        sharded.read_universal(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_rewrite_replaces_only_when_complete(tmp_path):
    path, _, _ = _write(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="needs 'step'"):  # a failed write leaves the old one in place
        universal.write_universal(path, {"x": torch.zeros(1)}, {"consumed_samples": 0, "model": {}})
    assert sharded.read_universal(path)[0]["step"] == 7
    _write(path, step=9)
    assert sharded.read_universal(path)[0]["step"] == 9
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_wrong_format_is_refused(tmp_path):
    path, _, _ = _write(tmp_path / "ckpt")
    (path / "state.json").write_text(json.dumps({**STATE, "format": "other", "version": 1}))
    with pytest.raises(CheckpointError, match="format 'other'"):
        universal.read_state(path)


@pytest.mark.parametrize("field, value, says", [
    ("step", "x", "'step' is 'x', not a whole number"), ("step", True, "'step' is True"),
    ("consumed_samples", -4, "'consumed_samples' is -4, not a whole number >= 0"),
    ("optim_step", 2.5, "'optim_step' is 2.5, not a whole number"),
    ("lr_scheduler", [1, 2], "'lr_scheduler' is [1, 2], not a JSON object"),
    ("lr_scheduler", {"last_epoch": "7"}, "'lr_scheduler.last_epoch' is '7'"),
    ("loss_scaler", {"cur_scale": "big"}, "'loss_scaler.cur_scale' is 'big', not a number")])
def test_a_crafted_state_json_is_one_line_not_a_traceback(tmp_path, field, value, says):
    """The manifest can be recomputed, so a planted or hand-edited state.json reaches the loaders,
    whose int() and .get() raised ValueError or AttributeError (exit 1, a traceback): now exit 5's line."""
    path, _, _ = _write(tmp_path / "ckpt")
    state = json.loads((path / "state.json").read_text())
    (path / "state.json").write_text(json.dumps({**state, field: value}))
    with pytest.raises(CheckpointError, match="state.json's " + re.escape(says)) as err:
        universal.read_state(path)
    assert "\n" not in str(err.value) and "use an earlier checkpoint" in str(err.value)
    assert universal.read_state(_write(tmp_path / "good")[0])["step"] == 7


def test_a_step_other_than_its_directory_names_is_refused(tmp_path):
    """state.json's step set to 10^15 in global_step30 (manifest re-hashed) trained on, ending
    "finished at step 1000000000000000/40" (review); saves name a checkpoint after its step."""
    path, _, _ = _write(tmp_path / "global_step7")
    assert universal.read_state(path)["step"] == 7
    renamed = path.rename(tmp_path / "global_step30")
    with pytest.raises(CheckpointError, match=f"^checkpoint {renamed}: state.json's 'step' is 7, not the 30 its "
                                              f"directory is named after"):
        universal.read_state(renamed)
    assert universal.read_state(renamed.rename(tmp_path / "my-copy"))["step"] == 7  # a name of the user's own


@pytest.mark.parametrize("module_name, canonical", [
    ("tied_modules.embed.tok.weight", "embed.tok.weight"),
    ("tied_modules.embed.pos.weight", "embed.pos.weight"),
    ("0.tok.weight", "embed.tok.weight"),
    ("1.block.attn.q_proj.weight", "blocks.0.attn.q_proj.weight"),
    ("4.block.mlp_norm.bias", "blocks.3.mlp_norm.bias"),
    ("5.norm.weight", "final_norm.weight"),
    ("6.weight", "head.weight"),
])
def test_pipeline_names_map_to_canonical(module_name, canonical):
    dims = resolve_dims(ModelConfig(num_layers=4, tie_embeddings=False), 100)
    assert canonical_name(module_name, ModelSpec(dims).layers()) == canonical


def test_an_interrupted_swap_is_put_right_and_a_finished_one_cleared(tmp_path):
    """What a crash between replace_dir's renames leaves: the old copy comes back under its name and
    the new one goes to the trash; an aside copy beside its name, or one without the new copy (a
    husk a delete left), goes to the trash; nothing is deleted here, and other entries stay."""
    def directory(name: str, content: str):
        (tmp_path / name).mkdir()
        (tmp_path / name / "file").write_text(content)

    directory("tmp-old-global_step4", "old 4")  # the crash came between the renames
    directory("tmp-global_step4", "new 4")
    directory("tmp-old-global_step2", "old 2")  # the crash came before the aside copy was deleted
    directory("global_step2", "new 2")
    directory("tmp-old-global_step1", "husk")  # no new copy beside it: not a swap cut in two
    directory("tmp-del-global_step4", "pruned long ago")
    assert universal.finish_interrupted_swaps(tmp_path) == [tmp_path / "global_step4"]
    assert (tmp_path / "global_step4" / "file").read_text() == "old 4"
    assert (tmp_path / "global_step2" / "file").read_text() == "new 2"
    trash = {p.name: (p / "file").read_text() for p in tmp_path.glob("tmp-del-*")}
    assert trash == {"tmp-del-global_step4": "pruned long ago", "tmp-del-global_step4-1": "new 4",
                     "tmp-del-global_step2": "old 2", "tmp-del-global_step1": "husk"}, trash
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("tmp-del-")) == [
        "global_step2", "global_step4"]
    assert universal.finish_interrupted_swaps(tmp_path) == []

    # the new copy cleared by hand (a tmp-global_stepN is never a checkpoint): the copy `latest` names
    # went to the trash with it (review); a planted link is never made a checkpoint
    directory("tmp-old-global_step5", "old 5")
    (tmp_path / "latest").write_text("global_step5\n")
    (tmp_path / "tmp-old-global_step7").symlink_to(tmp_path / "global_step2")
    assert universal.finish_interrupted_swaps(tmp_path) == [tmp_path / "global_step5"]
    assert (tmp_path / "global_step5" / "file").read_text() == "old 5"
    assert not (tmp_path / "global_step7").exists() and not (tmp_path / "tmp-old-global_step7").exists()
    assert (tmp_path / "global_step2" / "file").read_text() == "new 2"

    # the same through a checkpoints/ linked to shared storage (review: `latest`'s resolved path never
    # equalled the unresolved one, and the copy went to the trash)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "tmp-old-global_step9").mkdir()
    (shared / "latest").write_text("global_step9\n")
    (tmp_path / "linked").symlink_to(shared)
    assert universal.finish_interrupted_swaps(tmp_path / "linked") == [tmp_path / "linked" / "global_step9"]
    assert (shared / "global_step9").is_dir()

    # and a save of the step whose swap was interrupted removes the aside copy the crash left
    directory("tmp-old-global_step6", "old 6")
    directory("tmp-global_step6", "new 6")
    universal.replace_dir(tmp_path / "tmp-global_step6", tmp_path / "global_step6")
    assert (tmp_path / "global_step6" / "file").read_text() == "new 6"
    assert not (tmp_path / "tmp-old-global_step6").exists()

"""from-hf refuses what megaframe cannot reproduce (one line naming the HF config key) and never
unpickles arbitrary objects."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.support.helpers import REPO, cli_env
from megaframe.convert.cli import import_hf
from megaframe.convert.files import read_layout_free
from megaframe.convert.hf import ConvertError


def tiny_hf_config(kind: str, **config):
    from transformers import GPT2Config, LlamaConfig

    if kind == "llama":
        return LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, **config)
    return GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2, n_positions=16, **config)


def tiny_hf(kind: str, **config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_hf_config(kind, **config))


def convert(hf_dir, out) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megaframe.convert", "from-hf", str(hf_dir), str(out)],
                          cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)


def test_cli_refuses_rope_scaling_in_one_line(tmp_path):
    tiny_hf_config("llama").save_pretrained(tmp_path / "hf")  # refused before any weights are read
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    config.pop("rope_parameters", None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    result = convert(tmp_path / "hf", tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("megaframe-convert: error: config.json rope_scaling=")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind, key, value", [
    ("llama", "hidden_act", "gelu"),
    ("llama", "attention_dropout", 0.1),
    ("llama", "mlp_bias", True),
    ("llama", "rope_parameters", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ("gpt2", "scale_attn_by_inverse_layer_idx", True),
    ("gpt2", "scale_attn_weights", False),
    ("gpt2", "activation_function", "relu"),
    ("gpt2", "attn_pdrop", 0.0),
    ("gpt2", "model_type", "gpt_neox"),
])
def test_unsupported_hf_config_is_refused_naming_its_key(kind, key, value, tmp_path):
    tiny_hf_config(kind).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config[key] = value
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError, match=f"config.json {key}[.=]") as error:
        import_hf(tmp_path / "hf", tmp_path / "out")
    assert "\n" not in str(error.value)


def test_supported_variants_import(tmp_path):
    """The checks above refuse only what they name: bf16 weights, tied Llama, rope_theta import, a
    head_dim other than hidden/heads (model.head_dim)."""
    model = tiny_hf("llama", tie_word_embeddings=True, rope_theta=321.0, head_dim=32).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    cfg, _ = import_hf(tmp_path / "hf", tmp_path / "out")
    assert cfg.tie_embeddings and cfg.rope_theta == 321.0 and cfg.num_kv_heads == 1 and cfg.head_dim == 32
    _, tensors = read_layout_free(tmp_path / "out")
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert torch.equal(tensors["embed.tok.weight"], model.model.embed_tokens.weight.float())


def test_sharded_safetensors_import(tmp_path):
    model = tiny_hf("llama")
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    import_hf(tmp_path / "hf", tmp_path / "out")
    _, tensors = read_layout_free(tmp_path / "out")
    assert torch.equal(tensors["blocks.0.mlp.down_proj.weight"], model.model.layers[0].mlp.down_proj.weight)
    assert torch.equal(tensors["head.weight"], model.lm_head.weight)


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this calls open(marker, "w"): code execution
        return (open, (str(self.marker), "w"))


def _gpt2_bin(tmp_path, extra=None):
    """A GPT-2 directory whose weights are a pytorch_model.bin pickle (optionally with `extra` inside)."""
    model = tiny_hf("gpt2")
    model.config.save_pretrained(tmp_path / "hf")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    if extra is not None:
        weights["transformer.h.0.attn.bias"] = extra
    torch.save(weights, tmp_path / "hf" / "pytorch_model.bin")
    return model


def test_plain_tensor_bin_weights_import(tmp_path):
    model = _gpt2_bin(tmp_path)
    import_hf(tmp_path / "hf", tmp_path / "out")
    _, tensors = read_layout_free(tmp_path / "out")
    assert torch.equal(tensors["embed.pos.weight"], model.transformer.wpe.weight)


def test_malicious_pickle_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    _gpt2_bin(tmp_path, extra=_RunsCode(marker))
    with pytest.raises(ConvertError, match="refusing to load: it is not a plain tensor file"):
        import_hf(tmp_path / "hf", tmp_path / "out")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_corrupt_checkpoint_is_refused_by_its_manifest(tmp_path):
    tiny_hf("gpt2").save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "out")
    with open(tmp_path / "out" / "shards" / "rank00000.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(ConvertError, match="corrupted: shards/rank00000.safetensors does not match its sha256 in "
                                           "manifest.json"):
        read_layout_free(tmp_path / "out")


def test_existing_output_is_kept_unless_forced(tmp_path):
    tiny_hf("gpt2").save_pretrained(tmp_path / "hf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    with pytest.raises(ConvertError, match="already exists"):
        import_hf(tmp_path / "hf", tmp_path / "out")
    assert (tmp_path / "out" / "keep").exists()
    import_hf(tmp_path / "hf", tmp_path / "out", force=True)
    assert not (tmp_path / "out" / "keep").exists() and (tmp_path / "out" / "manifest.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging debris


def _damage_truncated_weights(hf):
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    return "truncated"


def _damage_config(hf):
    (hf / "config.json").write_text('{"model_type": "llama", ')
    return "config.json: not valid JSON"


def _damage_index(hf):
    (hf / "model.safetensors").unlink()
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    return "not a shard index with a weight_map"


def _damage_index_outside(hf):
    (hf / "model.safetensors").unlink()
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}}))
    return "names files outside"


@pytest.mark.parametrize("damage", [_damage_truncated_weights, _damage_config, _damage_index, _damage_index_outside])
def test_a_damaged_hf_directory_is_one_line_not_a_traceback(damage, tmp_path):
    tiny_hf("llama").save_pretrained(tmp_path / "hf")
    fragment = damage(tmp_path / "hf")
    result = convert(tmp_path / "hf", tmp_path / "out")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.startswith("megaframe-convert: error: ") and fragment in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_force_never_replaces_the_directory_that_holds_the_input(tmp_path):
    """`megaframe-convert to-hf RUN/checkpoints/global_step4 RUN --force` deleted the run it converted."""
    from megaframe.convert.cli import export_hf

    run = tmp_path / "run"
    import_hf(_save_tiny(tmp_path / "hf"), run / "checkpoints" / "global_step4")
    with pytest.raises(ConvertError, match="holds the input .*--force would delete it"):
        export_hf(run / "checkpoints" / "global_step4", run, force=True)
    with pytest.raises(ConvertError, match="holds the input"):
        import_hf(tmp_path / "hf", tmp_path, force=True)
    assert (run / "checkpoints" / "global_step4" / "manifest.json").is_file() and (tmp_path / "hf").is_dir()
    # an export inside the checkpoint was written, and went when keep_checkpoints pruned its folder (review)
    with pytest.raises(ConvertError, match="global_step4/hf is inside the input .*; choose an output directory"):
        export_hf(run / "checkpoints" / "global_step4", run / "checkpoints" / "global_step4" / "hf")
    assert not (run / "checkpoints" / "global_step4" / "hf").exists()
    import_hf(tmp_path / "hf", tmp_path / "hf" / "imported")  # an HF folder is never pruned: inside it is fine


@pytest.mark.parametrize("kind", ["file", "link to a directory", "dangling link"])
def test_an_output_that_is_a_file_or_a_link_is_refused_even_with_force(kind, tmp_path):
    """--force onto checkpoints/latest (a file) or a symlink replaced it and left tmp-old-NAME behind;
    a dangling link failed after the whole conversion, naming a temp directory (found by review)."""
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("global_step4\n")
    else:
        (tmp_path / "target").mkdir()
        out.symlink_to(tmp_path / ("target" if kind == "link to a directory" else "missing"))
    said = "is a file, not a directory" if kind == "file" else "is a symbolic link; name a directory of its own"
    with pytest.raises(ConvertError, match=said):
        import_hf(_save_tiny(tmp_path / "hf"), out, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf", "out", *(["target"] if kind != "file" else [])])
    assert out.is_symlink() or out.read_text() == "global_step4\n"


def test_an_hf_directory_below_a_folder_name_that_is_not_utf8_names_the_path(tmp_path):
    """safetensors opens only UTF-8 paths: a good model.safetensors was "not a readable safetensors
    file" (review)."""
    odd = tmp_path / "odd\udcff" / "hf"  # the byte 0xff, as Python keeps a name the file system gives it
    _save_tiny(tmp_path / "hf").rename(odd.parent.mkdir() or odd)
    with pytest.raises(ConvertError, match=r": its path is not UTF-8 text, which safetensors cannot open; rename the "
                                           r"folder \(or move it\) to a UTF-8 name$"):
        import_hf(odd, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _save_tiny(directory):
    tiny_hf("gpt2").save_pretrained(directory)
    return directory


@pytest.mark.parametrize("change, said", [
    ({"intermediate_size": None}, "no 'intermediate_size' key"),
    ({"num_attention_heads": 0}, "ZeroDivisionError"),
    ({"num_attention_heads": "2"}, "TypeError"),
    ({"rms_norm_eps": "x"}, "ValueError"),
])
def test_an_incomplete_or_mistyped_config_is_one_line(change, said, tmp_path, capsys):
    """A hand-made config.json missing a key or holding a string for a number was a traceback."""
    from megaframe.convert.cli import main

    tiny_hf_config("llama").save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key, value in change.items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as ended:
        main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "out")])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and line.startswith("megaframe-convert: error: ") and said in line, line
    assert "not a complete llama config" in line and not (tmp_path / "out").exists()


def test_an_output_folder_that_cannot_be_made_is_one_line(tmp_path):
    """Its parent a file (or a read-only place): FileExistsError's traceback."""
    tiny_hf("llama").save_pretrained(tmp_path / "hf")
    (tmp_path / "a_file").write_text("x")
    result = convert(tmp_path / "hf", tmp_path / "a_file" / "out")
    (line,) = result.stderr.strip().splitlines()
    assert result.returncode == 2 and line.startswith("megaframe-convert: error: ") and "a_file" in line, line
    assert "cannot create the output directory (File exists); choose one you can write" in line, line


@pytest.mark.parametrize("out", ["", ".", "..", "sub/.."])
def test_an_output_that_names_the_working_directory_is_one_line_before_any_work(out, tmp_path, monkeypatch, capsys):
    """An unset $OUT (`megaframe-convert from-hf HF "$OUT" --force`) ran the whole conversion, then
    failed to publish it with ValueError's traceback; with --force, '.' or '..' is where the user is."""
    from megaframe.convert.cli import main

    tiny_hf("gpt2").save_pretrained(tmp_path / "hf")
    (tmp_path / "work" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(SystemExit) as ended:
        main(["from-hf", str(tmp_path / "hf"), out, "--force"])
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megaframe-convert")]
    assert ended.value.code == 2 and "is the working directory or above it; name a directory" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "work"]  # no staging folder beside either
    assert [p.name for p in (tmp_path / "work").iterdir()] == ["sub"]


# megaframe-convert as a user runs it, its tensor writing held up until a signal comes: the file named
# by argv[1] says the staging folder exists and the weights are being written
_HELD = """
import pathlib, sys, time
from megaframe.checkpoint import sharded  # the shard files' writer
started, write = pathlib.Path(sys.argv.pop(1)), sharded.write_streaming
def held(path, *args, **kwargs):
    started.touch()
    time.sleep(60)
    return write(path, *args, **kwargs)
sharded.write_streaming = held
from megaframe.convert.cli import main
main(sys.argv[1:])
"""


def test_a_conversion_stopped_by_sigterm_leaves_nothing_and_one_killed_is_cleaned_up_by_the_next(tmp_path):
    """SIGTERM (a scheduler's time limit) left the hidden staging folder, as large as the model, for
    good: now it ends as Ctrl-C does (one line, exit 143, the folder removed). SIGKILL runs no
    handler: the next conversion of the same OUT on this host removes what the dead one left, never
    a live conversion's or another host's."""
    import os
    import signal
    import time

    from megaframe.data.temp_files import host_tag

    tiny_hf("gpt2").save_pretrained(tmp_path / "hf")
    started = tmp_path / "started"
    tool = subprocess.Popen([sys.executable, "-c", _HELD, str(started), "from-hf", str(tmp_path / "hf"),
                             str(tmp_path / "out")], cwd=REPO, env=cli_env(), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p.name for p in tmp_path.glob(".tmp-out-*")], "no staging folder while writing"
    tool.send_signal(signal.SIGTERM)
    _, err = tool.communicate(timeout=60)
    assert tool.returncode == 128 + signal.SIGTERM, err
    assert [line for line in err.splitlines() if line.startswith("megaframe-convert")] == [
        "megaframe-convert: stopped by SIGTERM: nothing was published (an earlier output is untouched)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "started"]

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".tmp-out-{host_tag()}-{ended.stdout.strip()}-0123abcd"  # what SIGKILL leaves
    live = tmp_path / f".tmp-out-{host_tag()}-{os.getppid()}-0123abcd"
    elsewhere = tmp_path / f".tmp-out-another_host-{ended.stdout.strip()}-0123abcd"
    for folder in (dead, live, elsewhere):
        (folder / "shards").mkdir(parents=True)
    result = convert(tmp_path / "hf", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert f"removed {dead.name}, left by a conversion that was killed" in result.stderr
    assert not dead.exists() and live.is_dir() and elsewhere.is_dir()
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_a_stop_during_the_publish_waits_for_it_and_says_the_output_is_complete(tmp_path, monkeypatch, capsys):
    """A signal between the renames that put OUT in place is held until both are done; the output is
    then the new one, complete, and the tool says so and exits 0 (it said nothing was published)."""
    import os
    import signal

    from megaframe.checkpoint import universal
    from megaframe.convert.cli import main

    tiny_hf("gpt2").save_pretrained(tmp_path / "hf")
    replace = universal.replace_dir

    def signalled_mid_way(tmp, final, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # held by signals_deferred until the renames are done
        return replace(tmp, final, *args, **kwargs)
    monkeypatch.setattr(universal, "replace_dir", signalled_mid_way)
    main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "out")])
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megaframe-convert")]
    assert line == (f"megaframe-convert: stopped by SIGTERM after {tmp_path / 'out'} was written and in place: "
                    f"it is complete")
    assert read_layout_free(tmp_path / "out")[1]

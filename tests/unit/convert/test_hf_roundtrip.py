"""megaframe -> transformers -> megaframe on random tiny models: logits agree through `transformers`,
and importing the export gives back the same config and tensors."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megaframe.config.schema import ModelConfig
from megaframe.convert.cli import export_hf, import_hf, model_overrides
from megaframe.convert.files import read_layout_free, write_layout_free
from megaframe.model.factory import build_model, resolve_dims
from megaframe.model.full_state import full_state_dict
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState

VOCAB = 300  # padded to 384: the export must drop 84 rows
LLAMA = ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                    ffn_hidden_size=96, vocab_size=VOCAB, seq_length=32, norm="rmsnorm", norm_eps=1e-5,
                    activation="swiglu", position_embedding="rope", rope_theta=500.0, tie_embeddings=False, bias=False)
GPT2 = ModelConfig(arch="gpt2", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=160,
                   vocab_size=VOCAB, seq_length=32)
VARIANTS = {
    "llama-gqa": LLAMA,
    "llama-tied-bias": dataclasses.replace(LLAMA, tie_embeddings=True, bias=True, num_kv_heads=4),
    "llama-head-dim": dataclasses.replace(LLAMA, head_dim=32),  # LlamaConfig.head_dim, not hidden/heads
    "gpt2": GPT2,
    "gpt2-exact-gelu": dataclasses.replace(GPT2, activation="gelu_exact"),  # nanoGPT's MLP; HF "gelu"
    "gpt2-untied-nobias": dataclasses.replace(GPT2, tie_embeddings=False, bias=False, norm_eps=1e-6),
}


def random_model(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """A tp=1 megaframe GPT whose every parameter (norm gains, biases, padded rows too) is random."""
    model = build_model(resolve_dims(cfg, VOCAB), ParallelState(ParallelDims(), rank=0), seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_matches_transformers_and_imports_back(name, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = VARIANTS[name]
    model = random_model(cfg)
    full = full_state_dict(model)
    assert full["embed.tok.weight"].shape[0] == VOCAB
    write_layout_free(tmp_path / "ckpt", full, {"step": 3, "consumed_samples": 24, "model": dataclasses.asdict(cfg)})

    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    # what transformers 4.x and older serving stacks read (v5 writes rope_theta only in rope_parameters):
    # a Llama 3 export read with 4.x's default theta of 10000 is silently another model
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config.get("rope_theta") == (cfg.rope_theta if cfg.position_embedding == "rope" else None)
    assert config["torch_dtype"] == "float32"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == ("LlamaForCausalLM" if cfg.arch == "llama" else "GPT2LMHeadModel")
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model.logits(ids), hf(ids).logits
    assert got.shape == want.shape == (2, 24, VOCAB)
    assert (got - want).abs().max().item() < 1e-4  # two implementations: ~1e-6 of fp32 rounding on O(1) logits

    imported_cfg, _ = import_hf(tmp_path / "hf", tmp_path / "back")
    state, tensors = read_layout_free(tmp_path / "back")
    assert state["step"] == 0 and state["model"] == dataclasses.asdict(imported_cfg)
    if cfg.bias or cfg.arch == "llama":  # HF GPT-2 always has biases: a bias-free one comes back with zero biases
        assert imported_cfg == cfg
        assert tensors.keys() == full.keys()
        for key, value in full.items():
            assert torch.equal(tensors[key], value), key


def test_to_hf_drops_padded_vocabulary_rows():
    from megaframe.convert.hf import to_hf

    model = random_model(GPT2)
    padded = {name: p.detach().clone() for name, p in model.named_parameters()}  # tp=1 names are canonical
    assert padded["embed.tok.weight"].shape[0] == 384
    config, hf_state = to_hf(GPT2, padded)
    assert config.vocab_size == VOCAB
    assert torch.equal(hf_state["transformer.wte.weight"], padded["embed.tok.weight"][:VOCAB])


@pytest.mark.parametrize("name", ["llama-gqa", "gpt2"])
def test_printed_overrides_compose_to_the_same_model_config(name):
    from megaframe.config.compose import compose

    cfg = VARIANTS[name]
    composed, _ = compose(model_overrides(cfg))  # on top of the default model group (gpt_tiny)
    assert composed.model == cfg


def test_export_of_a_run_with_an_hf_tokenizer_copies_it(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<eos>": VOCAB - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>").save_pretrained(tmp_path / "tok")
    cfg = GPT2
    state = {"step": 1, "consumed_samples": 8, "model": dataclasses.asdict(cfg), "tokenizer": str(tmp_path / "tok")}
    write_layout_free(tmp_path / "run" / "checkpoints" / "global_step1", full_state_dict(random_model(cfg)), state)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("global_step1\n")

    export_hf(tmp_path / "run" / "checkpoints", tmp_path / "hf")  # resolves `latest`
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.encode("w5 w7") == [5, 7]
    from transformers import AutoConfig
    assert AutoConfig.from_pretrained(tmp_path / "hf").eos_token_id == VOCAB - 1


@pytest.mark.parametrize("pointer", ["../elsewhere/global_step1", "/tmp/global_step1", "global_step1/../../elsewhere"])
def test_a_latest_pointer_out_of_the_checkpoints_directory_is_refused(tmp_path, pointer):
    """megaframe-convert reads `latest` by the trainer's rule: a global_stepN directory of
    checkpoints/ itself; a pointer elsewhere (an edited file) is one line, and nothing is read there."""
    from megaframe.convert.hf import ConvertError

    cfg = GPT2
    state = {"step": 1, "consumed_samples": 8, "model": dataclasses.asdict(cfg)}
    write_layout_free(tmp_path / "elsewhere" / "global_step1", full_state_dict(random_model(cfg)), state)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "latest").write_text(pointer + "\n")
    with pytest.raises(ConvertError, match="not a checkpoint directory") as refused:
        export_hf(tmp_path / "run" / "checkpoints", tmp_path / "hf")
    assert "\n" not in str(refused.value) and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("name", ["gpt2", "gpt2-exact-gelu"])
def test_a_float64_model_computes_in_float64_like_transformers(name, tmp_path):
    """The parity tests' exact reference is megaframe's model in float64: no step of it may round
    through fp32. transformers' GPT-2 in float64 is the independent check: the two agree to fp64
    rounding (fp32 anywhere in either would leave ~1e-7). Not Llama: transformers' RMSNorm computes
    in fp32 whatever the dtype (tests/unit/model/test_float64.py covers megaframe's)."""
    from transformers import AutoModelForCausalLM

    cfg = VARIANTS[name]
    model = random_model(cfg)
    write_layout_free(tmp_path / "ckpt", full_state_dict(model), {"step": 3, "consumed_samples": 24,
                                                                  "model": dataclasses.asdict(cfg)})
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64).eval()
    model = model.double()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model.logits(ids), hf(ids).logits
        loss = model(ids[:, :-1], ids[:, 1:])
    assert want.dtype == got.dtype == loss.dtype == torch.float64
    assert (got - want).abs().max().item() < 1e-10
    hf_loss = torch.nn.functional.cross_entropy(got[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    assert abs(loss.item() - hf_loss.item()) < 1e-12


def test_a_sharded_bf16_export_loads_in_transformers_and_imports_back(tmp_path):
    """save_pretrained's layout: weight files of at most --max-shard-size and the index naming each
    tensor's file (one fp32 file was 280 GB at 70B, over the Hub's 50 GB limit); --dtype bfloat16
    halves them, recorded in config.json for transformers and serving stacks."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from megaframe.convert.cli import main

    model = random_model(LLAMA)
    full = full_state_dict(model)
    write_layout_free(tmp_path / "ckpt", full, {"step": 3, "consumed_samples": 24, "model": dataclasses.asdict(LLAMA)})
    main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--dtype", "bfloat16", "--max-shard-size", "40KB"])
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and "model.safetensors" not in files
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == files
    for name in files:
        assert (tmp_path / "hf" / name).stat().st_size <= 40_000 + 2_000, name  # a tensor over the size would be alone
        with safe_open(str(tmp_path / "hf" / name), framework="pt") as f:
            assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"BF16"}
            assert all(index["weight_map"][key] == name for key in f.keys())
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():  # megaframe's model with its weights rounded to bf16, as the export rounded them
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).to(torch.float32))
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model.logits(ids), hf(ids).logits
    assert (got - want).abs().max().item() < 1e-4

    import_hf(tmp_path / "hf", tmp_path / "back")
    _, tensors = read_layout_free(tmp_path / "back")
    assert tensors.keys() == full.keys()
    for key, value in full.items():
        assert torch.equal(tensors[key], value.to(torch.bfloat16).to(torch.float32)), key


@pytest.mark.parametrize("size", ["5 parsecs", "-1GB", "0", ""])
def test_a_max_shard_size_that_is_no_size_is_one_line(size, tmp_path, capsys):
    from megaframe.convert.cli import main

    with pytest.raises(SystemExit) as ended:
        main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), f"--max-shard-size={size}"])
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megaframe-convert")]
    assert ended.value.code == 2 and "--max-shard-size" in line and "write it as 5GB" in line, line


@pytest.mark.parametrize("name, shape", [("attn.c_attn.weight", (64, 256)), ("attn.c_attn.weight", (64, 100)),
                                         ("attn.c_attn.weight", (64, 3, 64)), ("attn.c_attn.bias", (256,)),
                                         ("mlp.c_fc.weight", (64, 3, 160))])
def test_a_gpt2_conv1d_of_another_shape_is_refused_naming_the_tensor(name, shape):
    """GPT-2's fused q|k|v was split without a look at its shape: a wider one lost its extra columns
    silently (exit 0), a narrower or 3-D one was a traceback (found by review)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from megaframe.convert.hf import ConvertError, config_from_hf, state_from_hf_plan

    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, n_inner=160, vocab_size=VOCAB, n_positions=32))
    shapes = {key: tuple(value.shape) for key, value in hf.state_dict().items()}
    cfg = config_from_hf(hf.config.to_dict())
    state_from_hf_plan(cfg, shapes)  # the right shapes import
    shapes[f"transformer.h.1.{name}"] = shape
    with pytest.raises(ConvertError, match=rf"tensor transformer.h.1.{name} has shape \[{', '.join(map(str, shape))}\] "
                                           rf"but config.json \(hidden 64, MLP width 160\) needs"):
        state_from_hf_plan(cfg, shapes)

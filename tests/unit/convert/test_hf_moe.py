"""Mixture-of-Experts models <-> transformers' MixtralForCausalLM and Qwen3MoeForCausalLM, on tiny
random fp32 models built here (nothing is downloaded):
- export: megaframe's logits equal transformers' on the exported directory, and importing it gives
  back the same config and tensors;
- import: a random HF model gives transformers' logits in megaframe, from each weight layout
  transformers reads (per-expert files as save_pretrained writes them, Mixtral's names renamed, v5's
  fused gate_up_proj), and exporting the import writes the HF files again, tensor for tensor;
- what neither side can reproduce is refused in one line naming the config key;
- stacked experts are read one expert at a time (export) or one half of a fused tensor (import)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from tests.support.helpers import REPO, cli_env
from megaframe.config.schema import ModelConfig, MoEConfig
from megaframe.convert.cli import export_hf, import_hf, model_config
from megaframe.convert.files import LazyTensors, read_layout_free, write_layout_free
from megaframe.convert.hf import ConvertError, config_from_hf, state_from_hf_plan, to_hf, to_hf_plan
from megaframe.model.factory import build_model, resolve_dims
from megaframe.model.full_state import canonical_shapes, full_state_dict, load_full_state
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState

VOCAB = 300  # padded to 384: the export drops 84 rows
MOE = MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=48, aux_loss_coeff=0.02, z_loss_coeff=0.0)
# Mixtral has one MLP width: an imported Mixtral's model.ffn_hidden_size is the experts' (unused: every block routes)
MIXTRAL = ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                      ffn_hidden_size=48, vocab_size=VOCAB, seq_length=32, norm="rmsnorm", norm_eps=1e-5,
                      activation="swiglu", position_embedding="rope", rope_theta=500.0, tie_embeddings=False,
                      bias=False, moe=MOE)
QWEN3 = dataclasses.replace(MIXTRAL, num_layers=3, ffn_hidden_size=80, qk_norm=True, head_dim=32, norm_eps=1e-6,
                            moe=dataclasses.replace(MOE, first_dense_layers=1, norm_topk_prob=False))
VARIANTS = {
    "mixtral": MIXTRAL,
    "mixtral-tied-headdim-top1": dataclasses.replace(MIXTRAL, tie_embeddings=True, head_dim=32, num_kv_heads=4,
                                                     moe=dataclasses.replace(MOE, top_k=1)),
    "qwen3-moe-first-dense": QWEN3,
    "qwen3-moe-every-second": dataclasses.replace(QWEN3, num_layers=4, head_dim=None,
                                                  moe=dataclasses.replace(MOE, layer_freq=2)),
    "qwen3-moe-attention-bias": dataclasses.replace(QWEN3, bias=True, moe=dataclasses.replace(MOE, top_k=3)),
}
IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def random_model(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """A tp=1 megaframe GPT (GPT + init_parameters) whose every parameter is random."""
    model = build_model(resolve_dims(cfg, VOCAB), ParallelState(ParallelDims(), rank=0), seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval()


def megaframe_from(cfg: ModelConfig, tensors: dict) -> torch.nn.Module:
    model = build_model(resolve_dims(cfg, cfg.vocab_size), ParallelState(ParallelDims(), rank=0), seed=7)
    load_full_state(model, tensors)
    return model.eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_matches_transformers_and_imports_back(name, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = VARIANTS[name]
    model = random_model(cfg)
    full = full_state_dict(model)
    write_layout_free(tmp_path / "ckpt", full, {"step": 3, "consumed_samples": 24, "model": dataclasses.asdict(cfg)})

    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == ("Qwen3MoeForCausalLM" if cfg.qk_norm else "MixtralForCausalLM")
    with torch.no_grad():
        want, got = model.logits(IDS), hf(IDS).logits
    diff = max_diff(got, want)
    print(f"{name}: export max |logit diff| {diff:.3g}")
    assert diff < 1e-4

    imported_cfg, _ = import_hf(tmp_path / "hf", tmp_path / "back")
    state, tensors = read_layout_free(tmp_path / "back")
    assert state["model"] == dataclasses.asdict(imported_cfg)
    assert model_config(state, tmp_path / "back") == imported_cfg == cfg
    assert tensors.keys() == full.keys()
    for key, value in full.items():
        assert torch.equal(tensors[key], value), key


def random_hf(kind: str, **config):
    """A small random HF MoE model (fp32), every weight perturbed (norm gains too)."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, rope_theta=1000.0, num_experts_per_tok=2)
    if kind == "mixtral":
        hf_config = MixtralConfig(**{**common, "intermediate_size": 48, "num_hidden_layers": 2, "num_local_experts": 4,
                                     **config})
    else:
        hf_config = Qwen3MoeConfig(**{**common, "intermediate_size": 80, "moe_intermediate_size": 40,
                                      "num_hidden_layers": 3, "num_experts": 4, "head_dim": 32, "mlp_only_layers": [0],
                                      **config})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


HF_VARIANTS = {
    "mixtral": ("mixtral", {}),
    "mixtral-tied-top3": ("mixtral", {"tie_word_embeddings": True, "num_experts_per_tok": 3}),
    "qwen3-moe-dense-first": ("qwen3_moe", {}),
    "qwen3-moe-sparse-step-2-normalised": ("qwen3_moe", {"num_hidden_layers": 4, "mlp_only_layers": [],
                                                         "decoder_sparse_step": 2, "norm_topk_prob": True}),
}


@pytest.mark.parametrize("name", list(HF_VARIANTS))
def test_import_matches_transformers_and_exports_back(name, tmp_path):
    kind, config = HF_VARIANTS[name]
    hf = random_hf(kind, **config)
    hf.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        want = hf(IDS).logits

    cfg, _ = import_hf(tmp_path / "hf", tmp_path / "mf")
    _, tensors = read_layout_free(tmp_path / "mf")
    assert cfg.moe.num_experts == 4 and cfg.moe.top_k == hf.config.num_experts_per_tok
    with torch.no_grad():
        got = megaframe_from(cfg, tensors).logits(IDS)
    diff = max_diff(got, want)
    print(f"{name}: import max |logit diff| {diff:.3g}")
    assert diff < 1e-4

    export_hf(tmp_path / "mf", tmp_path / "hf-again")  # the same files, tensor for tensor
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "hf-again" / "model.safetensors"), "pt") as b:
        original = set(a.keys()) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
        assert set(b.keys()) == original
        for key in original:
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


def _mixtral_layouts(tmp_path) -> dict:
    """One random Mixtral in the three layouts transformers reads: save_pretrained's per-expert
    block_sparse_moe.experts.{j}.w1/w2/w3, the same renamed to mlp.*, and v5's fused tensors."""
    from safetensors.torch import load_file, save_file

    hf = random_hf("mixtral")
    hf.save_pretrained(tmp_path / "per-expert")
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    hf.config.save_pretrained(tmp_path / "renamed")
    weights = load_file(str(tmp_path / "per-expert" / "model.safetensors"))
    save_file({k.replace(".block_sparse_moe.", ".mlp."): v for k, v in weights.items()},
              str(tmp_path / "renamed" / "model.safetensors"), metadata={"format": "pt"})
    return hf


def test_every_mixtral_weight_layout_imports_to_the_same_tensors(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = _mixtral_layouts(tmp_path)
    with safe_open(str(tmp_path / "fused" / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape() == [4, 96, 64]
    with torch.no_grad():
        want = hf(IDS).logits
    results = {}
    for layout in ("per-expert", "renamed", "fused"):
        with torch.no_grad():  # transformers itself reads each layout as the same model
            assert max_diff(AutoModelForCausalLM.from_pretrained(tmp_path / layout)(IDS).logits, want) == 0
        import_hf(tmp_path / layout, tmp_path / f"mf-{layout}")
        results[layout] = read_layout_free(tmp_path / f"mf-{layout}")[1]
    gate_up = hf.model.layers[1].mlp.experts.gate_up_proj
    assert torch.equal(results["fused"]["blocks.1.mlp.experts.gate_proj"], gate_up[:, :48])
    assert torch.equal(results["fused"]["blocks.1.mlp.experts.up_proj"], gate_up[:, 48:])
    for layout in ("renamed", "fused"):
        assert results[layout].keys() == results["per-expert"].keys()
        for key, value in results["per-expert"].items():
            assert torch.equal(results[layout][key], value), (layout, key)


def test_cli_round_trip_and_printed_overrides(tmp_path):
    """The commands as a user types them; the printed overrides compose to the imported config."""
    from megaframe.config.compose import compose

    hf = random_hf("mixtral")
    hf.save_pretrained(tmp_path / "hf")
    run = [sys.executable, "-m", "megaframe.convert"]
    result = subprocess.run([*run, "from-hf", str(tmp_path / "hf"), str(tmp_path / "mf")], cwd=REPO, env=cli_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "(mixtral: 4 experts, top-2)" in result.stdout
    command = result.stdout.split("continue pre-training with:\n")[1].split()
    assert command[0] == "megaframe-train" and command[-1] == f"train.resume={tmp_path / 'mf'}"
    state, _ = read_layout_free(tmp_path / "mf")
    cfg = model_config(state, tmp_path / "mf")
    assert "model.moe.num_experts=4" in command and "model.moe.norm_topk_prob=true" in command
    composed, _ = compose(command[1:-1])
    assert composed.model == cfg

    result = subprocess.run([*run, "to-hf", str(tmp_path / "mf"), str(tmp_path / "hf-again")], cwd=REPO,
                            env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "MixtralForCausalLM" in result.stdout
    exported = json.loads((tmp_path / "hf-again" / "config.json").read_text())
    assert exported["num_local_experts"] == 4 and exported["router_aux_loss_coef"] == hf.config.router_aux_loss_coef


# ---- refusals ------------------------------------------------------------------------------------

def _saved_config(kind: str, tmp_path, **changes):
    from transformers import MixtralConfig, Qwen3MoeConfig

    if kind == "mixtral":
        config = MixtralConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                               num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)
    else:
        config = Qwen3MoeConfig(vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                                num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, num_experts=4)
    config.save_pretrained(tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    saved.update(changes)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(saved))
    return saved


@pytest.mark.parametrize("kind, key, changes", [
    ("mixtral", "sliding_window", {"sliding_window": 4096}),
    ("mixtral", "router_jitter_noise", {"router_jitter_noise": 0.1}),
    ("mixtral", "hidden_act", {"hidden_act": "gelu"}),
    ("mixtral", "num_local_experts", {"num_local_experts": 0}),
    ("mixtral", "rope_parameters", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}),
    ("qwen3_moe", "use_sliding_window", {"use_sliding_window": True, "sliding_window": 4096}),
    ("qwen3_moe", "mlp_only_layers", {"mlp_only_layers": [1]}),  # routes 0, 2, 3: no first_dense + layer_freq
    ("qwen3_moe", "decoder_sparse_step", {"decoder_sparse_step": 5}),  # routes no block of 4
    ("qwen3_moe", "attention_bias", {"attention_bias": True, "mlp_only_layers": [0]}),
    ("qwen3_moe", "attention_dropout", {"attention_dropout": 0.1}),
])
def test_unsupported_moe_config_is_refused_naming_its_key(kind, key, changes, tmp_path):
    _saved_config(kind, tmp_path, **changes)  # no weights: refused before any are read
    with pytest.raises(ConvertError, match=f"^config.json {key}[.=]") as error:
        import_hf(tmp_path / "hf", tmp_path / "out")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


def test_representable_qwen3_layer_patterns_map_to_first_dense_and_freq(tmp_path):
    cases = [({"mlp_only_layers": [0, 1]}, (2, 1)), ({"decoder_sparse_step": 2}, (1, 2)),
             ({"mlp_only_layers": [0, 2]}, (1, 2)), ({"mlp_only_layers": [0, 1, 2]}, (3, 1)),
             ({"mlp_only_layers": [1, 2, 3]}, (0, 4))]
    for changes, (first, freq) in cases:
        cfg = config_from_hf(_saved_config("qwen3_moe", tmp_path, **changes))
        assert (cfg.moe.first_dense_layers, cfg.moe.layer_freq) == (first, freq), changes
        assert cfg.qk_norm and cfg.moe.ffn_hidden_size == 24 and cfg.ffn_hidden_size == 48


@pytest.mark.parametrize("key, change", [
    ("moe.router_score", {"moe": dataclasses.replace(MOE, router_score="sigmoid")}),
    ("moe.shared_experts", {"moe": dataclasses.replace(MOE, shared_experts=1)}),
    ("moe.bias_update_rate", {"moe": dataclasses.replace(MOE, bias_update_rate=1e-3)}),
    ("moe.first_dense_layers", {"moe": dataclasses.replace(MOE, first_dense_layers=1)}),  # Mixtral routes all
    ("moe.norm_topk_prob", {"moe": dataclasses.replace(MOE, norm_topk_prob=False)}),  # Mixtral renormalises
    ("bias", {"bias": True}),  # Mixtral has no biases
    ("bias", {"bias": True, "qk_norm": True, "moe": dataclasses.replace(MOE, layer_freq=2)}),  # Qwen3 dense MLPs
    ("moe.num_experts", {"norm": "layernorm", "activation": "gelu", "position_embedding": "learned"}),  # GELU experts
    ("qk_norm", {"qk_norm": True, "moe": MoEConfig()}),  # a dense QK-norm model
])
def test_export_refuses_what_transformers_lacks_naming_our_key(key, change):
    cfg = dataclasses.replace(MIXTRAL, **change)
    with pytest.raises(ConvertError, match=f"^model.{key}[.=]") as error:
        to_hf_plan(cfg, canonical_shapes(resolve_dims(cfg, VOCAB)))
    assert "\n" not in str(error.value)


# ---- one expert at a time -----------------------------------------------------------------------

def _parts_only(tensors: dict, whole_refused: str) -> LazyTensors:
    """A source whose tensors named with `whole_refused` can only be read in parts."""
    def make(name):
        assert whole_refused not in name, f"{name} read whole"
        return tensors[name]
    return LazyTensors({k: tuple(v.shape) for k, v in tensors.items()}, make, lambda name, index: tensors[name][index])


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe-first-dense"])
def test_export_reads_stacked_experts_one_expert_at_a_time(name):
    cfg = VARIANTS[name]
    full = full_state_dict(random_model(cfg))
    _, want = to_hf(cfg, full)
    _, plan = to_hf_plan(cfg, {k: v.shape for k, v in full.items()})
    source = _parts_only(full, "experts.")
    assert plan.keys() == want.keys()
    for key, recipe in plan.items():
        assert torch.equal(recipe(source), want[key]), key


def test_fused_import_reads_gate_and_up_halves_apart(tmp_path):
    from safetensors.torch import load_file

    hf = random_hf("mixtral")
    hf.save_pretrained(tmp_path / "hf", save_original_format=False)
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    cfg = config_from_hf(hf.config.to_dict())
    plan, _ = state_from_hf_plan(cfg, weights)
    source = _parts_only(weights, "gate_up_proj")
    down = hf.model.layers[0].mlp.experts.down_proj
    assert torch.equal(plan["blocks.0.mlp.experts.down_proj"](source), down)
    for name, rows in (("gate_proj", slice(0, 48)), ("up_proj", slice(48, 96))):
        assert torch.equal(plan[f"blocks.0.mlp.experts.{name}"](source),
                           hf.model.layers[0].mlp.experts.gate_up_proj[:, rows])


def test_wrong_expert_shapes_are_refused_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file

    hf = random_hf("mixtral")
    hf.save_pretrained(tmp_path / "hf", save_original_format=False)
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    cfg = config_from_hf(hf.config.to_dict())
    narrower = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, ffn_hidden_size=40))
    with pytest.raises(ConvertError, match=r"tensor model.layers.0.mlp.experts.gate_up_proj has shape \[4, 96, 64\]"):
        state_from_hf_plan(narrower, weights)

"""Pure mappings between megaframe's canonical state dict and Hugging Face `transformers` models.

Both directions work on full, unpadded fp32 tensors keyed by canonical names (model/full_state.py):
  Llama flavour (rmsnorm + swiglu + rope)      <-> LlamaForCausalLM   (a rename: same layouts)
  GPT-2 flavour (layernorm + gelu + learned)   <-> GPT2LMHeadModel    (fused, transposed Conv1D)
Both models are pre-norm with the same residual order, RoPE in the rotate-half convention and
attention scaled by 1/sqrt(head_dim); the parity tests compare logits through `transformers`.
An HF config feature megaframe's blocks lack is refused with the config key that carries it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from megaframe.config.schema import ModelConfig
from megaframe.config.validate import ffn_hidden_size
from megaframe.model.dims import resolve_dims
from megaframe.model.full_state import canonical_shapes

# transformers' names for the tanh approximation of GELU that megaframe's GPT-2 MLP uses
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# buffers some transformers versions saved with the weights; they hold no learned values
_IGNORED_HF_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")

# Llama: (megaframe name inside blocks.{i}., HF name inside model.layers.{i}.)
_LLAMA_BLOCK = [("attn_norm.weight", "input_layernorm.weight"), ("mlp_norm.weight", "post_attention_layernorm.weight")]
_LLAMA_LINEAR = [("attn.q_proj", "self_attn.q_proj"), ("attn.k_proj", "self_attn.k_proj"),
                 ("attn.v_proj", "self_attn.v_proj"), ("attn.out_proj", "self_attn.o_proj"),
                 ("mlp.gate_proj", "mlp.gate_proj"), ("mlp.up_proj", "mlp.up_proj"), ("mlp.down_proj", "mlp.down_proj")]


class ConvertError(ValueError):
    """A model or checkpoint the converter cannot translate; str(err) is a single line."""


def flavour(cfg: ModelConfig) -> str:
    """'llama' or 'gpt2' by the blocks the config builds (model.arch is only a label)."""
    blocks = (cfg.norm, cfg.activation, cfg.position_embedding)
    if blocks == ("rmsnorm", "swiglu", "rope"):
        return "llama"
    if blocks == ("layernorm", "gelu", "learned"):
        return "gpt2"
    raise ConvertError(
        f"model.norm={cfg.norm} model.activation={cfg.activation} model.position_embedding={cfg.position_embedding} "
        "has no transformers equivalent; HF export supports the Llama flavour (rmsnorm, swiglu, rope) "
        "and the GPT-2 flavour (layernorm, gelu, learned)")


# ---- megaframe -> Hugging Face ---------------------------------------------------------------

def to_hf(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    """(transformers config, HF state dict) for a canonical megaframe state dict. Vocabulary rows
    beyond the real vocabulary (Megatron padding) are dropped."""
    vocab = state["embed.tok.weight"].shape[0]
    if cfg.vocab_size is not None:
        if cfg.vocab_size > vocab:
            raise ConvertError(f"model.vocab_size={cfg.vocab_size} but embed.tok.weight has only {vocab} rows")
        vocab = cfg.vocab_size
    state = {name: t[:vocab] if name in ("embed.tok.weight", "head.weight") else t for name, t in state.items()}
    cfg = dataclasses.replace(cfg, vocab_size=vocab)
    check_canonical(cfg, state, "the megaframe checkpoint")
    hf_config, hf_state = (_llama_to_hf if flavour(cfg) == "llama" else _gpt2_to_hf)(cfg, state)
    return hf_config, {name: t.contiguous() for name, t in hf_state.items()}


def _llama_to_hf(cfg: ModelConfig, state: dict[str, torch.Tensor]):
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=ffn_hidden_size(cfg),
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_attention_heads, hidden_act="silu",
        max_position_embeddings=cfg.seq_length, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.bias, mlp_bias=cfg.bias,
        attention_dropout=0.0, initializer_range=cfg.init_std, bos_token_id=None, eos_token_id=None,
        architectures=["LlamaForCausalLM"])
    names = _llama_names(cfg)
    return config, {names[name]: tensor for name, tensor in state.items()}


def _llama_names(cfg: ModelConfig) -> dict[str, str]:
    """{megaframe name: HF name} for every Llama tensor (the layouts agree, only names differ)."""
    names = {"embed.tok.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["head.weight"] = "lm_head.weight"
    leaves = ("weight", "bias") if cfg.bias else ("weight",)
    for i in range(cfg.num_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        names.update({ours + a: theirs + b for a, b in _LLAMA_BLOCK})
        names.update({f"{ours}{a}.{leaf}": f"{theirs}{b}.{leaf}" for a, b in _LLAMA_LINEAR for leaf in leaves})
    return names


def check_canonical(cfg: ModelConfig, state: dict[str, torch.Tensor], what: str) -> None:
    """Refuse a state dict whose names or shapes are not those of the model `cfg` describes."""
    shapes = canonical_shapes(resolve_dims(cfg, cfg.vocab_size))
    _expect_names(state, shapes.keys(), what, cfg)
    for name, shape in shapes.items():
        if tuple(state[name].shape) != shape:
            raise ConvertError(f"{what}: tensor {name} has shape {list(state[name].shape)} but its model config "
                               f"({_short(cfg)}) needs {list(shape)}")


def _expect_names(state: dict, expected, what: str, cfg) -> None:
    missing, extra = sorted(set(expected) - state.keys()), sorted(state.keys() - set(expected))
    if missing or extra:
        raise ConvertError(f"{what} does not match its model config ({_short(cfg)}): missing tensors "
                           f"{missing[:3]}, unexpected tensors {extra[:3]}")


def _short(cfg: ModelConfig) -> str:
    return (f"{cfg.arch}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
            f"bias={cfg.bias}, tie_embeddings={cfg.tie_embeddings}")


def _gpt2_to_hf(cfg: ModelConfig, state: dict[str, torch.Tensor]):
    from transformers import GPT2Config

    h = cfg.hidden_size
    config = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.seq_length, n_embd=h, n_layer=cfg.num_layers,
        n_head=cfg.num_attention_heads, n_inner=ffn_hidden_size(cfg), activation_function="gelu_new",
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        layer_norm_epsilon=cfg.norm_eps, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=None, eos_token_id=None, architectures=["GPT2LMHeadModel"])

    def bias(name: str, size: int) -> torch.Tensor:  # HF GPT-2 always has biases: zeros are exact
        return state[name] if cfg.bias else torch.zeros(size)

    out = {"transformer.wte.weight": state["embed.tok.weight"], "transformer.wpe.weight": state["embed.pos.weight"],
           "transformer.ln_f.weight": state["final_norm.weight"], "transformer.ln_f.bias": bias("final_norm.bias", h)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["head.weight"]
    ffn = ffn_hidden_size(cfg)
    for i in range(cfg.num_layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        qkv = [ours + f"attn.{p}_proj" for p in "qkv"]
        out.update({
            theirs + "ln_1.weight": state[ours + "attn_norm.weight"], theirs + "ln_1.bias": bias(ours + "attn_norm.bias", h),
            # Conv1D computes x @ W with W (in, out): our (out, in) Linear weights, transposed
            theirs + "attn.c_attn.weight": torch.cat([state[n + ".weight"] for n in qkv]).t(),
            theirs + "attn.c_attn.bias": torch.cat([bias(n + ".bias", h) for n in qkv]),
            theirs + "attn.c_proj.weight": state[ours + "attn.out_proj.weight"].t(),
            theirs + "attn.c_proj.bias": bias(ours + "attn.out_proj.bias", h),
            theirs + "ln_2.weight": state[ours + "mlp_norm.weight"], theirs + "ln_2.bias": bias(ours + "mlp_norm.bias", h),
            theirs + "mlp.c_fc.weight": state[ours + "mlp.up_proj.weight"].t(),
            theirs + "mlp.c_fc.bias": bias(ours + "mlp.up_proj.bias", ffn),
            theirs + "mlp.c_proj.weight": state[ours + "mlp.down_proj.weight"].t(),
            theirs + "mlp.c_proj.bias": bias(ours + "mlp.down_proj.bias", h),
        })
    return config, out


# ---- Hugging Face -> megaframe ---------------------------------------------------------------

def from_hf(hf_config: dict, hf_state: dict[str, torch.Tensor]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, canonical fp32 state dict) for an HF config.json dict and its weights."""
    cfg = config_from_hf(hf_config)
    return cfg, state_from_hf(cfg, hf_state)


def config_from_hf(hf_config: dict) -> ModelConfig:
    """The megaframe ModelConfig of an HF config.json dict; refuses what megaframe cannot reproduce."""
    model_type = hf_config.get("model_type")
    if model_type not in ("llama", "gpt2"):
        raise ConvertError(f"config.json model_type={model_type!r} is not supported; from-hf reads 'llama' and 'gpt2' models")
    return (_llama_config if model_type == "llama" else _gpt2_config)(hf_config)


def state_from_hf(cfg: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The canonical fp32 state dict of HF weights for the model `cfg` (from config_from_hf)."""
    hf_state = {name: t.to(torch.float32) for name, t in hf_state.items()
                if not name.endswith(_IGNORED_HF_SUFFIXES)}
    if flavour(cfg) == "llama":
        names = {theirs: ours for ours, theirs in _llama_names(cfg).items()}
        state = _take(_with_prefix(hf_state, "model."), names, cfg, embed="model.embed_tokens.weight")
    else:
        state = _gpt2_from_hf(cfg, _with_prefix(hf_state, "transformer."))
    check_canonical(cfg, state, "the HF weights")
    return state


def _refuse(key: str, value, why: str) -> ConvertError:
    return ConvertError(f"config.json {key}={value!r}: {why}; megaframe cannot reproduce this model")


def _check(hf: dict, rules: list[tuple[str, Callable[[Any], bool], str]]) -> None:
    """Refuse the first key whose value (None when absent) breaks its rule."""
    for key, ok, why in rules:
        if not ok(hf.get(key)):
            raise _refuse(key, hf.get(key), why)


def _llama_config(hf: dict) -> ModelConfig:
    rope_type = (hf.get("rope_parameters") or {}).get("rope_type", "default")
    _check(hf, [
        ("hidden_act", lambda v: v in (None, "silu"), "megaframe's Llama MLP is SwiGLU (silu)"),
        ("rope_scaling", lambda v: not v or v.get("rope_type", v.get("type")) == "default",
         "RoPE scaling is not implemented"),
        ("attention_dropout", lambda v: not v, "megaframe has no attention-only dropout"),
        ("mlp_bias", lambda v: bool(v) == bool(hf.get("attention_bias")),
         "megaframe has one model.bias for attention and MLP (attention_bias differs)"),
        ("head_dim", lambda v: v in (None, hf["hidden_size"] // hf["num_attention_heads"]),
         "megaframe's head size is hidden_size / num_attention_heads"),
    ])
    if rope_type != "default":
        raise _refuse("rope_parameters.rope_type", rope_type, "RoPE scaling is not implemented")
    theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    heads = hf["num_attention_heads"]
    return ModelConfig(
        arch="llama", num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], seq_length=hf.get("max_position_embeddings", 2048), norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), activation="swiglu", position_embedding="rope",
        rope_theta=float(theta), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bias=bool(hf.get("attention_bias", False)), dropout=0.0, init_std=float(hf.get("initializer_range", 0.02)))


def _gpt2_config(hf: dict) -> ModelConfig:
    drop = hf.get("resid_pdrop", 0.1)
    _check(hf, [
        ("activation_function", lambda v: v in (None, *_TANH_GELU), "megaframe's GPT-2 MLP uses tanh-approximated GELU (gelu_new)"),
        ("scale_attn_weights", lambda v: v in (None, True), "megaframe always scales attention by 1/sqrt(head_dim)"),
        ("scale_attn_by_inverse_layer_idx", lambda v: not v, "megaframe does not scale attention by layer index"),
        ("add_cross_attention", lambda v: not v, "megaframe has no cross-attention"),
        ("embd_pdrop", lambda v: v in (None, drop), f"megaframe has one model.dropout (resid_pdrop={drop} differs)"),
        ("attn_pdrop", lambda v: v in (None, drop), f"megaframe has one model.dropout (resid_pdrop={drop} differs)"),
    ])
    h = hf.get("n_embd", 768)
    return ModelConfig(
        arch="gpt2", num_layers=hf.get("n_layer", 12), hidden_size=h, num_attention_heads=hf.get("n_head", 12),
        num_kv_heads=None, ffn_hidden_size=hf.get("n_inner") or 4 * h, vocab_size=hf.get("vocab_size", 50257),
        seq_length=hf.get("n_positions", 1024), norm="layernorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        activation="gelu", position_embedding="learned", tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        bias=True, dropout=float(drop), init_std=float(hf.get("initializer_range", 0.02)))


def _with_prefix(hf_state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Weights saved from the bare model (GPT2Model, LlamaModel: the original GPT-2 files) lack the
    CausalLM prefix; add it so one name table serves both."""
    if any(name.startswith(prefix) for name in hf_state):
        return hf_state
    return {name if name == "lm_head.weight" else prefix + name: t for name, t in hf_state.items()}


def _take(hf_state: dict[str, torch.Tensor], names: dict[str, str], cfg: ModelConfig,
          embed: str) -> dict[str, torch.Tensor]:
    """{megaframe name: tensor} through names {HF name: megaframe name}; the copy of the token
    embedding `embed` that a tied model may store as lm_head.weight is dropped."""
    hf_state = dict(hf_state)
    tied = hf_state.pop("lm_head.weight", None) if cfg.tie_embeddings else None
    if tied is not None and embed in hf_state and not torch.equal(tied, hf_state[embed]):
        raise _refuse("tie_word_embeddings", True, "but lm_head.weight differs from the token embedding")
    _expect_names(hf_state, names.keys(), "the HF weights", cfg)
    return {names[name]: t for name, t in hf_state.items()}


def _gpt2_from_hf(cfg: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # the inverse of _gpt2_to_hf: split the fused q|k|v Conv1D, transpose Conv1D weights back
    h = cfg.hidden_size
    hf_names = {f"transformer.{n}" for n in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")}
    if not cfg.tie_embeddings:
        hf_names.add("lm_head.weight")
    per_block = ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                 "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                 "mlp.c_proj.weight", "mlp.c_proj.bias"]
    hf_names |= {f"transformer.h.{i}.{n}" for i in range(cfg.num_layers) for n in per_block}
    s = _take(hf_state, {name: name for name in hf_names}, cfg, embed="transformer.wte.weight")
    state = {"embed.tok.weight": s["transformer.wte.weight"], "embed.pos.weight": s["transformer.wpe.weight"],
             "final_norm.weight": s["transformer.ln_f.weight"], "final_norm.bias": s["transformer.ln_f.bias"]}
    if not cfg.tie_embeddings:
        state["head.weight"] = s["lm_head.weight"]
    for i in range(cfg.num_layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        q_w, k_w, v_w = s[theirs + "attn.c_attn.weight"].t().split(h)  # (3C, C) -> q|k|v rows
        q_b, k_b, v_b = s[theirs + "attn.c_attn.bias"].split(h)
        state.update({
            ours + "attn_norm.weight": s[theirs + "ln_1.weight"], ours + "attn_norm.bias": s[theirs + "ln_1.bias"],
            ours + "attn.q_proj.weight": q_w, ours + "attn.k_proj.weight": k_w, ours + "attn.v_proj.weight": v_w,
            ours + "attn.q_proj.bias": q_b, ours + "attn.k_proj.bias": k_b, ours + "attn.v_proj.bias": v_b,
            ours + "attn.out_proj.weight": s[theirs + "attn.c_proj.weight"].t(),
            ours + "attn.out_proj.bias": s[theirs + "attn.c_proj.bias"],
            ours + "mlp_norm.weight": s[theirs + "ln_2.weight"], ours + "mlp_norm.bias": s[theirs + "ln_2.bias"],
            ours + "mlp.up_proj.weight": s[theirs + "mlp.c_fc.weight"].t(), ours + "mlp.up_proj.bias": s[theirs + "mlp.c_fc.bias"],
            ours + "mlp.down_proj.weight": s[theirs + "mlp.c_proj.weight"].t(),
            ours + "mlp.down_proj.bias": s[theirs + "mlp.c_proj.bias"],
        })
    return {name: t.contiguous() for name, t in state.items()}

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
from typing import Any, Callable, Mapping

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
#
# A plan maps each output tensor's name to a recipe: a function of the source tensors (any Mapping:
# a dict, or files read on demand), so the converter makes one output tensor at a time and never
# holds the model (convert/stream.py). Planning needs only the source's shapes.

Recipe = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


def _shape(value) -> tuple[int, ...]:
    """A tensor's shape, or a shape given as such."""
    return tuple(value.shape) if hasattr(value, "shape") else tuple(value)


def to_hf(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    """(transformers config, HF state dict) for a canonical megaframe state dict (all in memory:
    for tests and small models; the CLI streams through to_hf_plan)."""
    hf_config, plan = to_hf_plan(cfg, state)
    return hf_config, {name: recipe(state).contiguous() for name, recipe in plan.items()}


def to_hf_plan(cfg: ModelConfig, shapes: Mapping[str, Any]) -> tuple[Any, dict[str, Recipe]]:
    """(transformers config, {HF name: recipe over the canonical tensors}) for a megaframe model whose
    tensors have `shapes` (tensors or shapes). Vocabulary rows beyond the real vocabulary (Megatron
    padding) are dropped."""
    vocab = _shape(shapes["embed.tok.weight"])[0]
    if cfg.vocab_size is not None:
        if cfg.vocab_size > vocab:
            raise ConvertError(f"model.vocab_size={cfg.vocab_size} but embed.tok.weight has only {vocab} rows")
        vocab = cfg.vocab_size
    vocab_rows = ("embed.tok.weight", "head.weight")
    shapes = {name: ((vocab, *_shape(v)[1:]) if name in vocab_rows else _shape(v)) for name, v in shapes.items()}
    cfg = dataclasses.replace(cfg, vocab_size=vocab)
    check_canonical(cfg, shapes, "the megaframe checkpoint")

    def get(name: str, transpose: bool = False) -> Recipe:
        def recipe(state: Mapping[str, torch.Tensor]) -> torch.Tensor:
            value = state[name][:vocab] if name in vocab_rows else state[name]
            return value.t() if transpose else value
        return recipe
    return (_llama_to_hf if flavour(cfg) == "llama" else _gpt2_to_hf)(cfg, get)


def _llama_to_hf(cfg: ModelConfig, get: Callable[..., Recipe]):
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=ffn_hidden_size(cfg),
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_attention_heads, hidden_act="silu",
        max_position_embeddings=cfg.seq_length, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.bias, mlp_bias=cfg.bias,
        attention_dropout=0.0, initializer_range=cfg.init_std, bos_token_id=None, eos_token_id=None,
        architectures=["LlamaForCausalLM"])
    return config, {theirs: get(ours) for ours, theirs in _llama_names(cfg).items()}


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


def check_canonical(cfg: ModelConfig, state: Mapping[str, Any], what: str) -> None:
    """Refuse a state dict (tensors or shapes) whose names or shapes are not those of the model `cfg` describes."""
    shapes = canonical_shapes(resolve_dims(cfg, cfg.vocab_size))
    _expect_names(state, shapes.keys(), what, cfg)
    for name, shape in shapes.items():
        if _shape(state[name]) != shape:
            raise ConvertError(f"{what}: tensor {name} has shape {list(_shape(state[name]))} but its model config "
                               f"({_short(cfg)}) needs {list(shape)}")


def _expect_names(state: Mapping, expected, what: str, cfg) -> None:
    missing, extra = sorted(set(expected) - state.keys()), sorted(state.keys() - set(expected))
    if missing or extra:
        raise ConvertError(f"{what} does not match its model config ({_short(cfg)}): missing tensors "
                           f"{missing[:3]}, unexpected tensors {extra[:3]}")


def _short(cfg: ModelConfig) -> str:
    return (f"{cfg.arch}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
            f"bias={cfg.bias}, tie_embeddings={cfg.tie_embeddings}")


def _gpt2_to_hf(cfg: ModelConfig, get: Callable[..., Recipe]):
    from transformers import GPT2Config

    h = cfg.hidden_size
    config = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.seq_length, n_embd=h, n_layer=cfg.num_layers,
        n_head=cfg.num_attention_heads, n_inner=ffn_hidden_size(cfg), activation_function="gelu_new",
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        layer_norm_epsilon=cfg.norm_eps, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=None, eos_token_id=None, architectures=["GPT2LMHeadModel"])

    def bias(name: str, size: int) -> Recipe:  # HF GPT-2 always has biases: zeros are exact
        return get(name) if cfg.bias else (lambda state: torch.zeros(size))

    def fused(names: list[str]) -> Recipe:  # q|k|v rows, then Conv1D's (in, out) layout
        return lambda state: torch.cat([state[n] for n in names]).t()

    out = {"transformer.wte.weight": get("embed.tok.weight"), "transformer.wpe.weight": get("embed.pos.weight"),
           "transformer.ln_f.weight": get("final_norm.weight"), "transformer.ln_f.bias": bias("final_norm.bias", h)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = get("head.weight")
    ffn = ffn_hidden_size(cfg)
    for i in range(cfg.num_layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        qkv = [ours + f"attn.{p}_proj" for p in "qkv"]
        biases = [bias(n + ".bias", h) for n in qkv]
        out.update({
            theirs + "ln_1.weight": get(ours + "attn_norm.weight"), theirs + "ln_1.bias": bias(ours + "attn_norm.bias", h),
            # Conv1D computes x @ W with W (in, out): our (out, in) Linear weights, transposed
            theirs + "attn.c_attn.weight": fused([n + ".weight" for n in qkv]),
            theirs + "attn.c_attn.bias": lambda state, biases=biases: torch.cat([b(state) for b in biases]),
            theirs + "attn.c_proj.weight": get(ours + "attn.out_proj.weight", transpose=True),
            theirs + "attn.c_proj.bias": bias(ours + "attn.out_proj.bias", h),
            theirs + "ln_2.weight": get(ours + "mlp_norm.weight"), theirs + "ln_2.bias": bias(ours + "mlp_norm.bias", h),
            theirs + "mlp.c_fc.weight": get(ours + "mlp.up_proj.weight", transpose=True),
            theirs + "mlp.c_fc.bias": bias(ours + "mlp.up_proj.bias", ffn),
            theirs + "mlp.c_proj.weight": get(ours + "mlp.down_proj.weight", transpose=True),
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
    """The canonical fp32 state dict of HF weights for the model `cfg` (from config_from_hf), all in
    memory (tests, small models; the CLI streams through state_from_hf_plan)."""
    plan, _ = state_from_hf_plan(cfg, hf_state)
    check_tied_copy(cfg, hf_state)
    return {name: recipe(hf_state) for name, recipe in plan.items()}


def state_from_hf_plan(cfg: ModelConfig, hf_shapes: Mapping[str, Any]) -> tuple[dict[str, Recipe],
                                                                                 dict[str, tuple[int, ...]]]:
    """({canonical name: recipe over the HF tensors (fp32 out)}, {canonical name: shape}) for HF
    weights with `hf_shapes` (tensors or shapes); refuses names or shapes that do not fit `cfg`."""
    hf_shapes = {name: _shape(v) for name, v in hf_shapes.items() if not name.endswith(_IGNORED_HF_SUFFIXES)}
    if flavour(cfg) == "llama":
        source = _with_prefix(hf_shapes, "model.")
        plan = _take(source, {theirs: ours for ours, theirs in _llama_names(cfg).items()}, cfg)
    else:
        plan = _gpt2_from_hf(cfg, _with_prefix(hf_shapes, "transformer."))
    shapes = plan_shapes(plan, hf_shapes)
    check_canonical(cfg, shapes, "the HF weights")
    return plan, shapes


def plan_shapes(plan: dict[str, Recipe], source_shapes: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a plan makes, from the source's shapes alone (meta tensors: no data)."""
    meta = {name: torch.empty(_shape(v), device="meta") for name, v in source_shapes.items()}
    return {name: tuple(recipe(meta).shape) for name, recipe in plan.items()}


def check_tied_copy(cfg: ModelConfig, hf_state: Mapping[str, torch.Tensor]) -> None:
    """A tied model may store the token embedding again as lm_head.weight: it must be the same
    (reads the two tensors)."""
    embed = next((n for n in ("model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight",
                              "wte.weight") if n in hf_state), None)
    if cfg.tie_embeddings and embed and "lm_head.weight" in hf_state \
            and not torch.equal(hf_state["lm_head.weight"], hf_state[embed]):
        raise _refuse("tie_word_embeddings", True, "but lm_head.weight differs from the token embedding")


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


def _with_prefix(hf_shapes: dict[str, tuple], prefix: str) -> dict[str, str]:
    """{name as the CausalLM calls it: name in the files}. Weights saved from the bare model
    (GPT2Model, LlamaModel: the original GPT-2 files) lack the CausalLM prefix; one name table
    then serves both."""
    if any(name.startswith(prefix) for name in hf_shapes):
        return {name: name for name in hf_shapes}
    return {(name if name == "lm_head.weight" else prefix + name): name for name in hf_shapes}


def _take(source: dict[str, str], names: dict[str, str], cfg: ModelConfig) -> dict[str, Recipe]:
    """{megaframe name: recipe} through names {HF name: megaframe name}; source maps HF names to the
    names in the files. A tied model's lm_head.weight copy is not taken (check_tied_copy)."""
    source = {k: v for k, v in source.items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    _expect_names(source, names.keys(), "the HF weights", cfg)
    return {names[hf]: (lambda state, stored=stored: state[stored].to(torch.float32)) for hf, stored in source.items()}


def _gpt2_from_hf(cfg: ModelConfig, source: dict[str, str]) -> dict[str, Recipe]:
    # the inverse of _gpt2_to_hf: split the fused q|k|v Conv1D, transpose Conv1D weights back
    h = cfg.hidden_size
    hf_names = {f"transformer.{n}" for n in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")}
    if not cfg.tie_embeddings:
        hf_names.add("lm_head.weight")
    per_block = ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                 "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                 "mlp.c_proj.weight", "mlp.c_proj.bias"]
    hf_names |= {f"transformer.h.{i}.{n}" for i in range(cfg.num_layers) for n in per_block}
    s = _take(source, {name: name for name in hf_names}, cfg)

    def t(name: str) -> Recipe:
        return lambda state: s[name](state).t().contiguous()

    def part(name: str, index: int, transpose: bool) -> Recipe:  # (3C, C) -> q|k|v rows
        return lambda state: (s[name](state).t() if transpose else s[name](state)).split(h)[index].contiguous()

    state = {"embed.tok.weight": s["transformer.wte.weight"], "embed.pos.weight": s["transformer.wpe.weight"],
             "final_norm.weight": s["transformer.ln_f.weight"], "final_norm.bias": s["transformer.ln_f.bias"]}
    if not cfg.tie_embeddings:
        state["head.weight"] = s["lm_head.weight"]
    for i in range(cfg.num_layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for index, p in enumerate("qkv"):
            state[ours + f"attn.{p}_proj.weight"] = part(theirs + "attn.c_attn.weight", index, transpose=True)
            state[ours + f"attn.{p}_proj.bias"] = part(theirs + "attn.c_attn.bias", index, transpose=False)
        state.update({
            ours + "attn_norm.weight": s[theirs + "ln_1.weight"], ours + "attn_norm.bias": s[theirs + "ln_1.bias"],
            ours + "attn.out_proj.weight": t(theirs + "attn.c_proj.weight"),
            ours + "attn.out_proj.bias": s[theirs + "attn.c_proj.bias"],
            ours + "mlp_norm.weight": s[theirs + "ln_2.weight"], ours + "mlp_norm.bias": s[theirs + "ln_2.bias"],
            ours + "mlp.up_proj.weight": t(theirs + "mlp.c_fc.weight"), ours + "mlp.up_proj.bias": s[theirs + "mlp.c_fc.bias"],
            ours + "mlp.down_proj.weight": t(theirs + "mlp.c_proj.weight"),
            ours + "mlp.down_proj.bias": s[theirs + "mlp.c_proj.bias"],
        })
    return state

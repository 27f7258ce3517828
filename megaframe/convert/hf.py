"""Pure mappings between megaframe's canonical state dict and Hugging Face `transformers` models.

Both directions work on full, unpadded fp32 tensors keyed by canonical names (model/full_state.py):
  Llama flavour (rmsnorm + swiglu + rope)      <-> LlamaForCausalLM   (a rename: same layouts)
  Llama flavour + model.sliding_window, no bias <-> MistralForCausalLM (the same names)
  GPT-2 flavour (layernorm + gelu + learned)   <-> GPT2LMHeadModel    (fused, transposed Conv1D)
  Llama flavour + model.moe, every block routed <-> MixtralForCausalLM
  Llama flavour + model.moe + model.qk_norm    <-> Qwen3MoeForCausalLM (dense blocks allowed)
All are pre-norm with the same residual order, RoPE in the rotate-half convention and attention
scaled by 1/sqrt(head_dim); the parity tests compare logits through `transformers`. The routers
agree too: fp32 softmax over all experts, top k, the k weights renormalised (Mixtral always, Qwen3
by norm_topk_prob). Our experts are stacked (E, out, in) tensors; HF files hold one tensor per
expert (what save_pretrained writes: Mixtral's block_sparse_moe.experts.{j}.w1/w2/w3, Qwen3's
mlp.experts.{j}.gate_proj/up_proj/down_proj) or, as transformers v5 holds them in memory, fused
mlp.experts.gate_up_proj (E, 2*ffn, hidden: gate rows, then up) and mlp.experts.down_proj; import
reads any of these, export writes the per-expert files, one expert at a time.
An HF config feature megaframe's blocks lack is refused with the config key that carries it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import torch

from megaframe.config.schema import ModelConfig, MoEConfig
from megaframe.config.validate import ffn_hidden_size
from megaframe.model.dims import resolve_dims, resolve_moe
from megaframe.model.full_state import canonical_shapes

# transformers' names for the tanh approximation of GELU that megaframe's GPT-2 MLP uses
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# buffers some transformers versions saved with the weights; they hold no learned values
_IGNORED_HF_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")

# Llama: (megaframe name inside blocks.{i}., HF name inside model.layers.{i}.)
_LLAMA_BLOCK = [("attn_norm.weight", "input_layernorm.weight"), ("mlp_norm.weight", "post_attention_layernorm.weight")]
_LLAMA_ATTN = [("attn.q_proj", "self_attn.q_proj"), ("attn.k_proj", "self_attn.k_proj"),
               ("attn.v_proj", "self_attn.v_proj"), ("attn.out_proj", "self_attn.o_proj")]
_LLAMA_MLP = [("mlp.gate_proj", "mlp.gate_proj"), ("mlp.up_proj", "mlp.up_proj"), ("mlp.down_proj", "mlp.down_proj")]
_QK_NORM = [("attn.q_norm.weight", "self_attn.q_norm.weight"), ("attn.k_norm.weight", "self_attn.k_norm.weight")]
# routed blocks: (our stacked tensor in blocks.{i}.mlp.experts., HF name in experts.{j}.) per HF naming; the
# export writes each model's own (Mixtral's files name the MoE module block_sparse_moe, transformers v5 mlp)
_EXPERT_NAMES = {"mixtral": [("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")],
                 "qwen3_moe": [("gate_proj", "gate_proj"), ("up_proj", "up_proj"), ("down_proj", "down_proj")]}
_MOE_MODULE = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp"}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "gpt2": "GPT2LMHeadModel",
                  "mixtral": "MixtralForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM"}


class ConvertError(ValueError):
    """A model or checkpoint the converter cannot translate; str(err) is a single line."""


def flavour(cfg: ModelConfig) -> str:
    """'llama' or 'gpt2' by the blocks the config builds (model.arch is only a label)."""
    blocks = (cfg.norm, cfg.activation, cfg.position_embedding)
    if blocks == ("rmsnorm", "swiglu", "rope"):
        return "llama"
    if blocks in (("layernorm", "gelu", "learned"), ("layernorm", "gelu_exact", "learned")):
        return "gpt2"
    raise ConvertError(
        f"model.norm={cfg.norm} model.activation={cfg.activation} model.position_embedding={cfg.position_embedding} "
        "has no transformers equivalent; HF export supports the Llama flavour (rmsnorm, swiglu, rope) "
        "and the GPT-2 flavour (layernorm, gelu or gelu_exact, learned)")


def _routed(cfg: ModelConfig) -> list[bool]:
    """Whether each block has routed experts (model.moe), in block order."""
    moe = resolve_moe(cfg)
    return [moe is not None and moe.is_moe_block(i) for i in range(cfg.num_layers)]


def hf_architecture(cfg: ModelConfig) -> str:
    """The transformers model a megaframe config exports to: 'llama', 'gpt2', 'mixtral' or
    'qwen3_moe'; refuses (one line naming our key) what none of them computes."""
    kind, moe = flavour(cfg), cfg.moe
    default_head = cfg.hidden_size // cfg.num_attention_heads
    if cfg.sliding_window is not None:
        return _windowed_architecture(cfg, kind)
    if not moe.num_experts:
        if cfg.qk_norm:
            raise ConvertError("model.qk_norm=true has no LlamaForCausalLM / GPT2LMHeadModel equivalent; HF export "
                               "takes QK-norm in MoE models only (Qwen3MoeForCausalLM)")
        if kind == "gpt2" and cfg.head_dim not in (None, default_head):
            raise ConvertError(f"model.head_dim={cfg.head_dim} has no GPT2LMHeadModel equivalent (its head size is "
                               f"n_embd / n_head = {default_head})")
        return kind
    if kind != "llama":
        raise ConvertError(f"model.moe.num_experts={moe.num_experts} with the GPT-2 flavour (GELU experts) has no "
                           "transformers equivalent; MoE export takes the Llama flavour (MixtralForCausalLM, "
                           "Qwen3MoeForCausalLM)")
    for key, value, ok in (("router_score", moe.router_score, moe.router_score == "softmax"),
                           ("shared_experts", moe.shared_experts, not moe.shared_experts),
                           ("bias_update_rate", moe.bias_update_rate, not moe.bias_update_rate)):
        if not ok:
            raise ConvertError(f"model.moe.{key}={value} has no transformers equivalent: MixtralForCausalLM and "
                               "Qwen3MoeForCausalLM route by a softmax over the experts alone, without shared experts "
                               "or routing biases")
    all_routed = all(_routed(cfg))
    if cfg.qk_norm:
        if cfg.bias and not all_routed:
            raise ConvertError(f"model.bias=true with dense blocks (model.moe.first_dense_layers={moe.first_dense_layers}, "
                               f"model.moe.layer_freq={moe.layer_freq}) has no Qwen3MoeForCausalLM equivalent: "
                               "its dense MLPs have no biases")
        return "qwen3_moe"
    if not all_routed:
        raise ConvertError(f"model.moe.first_dense_layers={moe.first_dense_layers} model.moe.layer_freq={moe.layer_freq} "
                           "leave dense blocks, which MixtralForCausalLM lacks (it routes every block); "
                           "Qwen3MoeForCausalLM takes dense blocks but needs model.qk_norm=true")
    if not moe.norm_topk_prob:
        raise ConvertError("model.moe.norm_topk_prob=false: MixtralForCausalLM always renormalises the top-k weights; "
                           "Qwen3MoeForCausalLM does not, but needs model.qk_norm=true")
    if cfg.bias:
        raise ConvertError("model.bias=true: MixtralForCausalLM has no biases")
    return "mixtral"


def _windowed_architecture(cfg: ModelConfig, kind: str) -> str:
    """'mistral' for a dense windowed Llama-flavour model; refuses the windows it cannot export."""
    if cfg.window_attn_skip_freq is not None:
        raise ConvertError(f"model.window_attn_skip_freq={cfg.window_attn_skip_freq}: MistralForCausalLM windows "
                           "every layer; HF export takes model.sliding_window alone")
    if kind != "llama" or cfg.qk_norm or cfg.moe.num_experts:
        raise ConvertError(f"model.sliding_window={cfg.sliding_window} exports as MistralForCausalLM only: the dense "
                           "Llama flavour without model.qk_norm or model.moe")
    if cfg.bias:
        raise ConvertError("model.bias=true with model.sliding_window: MistralForCausalLM has no biases")
    return "mistral"


def read_part(state: Mapping[str, torch.Tensor], name: str, index: tuple) -> torch.Tensor:
    """state[name][index], reading only that part where the source can (files.LazyTensors.part):
    one expert of a stacked tensor is a few MB where the whole is gigabytes."""
    part = getattr(state, "part", None)
    return part(name, index) if part is not None else state[name][index]


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
    arch = hf_architecture(cfg)
    if arch == "gpt2":
        return _gpt2_to_hf(cfg, get)
    dense = arch in ("llama", "mistral")
    config = (_llama_hf_config if dense else _moe_hf_config)(cfg, arch)
    plan = {theirs: get(ours) for ours, theirs in _llama_names(cfg).items()}
    if not dense:
        plan.update(_experts_to_hf(cfg, arch, get))
    return config, plan


def _head_dim(cfg: ModelConfig) -> Optional[int]:
    """model.head_dim as transformers configs take it (None: hidden_size / heads)."""
    return cfg.head_dim if cfg.head_dim not in (None, cfg.hidden_size // cfg.num_attention_heads) else None


def _llama_hf_config(cfg: ModelConfig, arch: str = "llama"):
    """LlamaConfig, or MistralConfig (arch 'mistral': Llama with a sliding window, no biases)."""
    from transformers import LlamaConfig

    if arch == "mistral":
        from transformers import MistralConfig

        return MistralConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=ffn_hidden_size(cfg),
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_kv_heads or cfg.num_attention_heads, head_dim=_head_dim(cfg),
            hidden_act="silu", max_position_embeddings=cfg.seq_length, rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, sliding_window=cfg.sliding_window,
            attention_dropout=0.0, initializer_range=cfg.init_std, bos_token_id=None, eos_token_id=None,
            architectures=["MistralForCausalLM"])
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=ffn_hidden_size(cfg),
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_attention_heads, head_dim=_head_dim(cfg), hidden_act="silu",
        max_position_embeddings=cfg.seq_length, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.bias, mlp_bias=cfg.bias,
        attention_dropout=0.0, initializer_range=cfg.init_std, bos_token_id=None, eos_token_id=None,
        architectures=["LlamaForCausalLM"])


def _moe_hf_config(cfg: ModelConfig, arch: str):
    """MixtralConfig or Qwen3MoeConfig. The aux-loss coefficient is carried over as it is (HF pools one
    load-balancing term over the layers, megaframe sums one per layer: a training setting, not the
    model's function); the z-loss and capacity have no HF counterpart and are left behind."""
    moe, routed = cfg.moe, _routed(cfg)
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_kv_heads or cfg.num_attention_heads,
        head_dim=_head_dim(cfg), hidden_act="silu", max_position_embeddings=cfg.seq_length,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
        attention_dropout=0.0, initializer_range=cfg.init_std, num_experts_per_tok=moe.top_k,
        router_aux_loss_coef=moe.aux_loss_coeff, bos_token_id=None, eos_token_id=None,
        architectures=[_ARCHITECTURES[arch]])
    expert_width = resolve_moe(cfg).ffn_hidden_size
    if arch == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(intermediate_size=expert_width, num_local_experts=moe.num_experts,
                             sliding_window=None, router_jitter_noise=0.0, **common)
    from transformers import Qwen3MoeConfig

    if common["head_dim"] is None:  # Qwen3's config has no null head_dim: spell it out
        common["head_dim"] = cfg.hidden_size // cfg.num_attention_heads
    return Qwen3MoeConfig(intermediate_size=ffn_hidden_size(cfg), moe_intermediate_size=expert_width,
                          num_experts=moe.num_experts, norm_topk_prob=moe.norm_topk_prob, attention_bias=cfg.bias,
                          use_sliding_window=False, decoder_sparse_step=1,
                          mlp_only_layers=[i for i, r in enumerate(routed) if not r], **common)


def _experts_to_hf(cfg: ModelConfig, arch: str, get: Callable[..., Recipe]) -> dict[str, Recipe]:
    """Each routed block's router and experts under the names save_pretrained writes: one HF tensor
    per expert, each read alone out of our stacked (E, out, in) tensor."""
    out = {}
    for i, routed in enumerate(_routed(cfg)):
        if not routed:
            continue
        ours, theirs = f"blocks.{i}.mlp.", f"model.layers.{i}.{_MOE_MODULE[arch]}."
        out[theirs + "gate.weight"] = get(ours + "router.weight")
        for j in range(cfg.moe.num_experts):
            for stacked, name in _EXPERT_NAMES[arch]:
                out[f"{theirs}experts.{j}.{name}.weight"] = \
                    lambda state, n=f"{ours}experts.{stacked}", j=j: read_part(state, n, (j,))
    return out


def _llama_names(cfg: ModelConfig) -> dict[str, str]:
    """{megaframe name: HF name} for every Llama-layout tensor (the layouts agree, only names
    differ): all of a Llama, all of a Mixtral / Qwen3-MoE but the routed blocks' router and experts."""
    names = {"embed.tok.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["head.weight"] = "lm_head.weight"
    leaves = ("weight", "bias") if cfg.bias else ("weight",)
    for i, routed in enumerate(_routed(cfg)):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        names.update({ours + a: theirs + b for a, b in _LLAMA_BLOCK + (_QK_NORM if cfg.qk_norm else [])})
        linear = _LLAMA_ATTN + ([] if routed else _LLAMA_MLP)
        names.update({f"{ours}{a}.{leaf}": f"{theirs}{b}.{leaf}" for a, b in linear for leaf in leaves})
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
        n_head=cfg.num_attention_heads, n_inner=ffn_hidden_size(cfg), activation_function="gelu_new" if cfg.activation == "gelu" else "gelu",
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
    readers = {"llama": _llama_config, "mistral": _mistral_config, "gpt2": _gpt2_config, "mixtral": _mixtral_config,
               "qwen3_moe": _qwen3_moe_config}
    if model_type not in readers:
        raise ConvertError(f"config.json model_type={model_type!r} is not supported; from-hf reads "
                           f"{', '.join(repr(t) for t in readers)} models")
    return readers[model_type](hf_config)


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
        plan = _llama_from_hf(cfg, _with_prefix(hf_shapes, "model."), hf_shapes)
    else:
        plan = _gpt2_from_hf(cfg, _with_prefix(hf_shapes, "transformer."), hf_shapes)
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


# what every Llama-layout model here shares: SwiGLU, plain RoPE, no attention dropout
_ROPE_RULES = [
    ("hidden_act", lambda v: v in (None, "silu"), "megaframe's Llama MLP is SwiGLU (silu)"),
    ("rope_scaling", lambda v: not v or v.get("rope_type", v.get("type")) == "default", "RoPE scaling is not implemented"),
    ("attention_dropout", lambda v: not v, "megaframe has no attention-only dropout"),
]


def _rope_model(hf: dict, default_theta: float, default_eps: float, default_positions: int, **fields) -> ModelConfig:
    """The ModelConfig of a Llama-layout HF config (Llama, Mixtral, Qwen3-MoE); `fields` add to it
    (ffn_hidden_size among them). Absent keys take the transformers class's defaults."""
    rope_type = (hf.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        raise _refuse("rope_parameters.rope_type", rope_type, "RoPE scaling is not implemented")
    theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", default_theta)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    values = dict(
        arch="llama", num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, vocab_size=hf["vocab_size"], seq_length=hf.get("max_position_embeddings", default_positions), norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", default_eps)), activation="swiglu", position_embedding="rope",
        rope_theta=float(theta), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bias=bool(hf.get("attention_bias", False)), dropout=0.0, init_std=float(hf.get("initializer_range", 0.02)),
        head_dim=None if head_dim in (None, hf["hidden_size"] // heads) else int(head_dim))
    return ModelConfig(**{**values, **fields})


def _llama_config(hf: dict) -> ModelConfig:
    _check(hf, _ROPE_RULES + [
        ("mlp_bias", lambda v: bool(v) == bool(hf.get("attention_bias")),
         "megaframe has one model.bias for attention and MLP (attention_bias differs)"),
    ])
    return _rope_model(hf, default_theta=10000.0, default_eps=1e-6, default_positions=2048,
                       ffn_hidden_size=hf["intermediate_size"])


def _mistral_config(hf: dict) -> ModelConfig:
    """Mistral: Llama without biases, with a sliding window over every layer (null: none)."""
    _check(hf, _ROPE_RULES)
    return _rope_model(hf, default_theta=10000.0, default_eps=1e-6, default_positions=4096 * 32,
                       ffn_hidden_size=hf["intermediate_size"], bias=False, sliding_window=_window(hf))


def _window(hf: dict) -> Optional[int]:
    """config.json's sliding_window as model.sliding_window (null: full attention)."""
    window = hf.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise _refuse("sliding_window", window, "must be a whole number >= 1 or null")
    return window


def _num_experts(hf: dict, key: str) -> int:
    experts = hf.get(key)
    if not isinstance(experts, int) or experts < 1:
        raise _refuse(key, experts, "a Mixture-of-Experts model needs at least one expert")
    return experts


def _mixtral_config(hf: dict) -> ModelConfig:
    """Mixtral: every block routed, softmax router, top-k weights renormalised, no shared experts, no biases."""
    _check(hf, _ROPE_RULES + [
        ("sliding_window", lambda v: v is None, "megaframe imports sliding windows of Mistral models only"),
        ("router_jitter_noise", lambda v: not v, "megaframe's router has no jitter noise"),
    ])
    experts = _num_experts(hf, "num_local_experts" if "num_local_experts" in hf else "num_experts")
    width = hf["intermediate_size"]
    moe = MoEConfig(num_experts=experts, top_k=hf.get("num_experts_per_tok", 2), ffn_hidden_size=width, layer_freq=1,
                    first_dense_layers=0, shared_experts=0, capacity_factor=None,
                    aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)), z_loss_coeff=0.0,
                    router_score="softmax", norm_topk_prob=True, bias_update_rate=0.0)
    # one width in a Mixtral: the experts' (model.ffn_hidden_size serves no block, every block routes)
    return _rope_model(hf, default_theta=1e6, default_eps=1e-5, default_positions=4096 * 32, ffn_hidden_size=width,
                       bias=False, moe=moe)


def _qwen3_moe_config(hf: dict) -> ModelConfig:
    """Qwen3-MoE: QK-norm, softmax router (top-k renormalised by norm_topk_prob), the blocks that
    decoder_sparse_step and mlp_only_layers route, which must be first_dense_layers then every
    layer_freq-th (what model.moe can say)."""
    _check(hf, _ROPE_RULES + [
        ("use_sliding_window", lambda v: not v, "megaframe imports sliding windows of Mistral models only"),
    ])
    experts = _num_experts(hf, "num_experts" if "num_experts" in hf else "num_local_experts")
    layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise _refuse("decoder_sparse_step", step, "must be a positive integer")
    routed = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    key, value = ("mlp_only_layers", dense) if dense else ("decoder_sparse_step", step)
    if not routed:
        raise _refuse(key, value, "no block is routed (a dense model: import it as one)")
    first = routed[0]
    freq = routed[1] - first if len(routed) > 1 else layers - first
    if routed != list(range(first, layers, freq)):
        raise _refuse(key, value, f"routes blocks {routed}; megaframe routes every model.moe.layer_freq-th block "
                      "after model.moe.first_dense_layers dense ones")
    if hf.get("attention_bias") and len(routed) < layers:
        raise _refuse("attention_bias", True, "megaframe's model.bias would give the dense blocks' MLPs biases too")
    moe = MoEConfig(num_experts=experts, top_k=hf.get("num_experts_per_tok", 8),
                    ffn_hidden_size=hf.get("moe_intermediate_size", 768), layer_freq=freq, first_dense_layers=first,
                    shared_experts=0, capacity_factor=None, aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)),
                    z_loss_coeff=0.0, router_score="softmax", norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    bias_update_rate=0.0)
    return _rope_model(hf, default_theta=10000.0, default_eps=1e-6, default_positions=32768, qk_norm=True, moe=moe,
                       ffn_hidden_size=hf.get("intermediate_size", 6144))


def _gpt2_config(hf: dict) -> ModelConfig:
    drop = hf.get("resid_pdrop", 0.1)
    _check(hf, [
        ("activation_function", lambda v: v in (None, "gelu", *_TANH_GELU),
         "megaframe's GPT-2 MLP has tanh-approximated GELU (gelu_new: model.activation=gelu) or the erf form (gelu: model.activation=gelu_exact)"),
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
        activation="gelu_exact" if hf.get("activation_function") == "gelu" else "gelu",
        position_embedding="learned", tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
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


def _llama_from_hf(cfg: ModelConfig, source: dict[str, str], hf_shapes: dict[str, tuple]) -> dict[str, Recipe]:
    """Llama, Mixtral, Qwen3-MoE: renames, plus each routed block's experts stacked (E, out, in)
    from one tensor per expert or sliced out of transformers v5's fused gate_up_proj."""
    # transformers reads Mixtral's block_sparse_moe.* as mlp.* (conversion_mapping.py): one name table
    source = {name.replace(".block_sparse_moe.", ".mlp."): stored for name, stored in source.items()}
    names = {theirs: ours for ours, theirs in _llama_names(cfg).items()}
    experts = {i: _expert_sources(cfg, i, source) for i, routed in enumerate(_routed(cfg)) if routed}
    s = _take(source, {**{n: n for n in names}, **{n: n for table in experts.values() for n in table}}, cfg)
    state = {ours: s[theirs] for theirs, ours in names.items()}
    for i, table in experts.items():
        state.update(_experts_from_hf(cfg, i, table, source, hf_shapes, s))
    return state


def _expert_sources(cfg: ModelConfig, i: int, source: dict[str, str]) -> list[str]:
    """The HF names block i's router and experts come from, in whichever of the layouts transformers
    reads the files hold: fused gate_up_proj / down_proj, or per expert w1/w3/w2 (Mixtral) or
    gate_proj/up_proj/down_proj (Qwen3)."""
    p = f"model.layers.{i}.mlp."
    if p + "experts.gate_up_proj" in source:
        return [p + "gate.weight", p + "experts.gate_up_proj", p + "experts.down_proj"]
    style = "qwen3_moe" if p + "experts.0.gate_proj.weight" in source else "mixtral"
    return [p + "gate.weight"] + [f"{p}experts.{j}.{name}.weight" for j in range(cfg.moe.num_experts)
                                  for _, name in _EXPERT_NAMES[style]]


def _experts_from_hf(cfg: ModelConfig, i: int, table: list[str], source: dict[str, str], hf_shapes: dict[str, tuple],
                     s: dict[str, Recipe]) -> dict[str, Recipe]:
    moe = resolve_moe(cfg)
    e, f, h = moe.num_experts, moe.ffn_hidden_size, cfg.hidden_size
    ours = f"blocks.{i}.mlp."
    router, *rest = table

    def expect(name: str, shape: tuple[int, ...]) -> None:
        if hf_shapes[source[name]] != shape:
            raise ConvertError(f"the HF weights: tensor {source[name]} has shape {list(hf_shapes[source[name]])} but "
                               f"config.json ({e} experts of width {f}, hidden {h}) needs {list(shape)}")
    expect(router, (e, h))
    out = {ours + "router.weight": s[router]}
    if rest[0].endswith("gate_up_proj"):  # (E, 2f, h): gate rows, then up rows (transformers' Concatenate(dim=1))
        fused, down = rest
        expect(fused, (e, 2 * f, h))
        expect(down, (e, h, f))
        for index, name in enumerate(("gate_proj", "up_proj")):
            out[f"{ours}experts.{name}"] = lambda state, n=source[fused], rows=slice(index * f, (index + 1) * f): \
                read_part(state, n, (slice(None), rows)).to(torch.float32)
        out[ours + "experts.down_proj"] = s[down]
        return out
    for k, stacked in enumerate(("gate_proj", "up_proj", "down_proj")):  # the order of _EXPERT_NAMES
        per_expert = rest[k::3]
        for name in per_expert:
            expect(name, (h, f) if stacked == "down_proj" else (f, h))
        out[f"{ours}experts.{stacked}"] = lambda state, names=per_expert: _stack([s[n] for n in names], state)
    return out


def _stack(recipes: list[Recipe], state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """torch.stack of the recipes' tensors, made one at a time into the output (not all held, then copied)."""
    first = recipes[0](state)
    out = first.new_empty((len(recipes), *first.shape))
    out[0] = first
    for j, recipe in enumerate(recipes[1:], start=1):
        out[j] = recipe(state)
    return out


def _gpt2_from_hf(cfg: ModelConfig, source: dict[str, str], hf_shapes: dict[str, tuple]) -> dict[str, Recipe]:
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
    f = ffn_hidden_size(cfg)
    # split and transposed, a fused q|k|v of another width lost its extra columns or failed to split
    for i in range(cfg.num_layers):
        for name, shape in (("attn.c_attn.weight", (h, 3 * h)), ("attn.c_attn.bias", (3 * h,)),
                            ("attn.c_proj.weight", (h, h)), ("mlp.c_fc.weight", (h, f)), ("mlp.c_proj.weight", (f, h))):
            stored = source[f"transformer.h.{i}.{name}"]
            if tuple(hf_shapes[stored]) != shape:
                raise ConvertError(f"the HF weights: tensor {stored} has shape {list(hf_shapes[stored])} but "
                                   f"config.json (hidden {h}, MLP width {f}) needs {list(shape)}")

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

"""GPTDims: the resolved model shape. Free of torch, so that the CLI, the validator and the planner
can reason about shapes without paying torch's import time in the launching process."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

from megaframe.config.schema import DataConfig, ModelConfig, MoEConfig
from megaframe.config.validate import check_finite, check_model, ffn_hidden_size, padded_vocab_size


@dataclass(frozen=True)
class MoEDims:
    """Resolved Mixture-of-Experts shape (model.moe): which blocks route, how wide an expert is."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int  # one expert's MLP width
    layer_freq: int
    first_dense_layers: int
    shared_experts: int
    capacity_factor: Optional[float]  # None = dropless
    aux_loss_coeff: float
    z_loss_coeff: float
    router_score: str  # softmax | sigmoid
    norm_topk_prob: bool
    bias_update_rate: float

    def is_moe_block(self, index: int) -> bool:
        """Block `index` (0-based) has routed experts in place of its dense MLP."""
        return index >= self.first_dense_layers and (index - self.first_dense_layers) % self.layer_freq == 0

    def moe_blocks_in(self, start: int, stop: int) -> int:
        """How many of blocks [start, stop) route, in O(1): is_moe_block's every layer_freq-th block from
        first_dense_layers on, counted without a loop over the blocks."""
        start = max(start, self.first_dense_layers)
        if stop <= start:
            return 0
        def routed_below(index: int) -> int:  # MoE blocks among [first_dense_layers, index)
            return -(-(index - self.first_dense_layers) // self.layer_freq)
        return routed_below(stop) - routed_below(start)


@dataclass(frozen=True)
class GPTDims:
    """Resolved model shape: everything the modules need, with derived values filled in."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int  # the tokenizer's vocabulary: logits beyond it are dropped
    padded_vocab_size: int  # rows in the embedding / LM head (Megatron padding)
    seq_length: int
    norm: str
    norm_eps: float
    activation: str
    position_embedding: str
    rope_theta: float
    tie_embeddings: bool
    bias: bool
    dropout: float
    init_std: float
    head_dim: int = 0  # 0 = hidden_size / num_heads (dims built by hand in tests leave it out)
    qk_norm: bool = False
    moe: Optional[MoEDims] = None  # None: every block dense
    sliding_window: Optional[int] = None  # model.sliding_window: keys a query sees, itself included
    window_pattern: tuple[int, ...] = ()  # 1 windowed, 0 global, repeated over the blocks; () all windowed
    # data.document_mask / data.eod_mask_loss, with the dataset's end-of-document id they act on
    eod_id: Optional[int] = None
    document_mask: bool = False
    eod_mask_loss: bool = False
    attention_core: str = "sdpa"  # model.attention_core resolved (attention_core_of): sdpa | flex

    @property
    def unlearned_after(self) -> Optional[int]:
        """The token whose next target the loss leaves out (data.eod_mask_loss: the end-of-document id;
        data/dataset.py windows_batch marks those targets), or None."""
        return self.eod_id if self.eod_mask_loss else None

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    def is_moe_block(self, index: int) -> bool:
        return self.moe is not None and self.moe.is_moe_block(index)

    def moe_blocks_in(self, start: int, stop: int) -> int:
        """MoE blocks among blocks [start, stop)."""
        return self.moe.moe_blocks_in(start, stop) if self.moe is not None else 0

    @property
    def num_moe_blocks(self) -> int:
        return self.moe_blocks_in(0, self.num_layers)

    def window_of(self, index: int) -> Optional[int]:
        """Block `index`'s sliding window, None where it attends globally."""
        pattern = self.window_pattern
        if self.sliding_window is None or (pattern and not pattern[index % len(pattern)]):
            return None
        return self.sliding_window

    def windowed_blocks_in(self, start: int, stop: int) -> int:
        """How many of blocks [start, stop) attend through a window shorter than the sequence (a
        window W >= seq_length restricts nothing), in O(len(window_pattern)): whole periods of the
        pattern, then the remainders, never a loop over the blocks (the planner's and MFU's count)."""
        if self.sliding_window is None or self.sliding_window >= self.seq_length or stop <= start:
            return 0
        pattern = self.window_pattern or (1,)

        def below(index: int) -> int:  # windowed blocks among [0, index)
            periods, rest = divmod(index, len(pattern))
            return periods * sum(pattern) + sum(pattern[:rest])
        return below(stop) - below(start)


def window_pattern(skip_freq: Any) -> tuple[int, ...]:
    """model.window_attn_skip_freq as GPTDims.window_pattern: N -> N-1 windowed blocks then a global
    one (Megatron's reading); a list of 1/0 as given; null -> () (every block windowed)."""
    if skip_freq is None:
        return ()
    if isinstance(skip_freq, int):
        return (1,) * (skip_freq - 1) + (0,)
    return tuple(int(x) for x in skip_freq)


def document_dims(dims: GPTDims, data: DataConfig, eod_id: Optional[int]) -> GPTDims:
    """dims with data.document_mask and data.eod_mask_loss, acting on the dataset's eod_id."""
    if not (data.document_mask or data.eod_mask_loss):
        return dims
    return dataclasses.replace(dims, eod_id=eod_id, document_mask=data.document_mask,
                               eod_mask_loss=data.eod_mask_loss)


def resolve_dims(cfg: ModelConfig, tokenizer_vocab_size: int, tp: int = 1, device_type: str = "cuda",
                 core_device: Optional[str] = None) -> GPTDims:
    """Fill derived values: kv heads, MLP width, real and padded vocabulary (the padding depends on
    tp and, with model.make_vocab_size_divisible_by=null, on device_type: where the model trains).
    core_device: the device the model attends on, which resolves model.attention_core=auto (the
    trainer's; None, as for the planner, the converters and tests, resolves auto to sdpa)."""
    vocab = cfg.vocab_size if cfg.vocab_size is not None else tokenizer_vocab_size
    return GPTDims(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_kv_heads or cfg.num_attention_heads,
        ffn_hidden_size=ffn_hidden_size(cfg),
        vocab_size=vocab,
        padded_vocab_size=padded_vocab_size(vocab, cfg.make_vocab_size_divisible_by, tp, device_type),
        seq_length=cfg.seq_length,
        norm=cfg.norm,
        norm_eps=cfg.norm_eps,
        activation=cfg.activation,
        position_embedding=cfg.position_embedding,
        rope_theta=cfg.rope_theta,
        tie_embeddings=cfg.tie_embeddings,
        bias=cfg.bias,
        dropout=cfg.dropout,
        init_std=cfg.init_std,
        head_dim=cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads,
        qk_norm=cfg.qk_norm,
        moe=resolve_moe(cfg),
        sliding_window=cfg.sliding_window,
        window_pattern=window_pattern(cfg.window_attn_skip_freq),
        attention_core=attention_core_of(cfg, core_device),
    )


def attention_core_of(cfg: ModelConfig, device_type: Optional[str]) -> str:
    """model.attention_core resolved: auto is sdpa on every device for now. FlexCore is meant to be
    auto's choice for masked runs on CUDA without attention dropout, but no GPU has run it yet
    (tests/gpu/test_flex_attention.py), and on the CUDA-shaped CPU device its block mask fails to
    build (create_block_mask mixes the device with meta tensors there): flex is opt-in until a GPU
    session runs that test. device_type: the device the model trains on (the rule's input then)."""
    if cfg.attention_core != "auto":
        return cfg.attention_core
    del device_type  # see above: the rule will read it once flex is verified on a GPU
    return "sdpa"


def resolve_moe(cfg: ModelConfig) -> Optional[MoEDims]:
    """MoEDims for model.moe, None for a dense model (num_experts 0)."""
    m = cfg.moe
    if not m.num_experts:
        return None
    return MoEDims(num_experts=m.num_experts, top_k=m.top_k,
                   ffn_hidden_size=m.ffn_hidden_size or ffn_hidden_size(cfg), layer_freq=m.layer_freq,
                   first_dense_layers=m.first_dense_layers, shared_experts=m.shared_experts,
                   capacity_factor=m.capacity_factor, aux_loss_coeff=m.aux_loss_coeff, z_loss_coeff=m.z_loss_coeff,
                   router_score=m.router_score, norm_topk_prob=m.norm_topk_prob, bias_update_rate=m.bias_update_rate)


def model_config_from_record(recorded: Any) -> ModelConfig:
    """The ModelConfig a checkpoint's state.json records (its `model` section); ValueError, in one
    line, when it is missing or holds keys this version does not know."""
    if not isinstance(recorded, dict):
        raise ValueError("state.json has no 'model' section; cannot tell the model's shape")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown := sorted(recorded.keys() - known):
        raise ValueError(f"state.json model.{unknown[0]} is not a ModelConfig field of this megaframe version")
    if isinstance(recorded.get("moe"), dict):  # nested dataclasses come back from JSON as dicts
        recorded = {**recorded, "moe": MoEConfig(**recorded["moe"])}
    config = ModelConfig(**recorded)
    # the values megaframe-train would refuse (a state.json edited by hand, its manifest hashed again):
    # a negative size was a traceback in every tool, an unknown arch went through
    try:
        finite = check_finite(config)
        problem = f"model.{finite}" if finite else check_model(SimpleNamespace(model=config))
    except TypeError as err:  # a string where a number belongs
        problem = f"a value of the wrong type ({err})"
    if problem:
        raise ValueError(f"state.json's model section: {problem}; it is not a model this "
                         f"megaframe can build (edited by hand?)")
    return config


# GPTDims fields that decide a parameter's shape or whether it exists, with the key that sets each
_SHAPE_KEYS = {"num_layers": "model.num_layers", "hidden_size": "model.hidden_size",
               "num_heads": "model.num_attention_heads", "num_kv_heads": "model.num_kv_heads",
               "ffn_hidden_size": "model.ffn_hidden_size", "vocab_size": "model.vocab_size", "norm": "model.norm",
               "activation": "model.activation", "position_embedding": "model.position_embedding",
               "tie_embeddings": "model.tie_embeddings", "bias": "model.bias", "head_dim": "model.head_dim",
               "qk_norm": "model.qk_norm"}
_MOE_SHAPE_KEYS = ("num_experts", "ffn_hidden_size", "layer_freq", "first_dense_layers", "shared_experts")


def _has_dense_block(dims: GPTDims) -> bool:
    """Whether some block has a dense MLP (of model.ffn_hidden_size): not when every block routes
    (a Mixtral). Arithmetic on the pattern, not a loop over the layers."""
    moe = dims.moe
    if moe is None or moe.first_dense_layers > 0:
        return dims.num_layers > 0
    return moe.layer_freq > 1 and dims.num_layers > 1


def shape_change(saved: GPTDims, now: GPTDims) -> Optional[tuple[str, Any, Any]]:
    """The first (key, saved value, current value) that gives the model another set of parameter
    shapes, or None. Dropout, init, norm epsilon, RoPE theta and routing coefficients may change on
    resume; so may the sequence length, except under learned positions (the table's rows)."""
    dense = _has_dense_block(saved) or _has_dense_block(now)  # else model.ffn_hidden_size shapes no tensor
    pairs = [(key, getattr(saved, field), getattr(now, field)) for field, key in _SHAPE_KEYS.items()
             if dense or field != "ffn_hidden_size"]
    if saved.position_embedding == now.position_embedding == "learned":
        pairs.append(("model.seq_length", saved.seq_length, now.seq_length))
    saved_moe, now_moe = saved.moe, now.moe
    pairs.append(("model.moe.num_experts", saved_moe.num_experts if saved_moe else 0,
                  now_moe.num_experts if now_moe else 0))
    if saved_moe and now_moe:
        pairs += [(f"model.moe.{field}", getattr(saved_moe, field), getattr(now_moe, field))
                  for field in _MOE_SHAPE_KEYS]
    return next(((key, a, b) for key, a, b in pairs if a != b), None)


def capacity_slots(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Assignments one expert takes from one rank's tokens (model/moe.py's buffers; the planner counts
    them): factor x its even share (Megatron's rule), at most the tokens, which is all a token's
    distinct picks can send one expert: a factor of 1e9 asked for a petabyte of buffer at step 0,
    where any factor from num_experts/top_k up keeps all."""
    return max(1, min(tokens, math.ceil(tokens * top_k / num_experts * factor)))

"""ModelSpec: the model's structure, said once.

- the layer list every builder walks: embed | block x num_layers | final_norm | head (the plain
  GPT, the pipeline's PipelineModule, the dry run and the planner's per-stage counts);
- the canonical parameter names (those of the tp=1, unpipelined GPT), their full shapes and how
  each is sharded (ShardSpec: which parallel axis, which tensor dimension), read off a build of the
  model on the meta device, so the modules remain the one source of truth;
- which parameters have the padded vocabulary as their rows;
- the block's modules (BlockSpec), where a ring-attention or MoE module slots in.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Optional

from megaframe.model.dims import GPTDims
from megaframe.model.layer_list import Layer, layer_list  # noqa: F401  (Layer: re-exported)

if TYPE_CHECKING:  # torch-free at import: the planner reads the layer list in the launching process
    from megaframe.model.gpt import BlockSpec
    from megaframe.parallel.layers import ShardSpec

# parameters whose first dimension is the (padded) vocabulary: the padding depends on tp, so
# layout-free files store them unpadded
VOCAB_PARAMS = ("embed.tok.weight", "head.weight")


@dataclass(frozen=True)
class ParamSpec:
    """A parameter under its canonical name: full shape (vocabulary rows unpadded) and sharding."""

    name: str
    shape: tuple[int, ...]
    shard: Optional["ShardSpec"]  # None: replicated on every rank of every axis

    @property
    def vocab(self) -> bool:
        return self.name in VOCAB_PARAMS


@dataclass(frozen=True)
class ModelSpec:
    """Dimensions, block modules, layer list, canonical parameters of one model."""

    dims: GPTDims
    block: Optional["BlockSpec"] = None  # None: attention, MLP and norms as the config's flavour says

    def layers(self) -> tuple[Layer, ...]:
        """The layer list, in the order the pipeline partitions it (and names its layers)."""
        return layer_list(self.dims.num_layers, self.dims.tie_embeddings)

    @cached_property
    def parameters(self) -> dict[str, ParamSpec]:
        """{canonical name: ParamSpec}, from the tp=1 GPT built on the meta device (no memory)."""
        import torch

        from megaframe.model.gpt import GPT, BlockSpec

        with torch.device("meta"):
            model = GPT(self.dims, block=self.block or BlockSpec())
        return {name: ParamSpec(name, (self.dims.vocab_size, *p.shape[1:]) if name in VOCAB_PARAMS else tuple(p.shape),
                                getattr(p, "shard", None))
                for name, p in model.named_parameters()}

"""ModelSpec: the one layer list, canonical parameters with their shard descriptions, block modules
chosen by spec, and RoPE at a position offset."""
from __future__ import annotations

import torch
import torch.nn as nn

from megaframe.config.schema import ModelConfig
from megaframe.model.dims import resolve_dims
from megaframe.model.gpt import GPT, MLP, Attention, BlockSpec, rope_tables
from megaframe.model.spec import ModelSpec
from megaframe.parallel.layers import ShardSpec

GPT2 = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16)
LLAMA = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, seq_length=16,
                    norm="rmsnorm", activation="swiglu", position_embedding="rope", tie_embeddings=False, bias=False)


def test_layer_list_for_tied_and_untied_heads():
    tied = ModelSpec(resolve_dims(GPT2, 100)).layers()
    assert [(layer.kind, layer.prefix) for layer in tied] == [
        ("embed", "embed"), ("block", "blocks.0"), ("block", "blocks.1"), ("final_norm", "final_norm"), ("head", "embed")]
    assert [layer.block for layer in tied] == [None, 0, 1, None, None]
    assert ModelSpec(resolve_dims(LLAMA, 100)).layers()[-1].prefix == "head"


def test_parameters_name_shape_and_shard_of_every_tensor():
    dims = resolve_dims(LLAMA, 100)  # vocabulary 100, padded to 128
    params = ModelSpec(dims).parameters
    with torch.device("meta"):
        names = [name for name, _ in GPT(dims).named_parameters()]
    assert list(params) == names
    assert params["embed.tok.weight"].shape == (100, 64) and params["embed.tok.weight"].vocab
    assert params["head.weight"].shape == (100, 64) and params["head.weight"].shard == ShardSpec("tp", 0)
    assert params["blocks.0.attn.q_proj.weight"].shard == ShardSpec("tp", 0)  # column-parallel: output rows
    assert params["blocks.0.attn.out_proj.weight"].shard == ShardSpec("tp", 1)  # row-parallel: input columns
    assert params["blocks.0.mlp.down_proj.weight"].shard == ShardSpec("tp", 1)
    assert params["blocks.1.attn_norm.weight"].shard is None and not params["final_norm.weight"].vocab


def test_shard_spec_takes_the_rank_piece_and_its_bounds():
    full = torch.arange(24.0).reshape(4, 6)
    rows, cols = ShardSpec("tp", 0), ShardSpec("tp", 1)
    assert torch.equal(rows.take(full, 1, 2), full[2:])
    assert torch.equal(cols.take(full, 2, 3), full[:, 4:])
    assert cols.bounds((4, 6), 1, 3) == (2, 4)
    assert torch.equal(cols.gather(cols.take(full, 0, 1), None, 1), full)  # one rank: no collective


class CountingAttention(Attention):
    """Attention that counts its instances: proves the block built it from the spec."""

    built = 0

    def __init__(self, *args):
        super().__init__(*args)
        CountingAttention.built += 1
        self.extra = nn.Parameter(torch.zeros(3))


def test_block_modules_come_from_the_spec():
    dims = resolve_dims(GPT2, 100)
    CountingAttention.built = 0
    model = GPT(dims, block=BlockSpec(attention=CountingAttention, mlp=MLP))
    assert CountingAttention.built == dims.num_layers
    assert all(isinstance(block.attn, CountingAttention) for block in model.blocks)
    assert "blocks.1.attn.extra" in ModelSpec(dims, BlockSpec(attention=CountingAttention)).parameters
    assert "blocks.1.attn.extra" not in ModelSpec(dims).parameters


def test_rope_tables_at_an_offset_are_the_later_rows():
    dims = resolve_dims(LLAMA, 100)
    cos, sin = rope_tables(dims, 12)
    cos_at, sin_at = rope_tables(dims, 4, offset=8)
    assert torch.equal(cos_at, cos[8:12]) and torch.equal(sin_at, sin[8:12])

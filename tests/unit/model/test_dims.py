"""The resume's shape check (model/dims.py shape_change) refuses only keys that shape a tensor."""
from __future__ import annotations

import dataclasses

import pytest

from megaframe.config.compose import compose
from megaframe.convert.hf import config_from_hf
from megaframe.model.dims import resolve_dims, shape_change

VOCAB = 257


def _mixtral_from_hf(moe_tiny) -> dict:
    """The config.json of a Mixtral shaped like model=moe_tiny, as `megaframe-convert from-hf` reads it."""
    return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": VOCAB,
            "hidden_size": moe_tiny.hidden_size, "intermediate_size": moe_tiny.moe.ffn_hidden_size,
            "num_hidden_layers": moe_tiny.num_layers, "num_attention_heads": moe_tiny.num_attention_heads,
            "num_key_value_heads": moe_tiny.num_kv_heads, "num_local_experts": moe_tiny.moe.num_experts,
            "num_experts_per_tok": moe_tiny.moe.top_k, "max_position_embeddings": moe_tiny.seq_length,
            "rms_norm_eps": moe_tiny.norm_eps, "rope_theta": moe_tiny.rope_theta, "tie_word_embeddings": False}


def test_model_ffn_hidden_size_is_no_shape_when_every_block_routes():
    """model=moe_tiny (ffn_hidden_size 352, experts 128 wide) resumes an imported Mixtral (whose
    model.ffn_hidden_size is its experts' width): no block has a dense MLP of that width."""
    moe_tiny = compose(["model=moe_tiny"])[0].model
    imported = config_from_hf(_mixtral_from_hf(moe_tiny))
    assert imported.ffn_hidden_size != moe_tiny.ffn_hidden_size  # the key the check used to refuse
    assert shape_change(resolve_dims(imported, VOCAB), resolve_dims(moe_tiny, VOCAB)) is None


def test_model_ffn_hidden_size_still_shapes_a_dense_block():
    moe_tiny = compose(["model=moe_tiny"])[0].model
    wider = dataclasses.replace(moe_tiny, ffn_hidden_size=512)
    assert shape_change(resolve_dims(moe_tiny, VOCAB), resolve_dims(wider, VOCAB)) is None
    for pattern in ({"first_dense_layers": 1}, {"layer_freq": 2}):  # a dense block in both
        a = dataclasses.replace(moe_tiny, moe=dataclasses.replace(moe_tiny.moe, **pattern))
        b = dataclasses.replace(a, ffn_hidden_size=512)
        assert shape_change(resolve_dims(a, VOCAB), resolve_dims(b, VOCAB)) == ("model.ffn_hidden_size", 352, 512)
    # the experts' width shapes the experts
    narrow = dataclasses.replace(moe_tiny, moe=dataclasses.replace(moe_tiny.moe, ffn_hidden_size=64))
    assert shape_change(resolve_dims(moe_tiny, VOCAB), resolve_dims(narrow, VOCAB)) == \
        ("model.moe.ffn_hidden_size", 128, 64)
    dense = compose([])[0].model
    assert shape_change(resolve_dims(dense, VOCAB), resolve_dims(dataclasses.replace(dense, ffn_hidden_size=99),
                                                                 VOCAB))[0] == "model.ffn_hidden_size"


@pytest.mark.parametrize("key, value, said", [
    ("seq_length", -5, "model.seq_length=-5 must be >= 1"),
    ("arch", "foo", "model.arch='foo' is not one of ['gpt2', 'llama']"),
    ("norm_eps", float("nan"), "model.norm_eps=nan must be a finite number"),
    ("hidden_size", "64", "a value of the wrong type"),
])
def test_a_recorded_model_megaframe_train_would_refuse_is_one_line(key, value, said):
    """A state.json edited by hand (its manifest hashed again): seq_length=-5 was a "negative
    dimension" traceback in to-hf, sample and eval, and an unknown arch went through (review)."""
    from megaframe.config.schema import ModelConfig
    from megaframe.model.dims import model_config_from_record

    record = dataclasses.asdict(ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32))
    assert model_config_from_record(record).seq_length == 32
    with pytest.raises(ValueError) as refused:
        model_config_from_record({**record, key: value})
    message = str(refused.value)
    assert message.startswith(f"state.json's model section: {said}"), message
    assert message.endswith("; it is not a model this megaframe can build (edited by hand?)"), message

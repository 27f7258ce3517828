"""Sizes no machine can run are one line before launch (issue 50, Build 9): every size key above
2**31-1 (cuBLAS's, NCCL's and CUDA's 32-bit ints), a micro-batch of more tokens, a world of more
ranks. And the rules that word a legal-but-wrong size stay quick at sizes just below the bound:
hidden_size=2**31-1 listed its divisors by trial up to n, a global batch of 2**31-1 built a list of
every multiple of the per-step batch before slicing four."""
from __future__ import annotations

import copy
import time

import pytest

from megaframe.backends.registry import engine
from megaframe.launch.checks import check
from megaframe.config.compose import compose
from megaframe.config.size_limits import INT32_MAX, SIZE_KEYS
from megaframe.config.validate import ConfigError, _divisors, requested_world_size, validate


@pytest.fixture(scope="module")
def default_config():
    return compose([])[0]


def _with(cfg, **values):
    cfg = copy.deepcopy(cfg)
    for key, value in values.items():
        *path, name = key.split("__")
        node = cfg
        for part in path:
            node = getattr(node, part)
        setattr(node, name, value)
    return cfg


def _refusal(cfg) -> str:
    started = time.process_time()
    with pytest.raises(ConfigError) as refused:
        validate(cfg, requested_world_size(cfg), lambda: False, lambda: True, engine().config_problem)
    assert time.process_time() - started < 2.0
    assert "\n" not in str(refused.value)
    return str(refused.value)


@pytest.mark.parametrize("key", SIZE_KEYS)
def test_a_size_beyond_32_bits_is_one_line_naming_the_key(key, default_config):
    message = _refusal(_with(default_config, **{key.replace(".", "__"): INT32_MAX + 1}))
    assert message.startswith(f"{key}={INT32_MAX + 1} is beyond the 32-bit sizes"), message


def test_the_bound_is_exclusive_of_int32_max(default_config):
    """2**31-1 itself is a legal size for a key (a product with it may not be: the tokens of a micro-batch)."""
    from megaframe.config.size_limits import absurd_size_problem

    for key in SIZE_KEYS:
        problem = absurd_size_problem(_with(default_config, **{key.replace(".", "__"): INT32_MAX}))
        assert problem is None or not problem.startswith(f"{key}="), problem


@pytest.mark.parametrize("values,start", [
    ({"parallel__micro_batch_size": 65536, "model__seq_length": 65536}, "parallel.micro_batch_size*model.seq_length"),
    ({"parallel__tp": 65536, "parallel__pp": 65536}, "parallel.tp*pp*cp*dp=4294967296 ranks"),
    ({"launcher__nodes": 2**30, "cluster__gpus_per_node": 8}, "launcher.nodes*cluster.gpus_per_node"),
])
def test_products_beyond_32_bits_are_one_line(values, start, default_config):
    assert _refusal(_with(default_config, **values)).startswith(start)


@pytest.mark.parametrize("values,start", [
    ({"model__hidden_size": INT32_MAX, "model__num_attention_heads": 2}, "model.hidden_size=2147483647 is not divisible"),
    ({"parallel__global_batch_size": INT32_MAX - 1, "parallel__micro_batch_size": 5},
     "parallel.global_batch_size=2147483646 is not divisible"),
    ({"parallel__tp": 3, "model__num_attention_heads": 2**30, "model__hidden_size": 2**30},
     "parallel.tp=3 does not divide model.num_attention_heads=1073741824; pick tp in [1, 2, 4,"),
])
def test_legal_but_wrong_sizes_near_the_bound_are_worded_quickly(values, start, default_config):
    assert start in _refusal(_with(default_config, **values))


def test_divisors_are_those_of_trial_division():
    for n in [1, 2, 12, 36, 97, 130, 720, 1001, 4096]:
        assert _divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n


@pytest.mark.parametrize("override", ["model.num_layers=100000000000", "model.hidden_size=1000000000000",
                                      "model.vocab_size=5000000000", "parallel.global_batch_size=99999999999"])
def test_megaframe_train_refuses_them_with_exit_2(override, capsys):
    with pytest.raises(SystemExit) as ended:
        check([override])
    lines = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(lines) == 1 and lines[0].startswith(
        f"megaframe-train: error: {override} is beyond"), lines

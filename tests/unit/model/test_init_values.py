"""A piece of a parameter's initial value equals that piece of the whole value, and costs only the
tiles it overlaps (model/init_values.py)."""
from __future__ import annotations

import random
import re
import subprocess
import sys

import pytest
import torch

from megaframe.model.init_values import TILE_COLS, TILE_ROWS, InitValue
from tests.support.init_draws import recorded_draws

SHAPES = [(3 * TILE_ROWS + 12, 2 * TILE_COLS + 188), (3, 2 * TILE_ROWS + 8, TILE_COLS + 8), (3 * TILE_COLS + 20,),
          (5, 7)]


def _value(shape, name="blocks.0.mlp.up_proj.weight", seed=3, std=0.02):
    return InitValue.whole(name, shape, "normal", std, seed)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_shard_and_box_is_that_part_of_the_whole_value(shape):
    whole = _value(shape).tensor()
    assert whole.shape == shape
    for dim in range(len(shape)):
        for count in (2, 4):
            size = shape[dim] // count
            for index in range(count):
                piece = _value(shape).narrow(dim, index * size, size)
                assert torch.equal(piece.tensor(), whole.narrow(dim, index * size, size)), (dim, count, index)
    rng = random.Random(0)
    for _ in range(20):
        box = []
        for n in shape:
            start = rng.randrange(n)
            box.append(slice(start, rng.randrange(start + 1, n + 1)))
        assert torch.equal(_value(shape)[tuple(box)].tensor(), whole[tuple(box)]), box


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_flat_range_of_a_shard_is_that_range_of_the_shard_flattened(shape):
    # a ZeRO-3 partition: a flat range of the TP shard (column- or row-parallel) of the parameter
    last = len(shape) - 1
    for shard in (_value(shape).narrow(0, 1, shape[0] - 2), _value(shape).narrow(last, 3, shape[last] // 2)):
        flat = shard.tensor().flatten()
        inner = flat.numel() // shard.shape[0]
        rng = random.Random(1)
        ranges = [(0, flat.numel()), (0, 0), (inner, 3 * inner), (inner - 1, inner + 1), (5, 6)]
        ranges += [tuple(sorted(rng.sample(range(flat.numel() + 1), 2))) for _ in range(30)]
        for start, stop in ranges:
            start, stop = min(start, flat.numel()), min(stop, flat.numel())
            assert torch.equal(shard.flat(start, stop), flat[start:stop]), (shard.offset, start, stop)


def test_a_piece_draws_only_the_tiles_it_overlaps():
    with recorded_draws() as drawn:
        value = _value((4 * TILE_ROWS, 4 * TILE_COLS))
        value.narrow(1, 2 * TILE_COLS, TILE_COLS).tensor()  # a row-parallel shard at tp=4: one tile column of four
        assert sorted(drawn) == [((), row, 2) for row in range(4)]
        drawn.clear()
        value.narrow(0, TILE_ROWS + 3, 2).tensor()  # two rows (an FSDP box): the one tile row they are in
        assert sorted(drawn) == [((), 1, col) for col in range(4)]
        drawn.clear()
        row = 4 * TILE_COLS
        value.flat(TILE_ROWS * row + 10, TILE_ROWS * row + 20)  # ten elements of the first row of tile row 1
        assert drawn == [((), 1, 0)]
        drawn.clear()
        _value((8, TILE_ROWS, TILE_COLS), name="blocks.0.mlp.experts.up_proj").narrow(0, 6, 2).tensor()  # experts 6, 7
        assert drawn == [((6,), 0, 0), ((7,), 0, 0)]


def test_the_values_are_normal_with_the_asked_spread_and_every_tile_its_own():
    value = _value((2 * TILE_ROWS, 2 * TILE_COLS), std=0.5).tensor()
    assert abs(value.mean().item()) < 0.01 and abs(value.std().item() - 0.5) < 0.01
    tiles = [value[r:r + TILE_ROWS, c:c + TILE_COLS] for r in (0, TILE_ROWS) for c in (0, TILE_COLS)]
    assert all(not torch.equal(a, b) for i, a in enumerate(tiles) for b in tiles[i + 1:])
    assert not torch.equal(_value((64, 64), seed=4).tensor(), _value((64, 64), seed=3).tensor())
    assert not torch.equal(_value((64, 64), name="x").tensor(), _value((64, 64)).tensor())


def test_an_element_s_value_does_not_depend_on_the_tensor_s_extent():
    # the vocabulary is padded to a multiple of make_vocab_size_divisible_by x tp: the real rows must
    # hold the same values whatever the padding
    small, padded = _value((TILE_ROWS + 5, 300)).tensor(), _value((4 * TILE_ROWS, TILE_COLS + 3)).tensor()
    assert torch.equal(small, padded[:TILE_ROWS + 5, :300])


def test_only_plain_slices_are_taken():
    with pytest.raises(TypeError, match="step 1"):
        _value((8, 8))[::2]
    with pytest.raises(IndexError, match="outside"):
        _value((8, 8)).narrow(0, 6, 4)


def test_bench_init_reports_half_the_draws_at_tp2():
    """tools/bench_init.py, whose figures BENCHMARKS.md cites ("Initial values drawn per rank")."""
    result = subprocess.run([sys.executable, "tools/bench_init.py", "--recipe", "", "model.vocab_size=1024",
                             "model.hidden_size=1024", "model.num_attention_heads=8", "model.ffn_hidden_size=2048",
                             "parallel.tp=2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    drawn = [float(m) for m in re.findall(r"([\d.]+)M elements drawn", result.stdout)]
    assert len(drawn) == 2 and drawn[0] == pytest.approx(8.4, abs=0.1), result.stdout  # 4 x 1024² + 2 x 1024 x 2048
    assert drawn[1] == pytest.approx(drawn[0] / 2, rel=0.01), result.stdout


def test_values_stay_float32_on_the_host_under_zero_init_s_factories(monkeypatch):
    # deepspeed.zero.Init wraps torch's factories: no device= lands on the accelerator, and a floating
    # result is cast to the run's dtype even when dtype= says otherwise; ZeRO-3 draws under it
    from deepspeed.runtime.zero.partition_parameters import zero_wrapper_for_fp_tensor_constructor

    expected = {kind: InitValue.whole("w", (40, 600), kind, 0.02, 3).tensor() for kind in ("normal", "zeros", "ones")}
    for name in ("randn", "empty", "zeros", "ones", "full", "tensor"):
        monkeypatch.setattr(torch, name, zero_wrapper_for_fp_tensor_constructor(getattr(torch, name), torch.bfloat16,
                                                                                None))
    for kind, value in expected.items():
        drawn = InitValue.whole("w", (40, 600), kind, 0.02, 3)
        assert drawn.tensor().dtype == torch.float32 and torch.equal(drawn.tensor(), value), kind
        assert torch.equal(drawn.flat(5, 700), value.flatten()[5:700]), kind


@pytest.mark.parametrize("args, key", [(["--recipe", "nope"], "recipe=nope"), (["--recipe", ""], "model.vocab_size")])
def test_bench_init_refuses_bad_input_in_one_line(args, key):
    result = subprocess.run([sys.executable, "tools/bench_init.py", *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and key in result.stderr, result.stderr

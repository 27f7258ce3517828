"""What drawing a rank's initial values costs: the whole of each parameter then its shard (megaframe
before the tiles) against the tiles of its shard alone (megaframe/model/init_values.py).

usage: python tools/bench_init.py [--recipe llama2_70b] [--blocks 1] [OVERRIDE ...]

Takes the first BLOCKS blocks of RECIPE's model at the recipe's tp and ep, and for rank 0 of those
axes times, on one thread: (old) torch.randn of each parameter's full shape from one generator, then
the shard's slice; (new) the shard's tiles. Prints the seconds and the elements drawn each way, and
how many blocks a rank holds at the recipe's pp (the start-up cost is about that many times the
block's; the embedding and head, one stage's each, come on top).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="llama2_70b")
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="config overrides on top (--recipe '' for none)")
    args = parser.parse_args()

    import torch

    from megaframe.config.compose import compose
    from megaframe.config.validate import ConfigError
    from megaframe.model.dims import resolve_dims
    from megaframe.model.gpt import init_value
    from megaframe.model import init_values
    from megaframe.model.init_values import name_seed
    from megaframe.model.spec import ModelSpec
    from tests.support.init_draws import recorded_draws

    torch.set_num_threads(1)
    try:
        cfg, _ = compose([f"recipe={args.recipe}"] * bool(args.recipe) + args.overrides)
    except ConfigError as err:
        sys.exit(f"bench_init: {err}")
    if cfg.model.vocab_size is None:
        sys.exit("bench_init: model.vocab_size=null (taken from a dataset, which this reads none of): "
                 "pass model.vocab_size=N or a --recipe")
    p = cfg.parallel
    dims = resolve_dims(cfg.model, cfg.model.vocab_size, tp=p.tp)
    counts = {"tp": p.tp, "ep": p.ep}
    names = tuple(f"blocks.{i}." for i in range(args.blocks))
    params = [s for name, s in ModelSpec(dims).parameters.items() if name.startswith(names)]
    drawn = [s for s in params if init_value(s.name, s.shape, dims, 0).kind == "normal"]

    started, old_elements = time.perf_counter(), 0
    for s in drawn:
        full = torch.randn(s.shape, generator=torch.Generator().manual_seed(name_seed(0, s.name)))
        old_elements += full.numel()
        piece = s.shard.take(full, 0, counts[s.shard.axis]) if s.shard else full
        piece.clone()
        del full, piece
    old_s = time.perf_counter() - started

    with recorded_draws() as tiles:  # a list append per tile of 8K draws
        started = time.perf_counter()
        for s in drawn:
            value = init_value(s.name, s.shape, dims, 0)
            piece = s.shard.take(value, 0, counts[s.shard.axis]) if s.shard else value
            piece.tensor()
        new_s = time.perf_counter() - started
    new_elements = len(tiles) * init_values.TILE_ROWS * init_values.TILE_COLS

    per_stage = dims.num_layers / p.pp
    name = args.recipe or "the default config"
    print(f"{name} (tp={p.tp} ep={p.ep} pp={p.pp}), {args.blocks} block(s), rank 0 of tp/ep, one thread:")
    print(f"  whole, then the shard: {old_s:.2f} s, {old_elements / 1e6:.1f}M elements drawn")
    print(f"  the shard's tiles:     {new_s:.2f} s, {new_elements / 1e6:.1f}M elements drawn")
    print(f"  a rank holds {per_stage:.1f} blocks at pp={p.pp}")


if __name__ == "__main__":
    main()

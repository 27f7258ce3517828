"""A rank draws only its own pieces of the initial values (model/init_values.py): under FSDP2 and
ZeRO-3 at dp=4 a quarter of the weights, under tp=2 a half, where it drew every weight of its stage
before; at pp=2 partitioned by parameters, its stage's (DeepSpeed's own count built every
layer). Counted on real gloo ranks building the engine, against the same count at one rank. That
the pieces hold the values every other layout holds is the parity tests' check (test_zero.py,
test_fsdp2.py, test_tensor_parallel.py: step 1's loss equals the single-rank run's); the pieces'
values against the whole tensor's are tests/unit/model/test_init_values.py's."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow

# weights whose rows split into whole tile rows (FSDP's Shard(0) at dp=4, tp's column shards) and whose
# columns, cut by tp's row-parallel layers, into whole tile columns (1024 / 2 = 512), and a vocabulary
# padded to 1024 rows at tp=1 and tp=2 alike: each rank's share is whole tiles, so a draw beyond it is waste
MODEL = ["model.num_layers=2", "model.hidden_size=1024", "model.num_attention_heads=8", "model.ffn_hidden_size=2048",
         "model.seq_length=32", "model.vocab_size=1024",
         "model.make_vocab_size_divisible_by=512", "parallel.micro_batch_size=1",
         "train.max_steps=1", "logging.wandb.mode=disabled", "logging.progress_bar=false"]


def _count_draws(rank: int, world: int, overrides: list[str], run_dir: str) -> int:
    from megaframe.backends.registry import validate_for_engine
    from megaframe.config.compose import compose
    from megaframe.model.init_values import TILE_COLS, TILE_ROWS
    from megaframe.training.trainer import Trainer
    from tests.support.init_draws import recorded_draws

    cfg, _ = compose(overrides)
    with recorded_draws() as drawn, Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False),
                                            Path(run_dir)) as trainer:
        count = len(drawn) * TILE_ROWS * TILE_COLS
        if cfg.parallel.pipeline_partition == "parameters":
            from deepspeed.pipe import PipelineModule

            # the counts the partition weighed, against DeepSpeed's own (which builds every layer: after the count)
            module = trainer.backend.engine.module
            assert module._layer_parameters == PipelineModule._count_layer_params(module), module._layer_parameters
    return count


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> int:
    """The weights' draws at one rank: each of them once."""
    workdir = tmp_path_factory.mktemp("one")
    return run_ranks(_count_draws, 1, workdir, overrides=[*MODEL, "parallel.global_batch_size=1"],
                     run_dir=str(workdir / "run"))[0]


@pytest.mark.parametrize("layout, world, share", [
    (["backend=fsdp2", "parallel.global_batch_size=4"], 4, 0.25),
    (["zero=stage3", "parallel.global_batch_size=4"], 4, 0.25),
    (["parallel.tp=2", "parallel.global_batch_size=1"], 2, 0.5),
    # the stages hold embed + block 0 and block 1 + the tied head (the embedding again): 0.53 each
    (["parallel.pp=2", "parallel.pipeline_partition=parameters", "parallel.global_batch_size=2"], 2, 0.53),
], ids=["fsdp2-dp4", "zero3-dp4", "tp2", "pp2-by-parameters"])
def test_each_rank_draws_its_share_of_the_weights(tmp_path, whole, layout, world, share):
    drawn = run_ranks(_count_draws, world, tmp_path, overrides=[*MODEL, *layout], run_dir=str(tmp_path / "run"))
    assert whole > 17e6  # the weights of the model above
    for rank, count in enumerate(drawn):
        # beyond its share: under tp the replicated position embedding (32 x 1024), drawn by both ranks
        assert count <= share * whole * 1.01, (rank, count, whole)
    assert sum(drawn) >= whole, (drawn, whole)

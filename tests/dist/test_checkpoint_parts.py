"""A new piece of run state is one registered part (megaframe/checkpoint/parts.py): no edit to the
trainer or to the checkpoint format. Two parts the package does not know, registered from outside:
- a whole part, the steps and losses trained so far (the same on every rank): it must come back in
  the layout it was saved in and in another one, from the layout-free checkpoint;
- a rank part, a generator per rank that draws once per step: it must come back on its own rank in
  the same layout, and restart from (train.seed + step) in another.
Saved at dp=2 after 3 of 6 steps; resumed at dp=2 and, resharded, at dp=1 (real gloo ranks)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.helpers import TINY
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow

BASE = [*TINY, "train.max_steps=6", "train.eval_interval=0", "train.seed=5"]
SAVED_AT = 3


class History:
    """A whole part: what every step trained on, as every rank saw it."""

    def __init__(self):
        self.steps: list[int] = []
        self.losses: list[float] = []

    def state_dict(self) -> dict:
        return {"steps": list(self.steps), "losses": list(self.losses)}

    def load_state_dict(self, state, resume) -> None:
        self.steps, self.losses = list(state["steps"]), list(state["losses"])


class RankStream:
    """A rank part: this rank's own generator, one draw per step."""

    def __init__(self, rank: int):
        import torch

        self.rank = rank
        self.generator = torch.Generator().manual_seed(1000 + rank)
        self.reseeded_with = None

    def draw(self) -> float:
        import torch

        return torch.rand((), generator=self.generator).item()

    def peek(self) -> float:
        import torch

        twin = torch.Generator()
        twin.set_state(self.generator.get_state())
        return torch.rand((), generator=twin).item()

    def state_dict(self) -> dict:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state, resume) -> None:
        self.generator.set_state(state["state"])

    def reseed(self, seed: int) -> None:
        self.reseeded_with = seed
        self.generator.manual_seed(seed * 100 + self.rank)


def _train(rank: int, world: int, overrides: list[str], run_dir: str) -> dict:
    import torch.distributed as dist

    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.trainer import Trainer

    cfg, _ = compose(overrides)
    trainer = Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_dir))
    history, stream = History(), RankStream(dist.get_rank())
    trainer.checkpoints.register("history", history)
    trainer.checkpoints.register("stream", stream)
    draws, take_step = {}, trainer.train_step

    def recording_step():  # the new state changes every step, as a real one would
        result, lr = take_step()
        history.steps.append(trainer.step)
        history.losses.append(result.loss)
        draws[trainer.step] = stream.draw()
        return result, lr
    trainer.train_step = recording_step
    with trainer:
        trainer.fit()
    return {"history": history.state_dict(), "draws": draws, "next_draw": stream.peek(),
            "reseeded_with": stream.reseeded_with}


def test_a_registered_part_round_trips_through_save_resume_and_resharded_resume(tmp_path):
    import torch

    from megaframe.checkpoint import universal
    from megaframe.checkpoint.store import load_tensors_pickle

    saved, same, resharded = tmp_path / "saved", tmp_path / "same", tmp_path / "resharded"
    first = run_ranks(_train, 2, tmp_path, overrides=[*BASE, f"train.exit_at_step={SAVED_AT}"], run_dir=str(saved))
    checkpoint = saved / "checkpoints" / f"global_step{SAVED_AT}"
    # the part's key is its registered name, beside the run's own (the format did not change)
    state = universal.read_state(checkpoint)
    assert state["history"] == first[0]["history"] and state["step"] == SAVED_AT and "guard" in state
    for rank in range(2):
        assert "stream" in load_tensors_pickle(checkpoint / f"rng_rank{rank}.pt")
    assert first[0]["history"]["steps"] == [1, 2, 3] and first[0]["history"] == first[1]["history"]
    assert first[0]["next_draw"] != first[1]["next_draw"]  # each rank's own stream

    # the same layout: a copy of the run goes on from its checkpoint (train.resume=auto)
    shutil.copytree(saved, same)
    again = run_ranks(_train, 2, tmp_path, overrides=BASE, run_dir=str(same))
    for rank in range(2):
        history = again[rank]["history"]
        assert history["steps"] == [1, 2, 3, 4, 5, 6], history
        assert history["losses"][:SAVED_AT] == first[rank]["history"]["losses"]
        # this rank's stream goes on where it stopped, on its own rank
        assert again[rank]["draws"][SAVED_AT + 1] == first[rank]["next_draw"] and again[rank]["reseeded_with"] is None

    # another layout, from the layout-free checkpoint: the whole part comes back, the rank part restarts
    (moved,) = run_ranks(_train, 1, tmp_path, overrides=[*BASE, f"train.resume={checkpoint}"], run_dir=str(resharded))
    assert moved["history"]["steps"] == [1, 2, 3, 4, 5, 6]
    assert moved["history"]["losses"][:SAVED_AT] == first[0]["history"]["losses"]
    assert moved["reseeded_with"] == 5 + SAVED_AT
    expected = torch.rand((), generator=torch.Generator().manual_seed((5 + SAVED_AT) * 100)).item()
    assert moved["draws"][SAVED_AT + 1] == expected

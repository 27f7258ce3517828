"""decided_by_rank_zero (megaframe/parallel/rank_zero.py): rank 0 alone runs the decision, and every
rank returns its value or raises its exception, with its type and one-line message. Before, each
caller wrote the broadcast itself, and where rank 0 raised on its own (an unreadable run dir before
a fresh start) the other ranks waited in the broadcast until the collective timeout."""
from __future__ import annotations

import pytest

from tests.support.ranks import run_ranks


def _decide(rank: int, world: int, fails: bool) -> tuple:
    from megaframe.checkpoint.universal import CheckpointError
    from megaframe.parallel.rank_zero import decided_by_rank_zero

    calls = []

    def decide() -> dict:
        calls.append(rank)
        if fails:
            raise CheckpointError("train.resume=auto: cannot list /runs/x; check the storage")
        return {"steps": [2, 4], "from": rank}
    try:
        return "value", decided_by_rank_zero(decide), calls
    except CheckpointError as err:
        return "raised", (type(err).__name__, str(err), err.exit_code), calls


@pytest.mark.parametrize("fails", [False, True])
def test_every_rank_gets_rank_0s_answer_or_its_error(tmp_path, fails):
    results = run_ranks(_decide, 3, tmp_path, timeout=120, fails=fails)
    assert [calls for _, _, calls in results] == [[0], [], []]  # rank 0 alone decided
    answers = {repr(answer) for _, answer, _ in results}
    assert len(answers) == 1, answers
    kind, answer, _ = results[0]
    if fails:
        assert kind == "raised" and answer[:2] == ("CheckpointError", "train.resume=auto: cannot list /runs/x; "
                                                                       "check the storage") and int(answer[2]) == 5
    else:
        assert kind == "value" and answer == {"steps": [2, 4], "from": 0}


class _TwoArguments(Exception):
    """An exception pickle cannot rebuild: its __init__ takes more than the message."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def _decide_unrebuildable(rank: int, world: int) -> tuple:
    from megaframe.parallel.rank_zero import decided_by_rank_zero

    def decide():
        raise _TwoArguments("the job stopped: token id 300 is outside the vocabulary", 4)
    try:
        decided_by_rank_zero(decide)
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err), int(err.exit_code)
    return None


def test_an_exception_pickle_cannot_rebuild_still_ends_every_rank_with_its_message_and_code(tmp_path):
    results = run_ranks(_decide_unrebuildable, 2, tmp_path, timeout=60)
    message = "the job stopped: token id 300 is outside the vocabulary"
    assert results == [("_TwoArguments", message, 4), ("RunFailure", message, 4)], results

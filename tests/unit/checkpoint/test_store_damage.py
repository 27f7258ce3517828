"""A damaged engine file under train.trust_pickled_checkpoint (checkpoint/store.py load) is exit 5
naming the checkpoint, without torch's advice to retry with weights_only=False; an error that is
no damage stays what it is."""
from __future__ import annotations

import pickle

import pytest

from megaframe.checkpoint.universal import CheckpointError
from megaframe.common.failures import ExitCode, classify
from megaframe.checkpoint import store as checkpoint

TORCH_ADVICE = ("Weights only load failed. Re-running `torch.load` with `weights_only` set to `False` will likely "
                "succeed, but it can result in arbitrary code execution.")


class _Backend:
    def __init__(self, error: BaseException):
        self.error = error

    def load_native(self, directory, tag):
        raise self.error


@pytest.mark.parametrize("error", [pickle.UnpicklingError(TORCH_ADVICE), EOFError("Ran out of input"),
                                   RuntimeError("PytorchStreamReader failed reading zip archive: failed finding "
                                                "central directory")])
def test_a_damaged_native_file_is_exit_5_without_the_weights_only_advice(error, tmp_path):
    with pytest.raises(CheckpointError) as caught:
        checkpoint.load(_Backend(error), tmp_path / "global_step4")
    message = str(caught.value)
    assert "global_step4" in message and "damaged" in message and "weights_only" not in message
    assert classify(caught.value).exit_code == ExitCode.BAD_CHECKPOINT


def test_another_runtime_error_is_not_called_damage(tmp_path):
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        checkpoint.load(_Backend(RuntimeError("CUDA out of memory")), tmp_path / "global_step4")

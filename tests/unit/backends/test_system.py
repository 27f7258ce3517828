"""The NVMe folder's checks before launch (backends/deepspeed/system.py)."""
from __future__ import annotations

import shutil

from megaframe.backends.deepspeed.system import check_nvme_path


def test_room_for_the_planned_swap_is_required(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    assert check_nvme_path(str(tmp_path / "swap"), swap_bytes=free / 2) is None
    message = check_nvme_path(str(tmp_path / "swap"), swap_bytes=free * 2)
    assert message.startswith(f"offload.nvme_path={tmp_path / 'swap'}: ") and "GiB free" in message
    assert f"needs {free * 2 / 2**30:.1f} GiB" in message


def test_a_path_under_a_file_is_not_writable(tmp_path):
    (tmp_path / "file").write_text("x")
    message = check_nvme_path(str(tmp_path / "file" / "swap"), swap_bytes=0)
    assert "is not writable" in message and str(tmp_path / "file") in message


def test_zero3_experts_need_deepspeeds_autoep(monkeypatch):
    """A DeepSpeed without AutoEP cannot partition experts over their replicas under ZeRO-3: one
    line before launch, naming the way out; other stages and ep=1 need nothing of it."""
    import importlib.util

    from megaframe.backends.deepspeed import system
    from megaframe.backends.deepspeed.system import expert_parallel_problem

    assert expert_parallel_problem(3, 2) is None  # this DeepSpeed has it
    real = importlib.util.find_spec
    monkeypatch.setattr(system.importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed.module_inject.auto_ep_layer" else real(name, *a))
    message = expert_parallel_problem(3, 2)
    assert message.startswith("zero=stage3 with parallel.ep=2 needs DeepSpeed's AutoEP") and "zero=stage1" in message
    assert expert_parallel_problem(2, 2) is None and expert_parallel_problem(3, 1) is None

"""Test-session environment: DeepSpeed on CPU, one JIT cache for every test process."""
from __future__ import annotations

import compileall
import getpass
import os
import tempfile
from pathlib import Path
from typing import Callable

import pytest

# DeepSpeed JIT-compiles its CPU ops on first use; one cache for every test process (and CI).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "megaframe" / "torch_extensions"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# torch's inductor cache is not keyed on ATEN_CPU_CAPABILITY: kernels cached under another
# capability fail to compile under =default ("'at::vec' has not been declared", torch 2.13) or
# abort the process when loaded. The suite keeps one cache per capability of its own, so what
# other runs on the machine left in torch's default cache cannot break it.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    capability = os.environ.get("ATEN_CPU_CAPABILITY") or "host"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(
        Path(tempfile.gettempdir()) / f"megaframe-tests-inductor-{getpass.getuser()}-{capability}")


# Seconds each of the longest files took in CI (-n 3 on the two cores; junit times, the mean of two
# fresh-clone runs at ea18611 and aaba852, 2026-11-30, rounded to 10 s). Only the order they start in
# depends on these: a long file started late (test_sweep_cli.py, 230 s, was listed at 70 before) runs
# on while the other workers have run out of files.
_LONGEST_FILES = {
    "e2e/test_ray_launcher.py": 570, "e2e/test_doc_commands.py": 440, "dist/test_fsdp2.py": 390,
    "dist/test_zero.py": 350, "dist/test_fp8_layouts.py": 270, "e2e/test_sweep_cli.py": 230,
    "e2e/test_elastic.py": 230, "dist/test_context_parallel_training.py": 230, "dist/test_planner_peak.py": 230,
    "dist/test_tensor_parallel.py": 230, "fakecuda_tier/test_checkpoints_and_offload.py": 210,
    "dist/test_fsdp2_pipeline.py": 210, "e2e/test_train_cli.py": 190, "dist/test_moe_training.py": 190,
    "e2e/test_numerics_hosts.py": 150, "e2e/test_failures.py": 140,
    "fakecuda_tier/test_document_masks_on_the_device.py": 140, "e2e/test_elastic_ray.py": 130,
    "e2e/test_tracking.py": 120, "fakecuda_tier/test_training_two_ranks.py": 110, "e2e/test_elastic_recovery.py": 90,
    "dist/test_pipeline_parallel.py": 90, "fakecuda_tier/test_fp8_on_the_device.py": 90, "e2e/test_signals.py": 90,
    "dist/test_sharded_state.py": 80, "fakecuda_tier/test_training_layouts.py": 80, "dist/test_reshard.py": 80,
    "dist/test_context_parallel_masks_training.py": 80, "unit/plan/test_search.py": 80,
    "fakecuda_tier/test_training_one_rank.py": 80, "e2e/test_moe_cli.py": 70, "e2e/test_fault_tolerance.py": 70,
    "dist/test_document_mask_layouts.py": 70, "fakecuda_tier/test_muon_on_the_device.py": 60,
    "unit/test_static_checks.py": 60, "fakecuda_tier/test_host_sync_budget.py": 60, "e2e/test_cli_errors.py": 60,
    "dist/test_muon_zero.py": 60, "dist/test_skip_steps.py": 50, "unit/test_warm_ranks.py": 50,
}


@pytest.hookimpl(trylast=True)  # after the tmp_path plugin's: the session's basetemp exists
def pytest_configure(config):
    """Byte-compile megaframe and the tests' helpers once, in the controller, before any worker starts.
    A host with PYTHONDONTWRITEBYTECODE=1 (CI's is one) never keeps the byte code of an editable
    install, so each of the suite's thousand-odd processes (ranks, CLI runs, tools) recompiled them:
    about 0.2 CPU-s each. Python still reads byte code that is there; compileall writes it regardless.
    Also names the session's reference cache (tests/support/reference_cache.py) for every worker: under
    the session's basetemp (xdist's workers' basetemps are inside it), or MEGAFRAME_TESTS_REFERENCE_CACHE."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller did it
        return
    from tests.support.reference_cache import KEEP_ENV, SESSION_ENV

    os.environ[SESSION_ENV] = os.environ.get(KEEP_ENV) or str(config._tmp_path_factory.getbasetemp() / "reference-runs")
    root = Path(__file__).resolve().parents[1]
    for folder in ("megaframe", "tests", "tools"):
        compileall.compile_dir(root / folder, quiet=2, workers=1)


# Folders whose every test starts ranks or processes, and unit files that train in forked ranks or
# build DeepSpeed's ops (about 60 s and 25 s here): `slow` (pytest -m "not slow" is the inner loop)
_SLOW_FOLDERS = ("dist/", "e2e/", "fakecuda_tier/", "gpu/")
_SLOW_UNIT_FILES = {"unit/backends/test_plain.py", "unit/backends/test_build_locks.py"}


def pytest_collection_modifyitems(items):
    """Longest files first, then the other multi-rank and end-to-end files, the many short unit tests
    last (the sort is stable). `--dist loadfile` hands whole files to the workers in this order
    (with --no-loadscope-reorder; by default xdist orders files by their number of tests, which
    left the Ray file, 8 tests and the longest, to start near the end): long files start early and
    short ones fill the gaps. Every test of the multi-rank and end-to-end folders and of the longest
    files is marked `slow`, whether or not its file says so."""
    def key(item) -> tuple[float, bool]:
        path = str(item.path).replace(os.sep, "/")
        name = path.split("/tests/", 1)[-1]
        return -_LONGEST_FILES.get(name, 0), "tests/unit/" in path

    for item in items:
        name = str(item.path).replace(os.sep, "/").split("/tests/", 1)[-1]
        if name.startswith(_SLOW_FOLDERS) or name in _LONGEST_FILES or name in _SLOW_UNIT_FILES:
            item.add_marker(pytest.mark.slow)
    items.sort(key=key)


@pytest.fixture(scope="session")
def deepspeed_ops() -> Callable[..., None]:
    """deepspeed_ops(OVERRIDES, ...): build or load the DeepSpeed ops runs with these overrides need
    (the engine's own choice, build_locks.ops_for) in the test process, under megaframe's build lock,
    before the test's ranks start. A cold async_io build beside the other workers' tests took
    minutes, and an NVMe test that waited for it inside its ranks ran past its 600 s limit in CI.
    Forked ranks inherit the loaded ops."""
    from megaframe.backends.deepspeed.build_locks import load_ops, ops_for
    from megaframe.config.compose import compose

    def build(*runs: list[str]) -> None:
        for overrides in runs:
            load_ops(ops_for(compose(overrides)[0].offload))

    return build


@pytest.fixture
def tf32_restored():
    """torch's TF32 switch for matmuls as it was before the test (tests that flip it)."""
    import torch

    before = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = before

"""With MEGAFRAME_FAKE_CUDA=1 and this folder on PYTHONPATH, every Python process starts on the
CUDA-shaped CPU device (tests/support/fakecuda/__init__.py): the tests' own, megaframe-train's self-launched
ranks, torchrun's. Without the variable it does nothing, except apply a seeded megaframe bug when
MEGAFRAME_FAKE_CUDA_MUTANT names one (mutants.py; the tier's self-tests show the bug passes on the CPU)."""
import os
import sys

_repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if _repo not in sys.path:
    sys.path.append(_repo)  # the tests.support package (fakecuda, warm_ranks)
if os.environ.get("MEGAFRAME_FAKE_CUDA") == "1" or os.environ.get("MEGAFRAME_FAKE_CUDA_MUTANT"):
    if os.environ.get("MEGAFRAME_FAKE_CUDA") == "1":
        from tests.support import fakecuda

        fakecuda.install(deepspeed=os.environ.get("MEGAFRAME_FAKE_CUDA_DEEPSPEED", "1") == "1")
    if os.environ.get("MEGAFRAME_FAKE_CUDA_MUTANT"):
        from tests.support.fakecuda.mutants import apply

        apply(os.environ["MEGAFRAME_FAKE_CUDA_MUTANT"])

# a launcher's self-launched ranks fork from a warm copy of it, device included (tests/support/warm_ranks.py)
from tests.support.warm_ranks import install_when_torch_run_is_imported  # noqa: E402

install_when_torch_run_is_imported()

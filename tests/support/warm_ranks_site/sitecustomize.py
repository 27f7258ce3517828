"""On PYTHONPATH in the tests' subprocess environment (helpers.cli_env): a megaframe-train launcher
started as a fresh interpreter forks its self-launched ranks from a warm copy of itself
(tests/support/warm_ranks.py) instead of starting each as a new interpreter. MEGAFRAME_TESTS_FRESH_RANKS=1
turns it off."""
import os
import sys

_repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if _repo not in sys.path:
    sys.path.append(_repo)  # the tests.support package (warm_ranks, cli_zygote)
from tests.support.warm_ranks import install_when_torch_run_is_imported  # noqa: E402

install_when_torch_run_is_imported()

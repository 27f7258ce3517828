"""assert_parity's allowance (tests/support/parity.py): rtol at every step, wider only at a step where
the reference's own rounding, measured by a reordered or a float64 run, is wider."""
from __future__ import annotations

import pytest

from tests.support.parity import assert_parity


def _records(norms):
    return [{"step": step, "loss": 1.0, "grad_norm": norm} for step, norm in enumerate(norms, 1)]


REFERENCE = _records([2.0, 4.0, 2.0])
LAYOUT = _records([2.0, 4.004, 2.0])  # 1e-3 off at the second step


def test_a_step_off_by_more_than_rtol_fails_without_a_measure_of_the_reference_s_rounding():
    with pytest.raises(AssertionError, match="grad_norm at step 2"):
        assert_parity(LAYOUT, REFERENCE, "layout", keys=("loss", "grad_norm"))


def test_it_passes_where_the_reordered_run_itself_moves_that_much_and_only_there():
    order = _records([2.0, 4.0 * (1 + 2.5e-3), 2.0])  # an ill-conditioned second step
    assert_parity(LAYOUT, REFERENCE, "layout", keys=("loss", "grad_norm"), order=order)
    elsewhere = _records([2.0, 4.004, 2.0 * (1 + 1e-3)])  # the first and third steps keep rtol
    with pytest.raises(AssertionError, match="grad_norm at step 3"):
        assert_parity(elsewhere, REFERENCE, "layout", keys=("loss", "grad_norm"), order=order)
    with pytest.raises(AssertionError, match="grad_norm at step 2"):  # more than FACTOR x the rounding
        assert_parity(_records([2.0, 4.0 * (1 + 3e-2), 2.0]), REFERENCE, "layout", keys=("grad_norm",), order=order)


def test_the_float64_run_measures_the_reference_s_rounding_too():
    exact = _records([2.0, 4.0 * (1 + 1e-3), 2.0])  # the fp32 reference itself 1e-3 from exact there
    assert_parity(LAYOUT, REFERENCE, "layout", keys=("grad_norm",), exact=exact)

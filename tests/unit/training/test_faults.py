"""MEGAFRAME_FAULTS parsing (training/faults.py): the tests' fault plans mean what they say."""
from __future__ import annotations

import pytest

from megaframe.training.faults import Fault, Faults, parse


def test_parse_and_select_this_ranks_faults():
    assert parse("nan_grad@5:1, hang@3") == [Fault("nan_grad", 5, 1), Fault("hang", 3, None)]
    assert [f.kind for f in Faults(rank=0, spec="nan_grad@5:1,spike@8").planned] == ["spike"]
    assert [f.kind for f in Faults(rank=1, spec="nan_grad@5:1,spike@8").planned] == ["nan_grad", "spike"]


@pytest.mark.parametrize("spec", ["nan_grad", "nan_grad@x", "explode@3"])
def test_malformed_plans_are_refused(spec):
    with pytest.raises(ValueError, match="MEGAFRAME_FAULTS"):
        parse(spec)

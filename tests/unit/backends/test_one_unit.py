"""DeepSpeed's ops compile their torch-including sources as one unit (backends/deepspeed/one_unit.py): the
unit holds exactly those sources, the others keep their own, an unchanged unit is not rewritten (ninja
rebuilds nothing), and a unit that does not build falls back to DeepSpeed's way once, for good."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from megaframe.backends.deepspeed import build_locks
from megaframe.backends.deepspeed.one_unit import UNIT_PREFIX, compile_as_one_unit, includes_torch
from megaframe.common.failures import MissingSystemPiece


def _included(unit: Path) -> list[str]:
    return re.findall(r'^#include "([^"]+)"$', unit.read_text(), flags=re.M)


@pytest.mark.parametrize("name", ["CPUAdamBuilder", "PinMemoryBuilder"])
def test_the_torch_including_sources_share_one_unit_and_the_others_keep_their_own(name, tmp_path):
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(name)
    theirs = [str(Path(builder.deepspeed_src_path(s)).resolve()) for s in builder.sources()]
    include_dirs = [Path(builder.deepspeed_src_path(p)).resolve() for p in builder.include_paths()]
    unit = compile_as_one_unit(builder, tmp_path)
    assert unit == tmp_path / builder.name / f"{UNIT_PREFIX}{builder.name}.cpp"  # torch's build folder of the op
    ours, inside = builder.sources(), _included(unit)
    assert ours.count(str(unit)) == 1 and len(inside) >= 2
    assert sorted([*inside, *(s for s in ours if s != str(unit))]) == sorted(theirs)  # each source once
    assert inside == [s for s in theirs if s in inside]  # in DeepSpeed's order
    assert all(includes_torch(Path(s), include_dirs) == (s in inside) for s in theirs)


def test_an_op_whose_headers_lack_include_guards_keeps_deepspeeds_sources(tmp_path):
    """async_io's headers (DeepSpeed 0.19) define structs with no guard: two sources in one unit would
    define them twice. Its unit failed to compile; now no unit is tried (no failed compile on a cold host)."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    theirs = builder.sources()
    assert compile_as_one_unit(builder, tmp_path) is None and builder.sources() == theirs
    assert not (tmp_path / "async_io").exists()


def test_an_unchanged_unit_is_not_rewritten(tmp_path):
    from deepspeed.accelerator import get_accelerator

    unit = compile_as_one_unit(get_accelerator().create_op_builder("CPUAdamBuilder"), tmp_path)
    before = unit.stat().st_mtime_ns
    assert compile_as_one_unit(get_accelerator().create_op_builder("CPUAdamBuilder"), tmp_path) == unit
    assert unit.stat().st_mtime_ns == before


class _Builder:
    """An op builder whose two sources include torch; its load fails while the unit is among its sources
    when `clash` (as two sources defining the same internal name would), and always when `broken`."""
    loads: list[list[str]] = []

    def __init__(self, folder: Path, clash: bool = True, broken: bool = False):
        self.name, self.folder, self.clash, self.broken = "fake_op", folder, clash, broken
        for source in ("a.cpp", "b.cpp"):
            (folder / source).write_text('#include "guarded.h"\nstatic int shared_name = 1;\n')
        (folder / "guarded.h").write_text("#pragma once\n#include <torch/extension.h>\nstruct op_t {};\n")
        (folder / "c.cpp").write_text("#include <string>\n")

    def sources(self):
        return ["a.cpp", "b.cpp", "c.cpp"]

    def include_paths(self):
        return []

    def deepspeed_src_path(self, path):
        return str(self.folder / path)

    def load(self, verbose=False):
        sources = [Path(self.deepspeed_src_path(s)).name for s in self.sources()]
        type(self).loads.append(sources)
        if self.broken or (self.clash and any(UNIT_PREFIX in s for s in sources)):
            raise RuntimeError("Error building extension 'fake_op'")


def test_a_unit_that_does_not_build_falls_back_to_deepspeeds_way_once_and_for_good(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    (tmp_path / "src").mkdir()
    _Builder.loads = []
    warnings = []
    build_locks._build_or_load(_Builder(tmp_path / "src"), warnings.append)
    assert _Builder.loads == [[f"{UNIT_PREFIX}fake_op.cpp", "c.cpp"], ["a.cpp", "b.cpp", "c.cpp"]]
    assert len(warnings) == 1 and "fake_op" in warnings[0] and "one unit" in warnings[0]
    _Builder.loads = []
    build_locks._build_or_load(_Builder(tmp_path / "src"), warnings.append)  # the next run: no second attempt
    assert _Builder.loads == [["a.cpp", "b.cpp", "c.cpp"]]
    assert len(warnings) == 1


def test_a_build_that_fails_either_way_is_one_line_and_no_marker(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    (tmp_path / "src").mkdir()
    _Builder.loads = []
    with pytest.raises(MissingSystemPiece, match=r"DeepSpeed's fake_op op did not build or load \(Error building"):
        build_locks._build_or_load(_Builder(tmp_path / "src", broken=True), lambda _: None)
    assert len(_Builder.loads) == 2
    assert not list((tmp_path / "ext" / "fake_op").glob("*.failed-*"))  # the unit was not the cause
    _Builder.loads = []
    build_locks._build_or_load(_Builder(tmp_path / "src", clash=False), lambda _: None)
    assert _Builder.loads == [[f"{UNIT_PREFIX}fake_op.cpp", "c.cpp"]]  # the unit is tried again, and builds


def test_sources_sharing_an_unguarded_header_get_no_unit(tmp_path):
    builder = _Builder(tmp_path)
    (tmp_path / "guarded.h").write_text("#include <torch/extension.h>\nstruct op_t {};\n")  # no guard now
    assert compile_as_one_unit(builder, tmp_path / "ext") is None and builder.sources() == ["a.cpp", "b.cpp", "c.cpp"]

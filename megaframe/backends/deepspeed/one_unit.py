"""DeepSpeed's JIT ops compiled with one translation unit for the sources that include torch.

DeepSpeed compiles each source of an op on its own, and each of those that include
<torch/extension.h> parses torch's headers (hundreds of thousands of lines) and instantiates the
same templates again: cpu_adam and pin_memory compiled them twice each. A generated unit that
#includes those sources (by absolute path, in DeepSpeed's order) compiles them once; the op's
other sources (which include no torch, a second each) keep their own units. The same sources with
the same flags, linked into the same library: the op is the same, built for less CPU, once per host
as before.

Only an op whose own headers all have include guards can share a unit (two sources including an
unguarded header would define its types twice): async_io's lack them (DeepSpeed 0.19), so it is
built DeepSpeed's way, with no failed attempt first. A DeepSpeed whose sources clash otherwise (two
defining the same internal name) builds the op its own way: load_ops retries without the unit and
leaves a marker beside it, so later runs on the host go straight to DeepSpeed's way.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Optional

from megaframe.common.atomic_io import atomic_write_text

UNIT_PREFIX = "megaframe_unit_"
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]([^>"]+)[>"]', re.MULTILINE)
_GUARD = re.compile(r'^[ \t]*#[ \t]*(pragma[ \t]+once|ifndef[ \t]+\w+)', re.MULTILINE)


def _local_headers(source: Path, include_dirs: list[Path], seen: set[Path]) -> set[Path]:
    """The headers `source` includes, directly or not, from its own folder or include_dirs."""
    for name in _INCLUDE.findall(source.read_text(errors="replace")):
        for folder in (source.parent, *include_dirs):
            header = folder / name
            if header.is_file():
                header = header.resolve()
                if header not in seen:
                    seen.add(header)
                    _local_headers(header, include_dirs, seen)
                break
    return seen


def includes_torch(source: Path, include_dirs: list[Path]) -> bool:
    """Whether `source`, or a header it includes from its own folder or include_dirs, includes a torch header."""
    return any(name.startswith("torch/") for path in (source, *_local_headers(source, include_dirs, set()))
               for name in _INCLUDE.findall(path.read_text(errors="replace")))


def _guarded(header: Path) -> bool:
    """Whether the header can be included twice in one unit (#pragma once, or an #ifndef guard)."""
    return _GUARD.search(header.read_text(errors="replace")) is not None


def _unit_text(name: str, sources: list[Path]) -> str:
    digest = hashlib.sha256()
    for source in sources:  # the included files' contents: a changed DeepSpeed is a changed unit (torch rebuilds)
        digest.update(str(source).encode() + b"\0" + source.read_bytes() + b"\0")
    lines = [f"// DeepSpeed's {name} op: its sources that include torch, compiled as one unit by megaframe",
             "// (megaframe/backends/deepspeed/one_unit.py); sources digest " + digest.hexdigest()]
    return "\n".join([*lines, *(f'#include "{source}"' for source in sources)]) + "\n"


def failed_marker(unit: Path, text: str) -> Path:
    """The file that says this unit's text did not compile here (DeepSpeed's own way is used instead)."""
    return unit.with_name(f"{unit.name}.failed-{hashlib.sha256(text.encode()).hexdigest()[:16]}")


def compile_as_one_unit(builder, extensions_root: Path) -> Optional[Path]:
    """Make `builder` (a DeepSpeed OpBuilder) compile its torch-including sources as one unit, written to
    EXTENSIONS_ROOT/<op>/ (torch's build folder of the op); its other sources stay as they are. Returns
    the unit (None, the builder left alone: fewer than two such sources, or this unit failed here before).
    Call holding build_locks.owner_lock: the unit is rewritten only when its text changes."""
    sources = [Path(builder.deepspeed_src_path(s)).resolve() for s in builder.sources()]
    include_dirs = [Path(builder.deepspeed_src_path(p)).resolve() for p in builder.include_paths()]
    heavy = [s for s in sources if includes_torch(s, include_dirs)]
    if len(heavy) < 2:
        return None
    headers = set().union(*(_local_headers(s, include_dirs, set()) for s in heavy))
    if not all(_guarded(h) for h in headers):  # two sources including it would define its types twice
        return None
    unit = Path(extensions_root) / builder.name / f"{UNIT_PREFIX}{builder.name}.cpp"
    text = _unit_text(builder.name, heavy)
    if failed_marker(unit, text).exists():
        return None
    unit.parent.mkdir(parents=True, exist_ok=True)
    if not unit.is_file() or unit.read_text() != text:  # an unchanged unit keeps its time: ninja rebuilds nothing
        atomic_write_text(unit, text)
    first = sources.index(heavy[0])
    rest = [str(s) for s in sources if s not in heavy]
    combined = [*rest[:first], str(unit), *rest[first:]]
    builder.sources = lambda: list(combined)  # an instance attribute shadows the class's method
    return unit


def back_to_deepspeeds_sources(builder) -> None:
    """Undo compile_as_one_unit on this builder."""
    del builder.sources


def mark_failed(unit: Path) -> None:
    """The unit did not build and DeepSpeed's own way did: no later run on this host tries the unit again."""
    failed_marker(unit, unit.read_text()).touch()


def unit_failed(builder, extensions_root: Path) -> bool:
    """Whether a unit of this op failed to compile here (some text of it): such an op is built DeepSpeed's way."""
    return any((Path(extensions_root) / builder.name).glob(f"{UNIT_PREFIX}{builder.name}.cpp.failed-*"))

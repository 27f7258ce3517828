"""DeepSpeed's JIT ops whose sources cannot share one unit, compiled against one precompiled torch header.

Each of an op's sources that include torch parses torch's headers (hundreds of thousands of lines):
async_io has nine such sources, and parsing was about 18 of each one's 31 CPU-s (-O0). one_unit.py
compiles such sources as one unit, but async_io's own headers lack include guards (DeepSpeed 0.19),
so its sources cannot share a unit. Instead each of them is compiled from a wrapper,
EXT/<op>/megaframe_pch_<source>.cpp, that includes a header of the torch headers all of them include
(EXT/<op>/megaframe_pch_<op>.h) and then the source itself, by absolute path. GCC precompiles that
header once (a .gch beside it, built with exactly the op's compiler flags, read from the build.ninja
torch writes for the op: megaframe wraps torch's ninja runner, cpp_extension._run_ninja_build, while
the op loads; a torch without it builds the wrappers with no .gch) and each wrapper loads it instead of parsing torch again: a cold async_io
build took 160 instead of 286 CPU-s on the 2-core host (the .gch costs 54 CPU-s once; each source
12 instead of 31).

The op is the one DeepSpeed builds: the same sources with the same flags; only torch's headers come
before the source's own includes (torch asks extensions to include it first; checked on async_io:
every object's symbols, their sizes and instructions are the same, in another order). A .gch GCC
cannot use (another compiler, flags it rejects) is ignored by GCC, which then parses the header: the
same op, no faster. The .gch (about 800 MB; GCC peaks at 2.1 GB building it) is only of use while the wrappers compile: it is built
just before ninja runs, when ninja has a wrapper to compile, and removed after (ninja does not track
it: a wrapper compiled with it lists neither it nor torch's headers as dependencies).
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from megaframe.backends.deepspeed.one_unit import _INCLUDE, _local_headers, failed_marker, includes_torch
from megaframe.common.atomic_io import atomic_write_text

PCH_PREFIX = "megaframe_pch_"
_WRAPPER_COMPILE = re.compile(rf"{PCH_PREFIX}[^\s/]*\.cpp\b")  # a wrapper as a compile's input (a link names objects)


def _torch_headers(source: Path, include_dirs: list[Path]) -> list[str]:
    """The torch headers `source` includes, directly or through its own headers, in the order first seen."""
    names: list[str] = []
    for path in (source, *sorted(_local_headers(source, include_dirs, set()))):
        for name in _INCLUDE.findall(path.read_text(errors="replace")):
            if name.startswith("torch/") and name not in names:
                names.append(name)
    return names


def _digest(sources: list[Path]) -> str:
    digest = hashlib.sha256()
    for source in sources:  # a changed DeepSpeed is a changed header and wrappers (torch rebuilds the op)
        digest.update(str(source).encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


def _write_if_changed(path: Path, text: str) -> None:
    if not path.is_file() or path.read_text() != text:  # an unchanged file keeps its time: ninja rebuilds nothing
        atomic_write_text(path, text)


def compile_with_shared_header(builder, extensions_root: Path) -> Optional[Path]:
    """Make `builder` (a DeepSpeed OpBuilder) compile each torch-including source from a wrapper that includes
    the op's shared header first; its other sources stay as they are. Returns the header (None, the builder left
    alone: fewer than two such sources, no torch header all of them include, or this header failed here before).
    Call holding build_locks.owner_lock, and load the op inside precompiled(header)."""
    sources = [Path(builder.deepspeed_src_path(s)).resolve() for s in builder.sources()]
    include_dirs = [Path(builder.deepspeed_src_path(p)).resolve() for p in builder.include_paths()]
    heavy = [s for s in sources if includes_torch(s, include_dirs)]
    if len(heavy) < 2:
        return None
    each = [_torch_headers(s, include_dirs) for s in heavy]
    common = [name for name in each[0] if all(name in names for names in each[1:])]  # no source gets a torch header more
    if not common:
        return None
    folder = Path(extensions_root) / builder.name
    header = folder / f"{PCH_PREFIX}{builder.name}.h"
    lines = [f"// DeepSpeed's {builder.name} op: the torch headers all its torch-including sources include, precompiled",
             f"// once by megaframe (megaframe/backends/deepspeed/shared_header.py); sources digest {_digest(heavy)}"]
    text = "\n".join([*lines, *(f"#include <{name}>" for name in common)]) + "\n"
    if failed_marker(header, text).exists():
        return None
    folder.mkdir(parents=True, exist_ok=True)
    _write_if_changed(header, text)
    wrappers = {}
    for source in heavy:  # torch names each object after its source's stem: the wrappers' stems stay apart
        wrapper = folder / f"{PCH_PREFIX}{source.stem}.cpp"
        _write_if_changed(wrapper, f"// {source}, compiled against the precompiled {header.name} (shared_header.py)\n"
                                   f'#include "{header.name}"\n#include "{source}"\n')
        wrappers[source] = str(wrapper)
    combined = [wrappers.get(s, str(s)) for s in sources]
    builder.sources = lambda: list(combined)  # an instance attribute shadows the class's method
    return header


def _ninja_value(build_file: Path, name: str) -> Optional[list[str]]:
    """A top-level variable of torch's build.ninja, split as ninja's shell would; None when absent or written with
    ninja escapes ($), which this reading does not resolve."""
    prefix = f"{name} ="
    for line in build_file.read_text().splitlines():
        if line.startswith(prefix):
            value = line[len(prefix):]
            return None if "$" in value else shlex.split(value)
    return None


def _wrappers_to_compile(folder: Path) -> bool:
    """Whether ninja, run in the op's folder, would compile a wrapper (a dry run: nothing is built)."""
    dry = subprocess.run(["ninja", "-n", "-v"], cwd=folder, capture_output=True, text=True)
    return dry.returncode != 0 or _WRAPPER_COMPILE.search(dry.stdout) is not None


def _precompiled(header: Path) -> Path:
    return header.with_name(header.name + ".gch")  # where GCC looks for it when a wrapper includes the header


def precompile(header: Path) -> Optional[str]:
    """Build HEADER.gch with the op's compiler and flags from torch's build.ninja beside it (what ninja compiles
    each wrapper with), when ninja has a wrapper to compile. Returns why it built none, if it had to and could not."""
    folder = header.parent
    build_file = folder / "build.ninja"
    if not build_file.is_file() or not _wrappers_to_compile(folder):
        return None
    cxx, cflags, post = (_ninja_value(build_file, name) for name in ("cxx", "cflags", "post_cflags"))
    if not cxx or cflags is None:
        return f"no compiler flags readable in {build_file}"
    from torch.utils.cpp_extension import check_compiler_is_gcc

    if not check_compiler_is_gcc(cxx[0]):  # clang reads a .gch only when told to (-include-pch): it would be waste
        return None
    partial = header.with_name(f"{header.name}.gch.{os.getpid()}.tmp")
    command = [*cxx, *cflags, "-x", "c++-header", header.name, "-o", partial.name, *(post or [])]
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        return (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
    os.replace(partial, _precompiled(header))
    return None


@contextmanager
def precompiled(header: Optional[Path], warn: Callable[[str], None]) -> Iterator[None]:
    """While an op loads (torch writes its build.ninja, then runs ninja): HEADER.gch is built just before ninja
    runs in the header's folder, and removed after. Without torch's ninja runner (another torch) or when the .gch
    does not build, the wrappers compile as they are: the same op, parsing torch's headers each."""
    import torch.utils.cpp_extension as cpp_extension

    run = getattr(cpp_extension, "_run_ninja_build", None)
    if header is None or run is None:
        yield
        return

    def run_after_precompiling(build_directory, *args, **kwargs):
        if Path(build_directory).resolve() != header.parent.resolve():
            return run(build_directory, *args, **kwargs)
        try:
            why = precompile(header)
        except OSError as err:  # no ninja or compiler to run: torch's own build says so next
            why = str(err)
        if why:
            warn(f"no precompiled torch header for DeepSpeed's {header.parent.name} op ({why}); it builds without")
        try:
            return run(build_directory, *args, **kwargs)
        finally:
            _precompiled(header).unlink(missing_ok=True)

    cpp_extension._run_ninja_build = run_after_precompiling
    try:
        yield
    finally:
        cpp_extension._run_ninja_build = run

"""An op whose sources cannot share one unit compiles each torch-including source against one precompiled
torch header (backends/deepspeed/shared_header.py): each source once, from a wrapper that includes the shared
header first; the .gch is built with the op's flags from torch's build.ninja, used by every wrapper, built only
when ninja has a wrapper to compile and removed after; a wrapper that does not build falls back to DeepSpeed's
way once, for good."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

from megaframe.backends.deepspeed import build_locks
from megaframe.backends.deepspeed.one_unit import includes_torch
from megaframe.backends.deepspeed.shared_header import (PCH_PREFIX, compile_with_shared_header, precompile,
                                                        precompiled)


def _included(path: Path) -> list[str]:
    return re.findall(r'^#include ["<]([^">]+)[">]$', path.read_text(), flags=re.M)


def test_async_ios_torch_including_sources_compile_from_wrappers_of_one_header(tmp_path):
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    theirs = [str(Path(builder.deepspeed_src_path(s)).resolve()) for s in builder.sources()]
    include_dirs = [Path(builder.deepspeed_src_path(p)).resolve() for p in builder.include_paths()]
    header = compile_with_shared_header(builder, tmp_path)
    assert header == tmp_path / "async_io" / f"{PCH_PREFIX}async_io.h"  # torch's build folder of the op
    assert _included(header) == ["torch/extension.h"]
    ours = builder.sources()
    assert len(ours) == len(theirs)
    for mine, source in zip(ours, theirs):  # DeepSpeed's order, each source once: itself or its wrapper
        if includes_torch(Path(source), include_dirs):
            assert Path(mine).parent == header.parent and _included(Path(mine)) == [header.name, source]
        else:
            assert mine == source
    assert sum(mine != source for mine, source in zip(ours, theirs)) >= 2


class _Builder:
    """An op builder like async_io: two sources include torch through a header with no include guard (no unit
    for them), a third includes no torch. Its load fails while a wrapper is among its sources when `clash`."""
    loads: list[list[str]] = []

    def __init__(self, folder: Path, clash: bool = False):
        self.name, self.folder, self.clash = "fake_op", folder, clash
        (folder / "include" / "torch").mkdir(parents=True, exist_ok=True)
        # the stand-in for torch's header: it compiles only with the op's flag, as torch's needs the op's -std
        (folder / "include" / "torch" / "extension.h").write_text(
            "#pragma once\n#if OP_FLAG != 7\n#error built without the op's flags\n#endif\nstruct torch_t { int x; };\n")
        (folder / "unguarded.h").write_text("#include <torch/extension.h>\nstruct op_t { int y; };\n")
        for source in ("a.cpp", "b.cpp"):
            (folder / source).write_text(f'#include "unguarded.h"\nint {source[0]}() {{ return torch_t{{1}}.x; }}\n')
        (folder / "c.cpp").write_text("int c() { return 3; }\n")

    def sources(self):
        return ["a.cpp", "b.cpp", "c.cpp"]

    def include_paths(self):
        return ["include"]

    def deepspeed_src_path(self, path):
        return str(self.folder / path)

    def load(self, verbose=False):
        sources = [Path(self.deepspeed_src_path(s)).name for s in self.sources()]
        type(self).loads.append(sources)
        if self.clash and any(PCH_PREFIX in s for s in sources):
            raise RuntimeError("Error building extension 'fake_op'")


def _write_build_ninja(builder: _Builder, folder: Path) -> None:
    """What torch writes for the op: one compile rule with the op's flags (-MMD: user headers as dependencies)."""
    sources = [Path(builder.deepspeed_src_path(s)) for s in builder.sources()]
    lines = ["ninja_required_version = 1.3", "cxx = c++",
             f"cflags = -DOP_FLAG=7 -I{builder.folder / 'include'} -fPIC -O0", "post_cflags = ",
             "rule compile", "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out $post_cflags",
             "  depfile = $out.d", "  deps = gcc", "rule link", "  command = $cxx $in -shared -o $out"]
    lines += [f"build {s.stem}.o: compile {s}" for s in sources]
    lines += [f"build fake_op.so: link {' '.join(f'{s.stem}.o' for s in sources)}", "default fake_op.so"]
    (folder / "build.ninja").write_text("\n".join(lines) + "\n")


def test_the_precompiled_header_is_built_with_the_ops_flags_used_by_every_wrapper_and_removed(tmp_path):
    import torch.utils.cpp_extension as cpp_extension

    (tmp_path / "src").mkdir()
    builder = _Builder(tmp_path / "src")
    header = compile_with_shared_header(builder, tmp_path / "ext")
    folder = header.parent
    _write_build_ninja(builder, folder)
    warnings = []
    runner = cpp_extension._run_ninja_build
    with precompiled(header, warnings.append):
        cpp_extension._run_ninja_build(str(folder), False, "Error building extension")
    assert cpp_extension._run_ninja_build is runner  # torch's runner is its own again
    assert warnings == [] and (folder / "fake_op.so").is_file()
    assert not list(folder.glob("*.gch*"))  # 800 MB for async_io: only of use while the wrappers compile
    for stem in ("a", "b"):  # compiled from the .gch: the torch header was not read (it is a dependency of none)
        dependencies = subprocess.run(["ninja", "-t", "deps", f"{PCH_PREFIX}{stem}.o"], cwd=folder,
                                      capture_output=True, text=True, check=True).stdout
        assert f"src/{stem}.cpp" in dependencies and "extension.h" not in dependencies
    assert precompile(header) is None and not list(folder.glob("*.gch*"))  # nothing to compile: no .gch built


def test_a_header_that_does_not_precompile_is_one_warning_and_the_op_still_builds(tmp_path):
    import torch.utils.cpp_extension as cpp_extension

    (tmp_path / "src").mkdir()
    builder = _Builder(tmp_path / "src")
    header = compile_with_shared_header(builder, tmp_path / "ext")
    _write_build_ninja(builder, header.parent)
    build_file = header.parent / "build.ninja"
    build_file.write_text(build_file.read_text().replace("cflags = -DOP_FLAG=7", "cflags = -DOP_FLAG=7 -DSTAMP=a$$b"))
    warnings = []
    with precompiled(header, warnings.append):  # a flag written with a ninja escape: not read, no .gch
        cpp_extension._run_ninja_build(str(header.parent), False, "Error building extension")
    assert len(warnings) == 1 and "fake_op" in warnings[0] and "precompiled" in warnings[0]
    assert (header.parent / "fake_op.so").is_file()  # the wrappers parsed the header themselves


def test_wrappers_that_do_not_build_fall_back_to_deepspeeds_way_once_and_for_good(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    (tmp_path / "src").mkdir()
    _Builder.loads = []
    warnings = []
    build_locks._build_or_load(_Builder(tmp_path / "src", clash=True), warnings.append)
    assert _Builder.loads == [[f"{PCH_PREFIX}a.cpp", f"{PCH_PREFIX}b.cpp", "c.cpp"], ["a.cpp", "b.cpp", "c.cpp"]]
    assert len(warnings) == 1 and "fake_op" in warnings[0] and "precompiled torch header" in warnings[0]
    _Builder.loads = []
    build_locks._build_or_load(_Builder(tmp_path / "src", clash=True), warnings.append)  # the next run: no retry
    assert _Builder.loads == [["a.cpp", "b.cpp", "c.cpp"]] and len(warnings) == 1

"""The package's shape: no import cycle between megaframe's packages or files, DeepSpeed imported
only by its backend, an engine's folder reached only through backends/registry.py, DeepSpeed's
parameter marks only in its folder, no engine's name compared outside backends/, no docstring
pointing outside the repository. Read from the source with ast, so a
lazy import inside a function counts as much as one at the top."""
from __future__ import annotations

import ast
from pathlib import Path

MEGAFRAME = Path(__file__).resolve().parents[2] / "megaframe"


def _imports(path: Path) -> list[str]:
    """Every module name `path` imports, relative imports resolved."""
    package = ".".join(path.relative_to(MEGAFRAME.parent).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names.append(base)
    return names


def _unit(module: str) -> str | None:
    """The part of megaframe a module belongs to: its package (megaframe.X), or the top-level
    module itself (megaframe.train); None outside megaframe."""
    parts = module.split(".")
    if parts[0] != "megaframe":
        return None
    if len(parts) == 1:
        return "megaframe"
    top = MEGAFRAME / parts[1]
    return ".".join(parts[:2]) if top.is_dir() or (MEGAFRAME / f"{parts[1]}.py").exists() else "megaframe"


def _source_files() -> list[Path]:
    return sorted(MEGAFRAME.rglob("*.py"))


def _unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in _source_files():
        module = ".".join(path.relative_to(MEGAFRAME.parent).with_suffix("").parts)
        source = _unit(module.removesuffix(".__init__"))
        for name in _imports(path):
            target = _unit(name)
            if target and target != source and target != "megaframe":
                graph.setdefault(source, set()).add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path that ends where it starts, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_packages():
    graph = _unit_graph()
    assert "megaframe.training" in graph and "megaframe.backends" in graph, "the walk found no imports"
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_a_planted_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "d": {"a"}}) is None


def test_only_the_deepspeed_backend_imports_deepspeed():
    backend = MEGAFRAME / "backends" / "deepspeed"
    offenders = [str(path.relative_to(MEGAFRAME.parent)) for path in _source_files()
                 if backend not in path.parents
                 and any(name.split(".")[0] == "deepspeed" for name in _imports(path))]
    assert offenders == []
    assert any(name.startswith("deepspeed") for name in _imports(backend / "engine.py"))


def test_docstrings_cite_nothing_outside_the_repository():
    outside = ("/work/", "../shared", "briefs/")
    offenders = [f"{path.relative_to(MEGAFRAME.parent)}: {marker}" for path in _source_files()
                 for marker in outside if marker in path.read_text()]
    assert offenders == []


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(MEGAFRAME.parent).with_suffix("").parts).removesuffix(".__init__")


def _is_module(name: str) -> bool:
    relative = Path(*name.split("."))
    return (MEGAFRAME.parent / relative.with_suffix(".py")).exists() or (MEGAFRAME.parent / relative / "__init__.py").exists()


def _file_graph() -> dict[str, set[str]]:
    """Module -> the megaframe modules it imports, lazy imports included; `from P import m` counts as
    an import of the module P.m when m is one, else of P."""
    graph: dict[str, set[str]] = {}
    for path in _source_files():
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base
                           for alias in node.names]
            for target in targets:
                if target.split(".")[0] == "megaframe" and target != module and _is_module(target):
                    graph.setdefault(module, set()).add(target)
    return graph


def test_no_import_cycle_between_files():
    """Within a package too: two files that import each other (one of them inside a function, to
    dodge the import-time error) are one unit split in two, and the lazy import hides the knot."""
    graph = _file_graph()
    assert "megaframe.model.gpt" in graph.get("megaframe.model.factory", set()), "the walk found no file imports"
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def _engine_folders() -> list[Path]:
    return sorted(p for p in (MEGAFRAME / "backends").iterdir() if (p / "__init__.py").exists())


def test_only_the_registry_reaches_an_engine():
    """Outside an engine's own folder no file imports it (lazily or not): the trainer, the CLI, the
    planner and the dry run ask backends/registry.py, which names each engine's plug by a string.
    A second engine then touches its folder and one line of the registry."""
    from megaframe.backends.registry import ENGINES, PLAIN

    graph, folders = _file_graph(), _engine_folders()
    registered = sorted([*ENGINES, PLAIN.split(".")[2]])  # the named engines, and the one-process plain one
    assert [f.name for f in folders] == registered, "every engine folder is registered, and only those"
    offenders = []
    for folder in folders:
        package = f"megaframe.backends.{folder.name}"
        offenders += [f"{module} imports {target}" for module, targets in graph.items()
                      if not (module + ".").startswith(package + ".")
                      for target in targets if (target + ".").startswith(package + ".")]
    assert offenders == []
    assert "megaframe.backends.registry" in graph.get("megaframe.backends.deepspeed.plug", set())


# DeepSpeed's marks on parameters: the ds_* attributes zero.Init and its pipeline set or read, and
# the expert marks (allreduce, group_name) its MoE reduction reads
_DEEPSPEED_MARKS = ("allreduce", "group_name")


def _deepspeed_marks_in(path: Path) -> list[str]:
    """Each DeepSpeed parameter mark `path` sets or reads: p.ds_x / p.allreduce, or getattr(p, "ds_x")."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "setattr", "hasattr") and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
            name = node.args[1].value
        if isinstance(name, str) and (name.startswith("ds_") or name in _DEEPSPEED_MARKS):
            found.append(f"{path.relative_to(MEGAFRAME.parent)}:{node.lineno} {name}")
    return found


def test_deepspeeds_parameter_marks_stay_in_its_folder():
    """The model, the parallel layers, the gradient norm and the checkpoint code are the same for
    every engine: what DeepSpeed marks on a parameter (an expert's reduction group, a ZeRO-3
    partition's shape, a pipeline's tied copy) is set and read in backends/deepspeed/, and reaches
    the rest as a hook the engine passes in."""
    folder = MEGAFRAME / "backends" / "deepspeed"
    inside = [m for path in folder.rglob("*.py") for m in _deepspeed_marks_in(path)]
    assert any(m.endswith(" ds_shape") for m in inside) and any(m.endswith(" allreduce") for m in inside), inside
    outside = [m for path in sorted(MEGAFRAME.rglob("*.py")) if folder not in path.parents
               for m in _deepspeed_marks_in(path)]
    assert outside == []


# ---- engines' facts: no branch on the engine's name outside backends/ ---------------------------

def _engine_names() -> set[str]:
    from megaframe.backends.registry import ENGINES, PLAIN

    return {*ENGINES, PLAIN.split(".")[2]}


def _identifier(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _engine_name_compares(source: str, filename: str, names: set[str]) -> list[str]:
    """Each place `source` tests an engine's name: a comparison (==, !=, in, is, ...), a match case,
    or a str method (startswith, endswith, __eq__, ...) between a literal engine name (or a piece of
    one, three letters or more, or a name bound to such a literal, or a tuple of them) and an
    expression that reads an engine: any name or attribute in it says engine or backend
    (lay.engine, cfg.backend.name, engine_of(cfg)), or is a variable assigned from such an expression
    or looping over one. Scope-blind on purpose: a rename or a local copy does not hide the test."""
    tree = ast.parse(source, filename=filename)

    def literal(node: ast.AST, aliases: set[str]) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) >= 3:
            return any(node.value in name for name in names)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(literal(e, aliases) for e in node.elts)
        return isinstance(node, ast.Name) and node.id in aliases

    def reads_engine(node: ast.AST, tainted: set[str]) -> bool:
        return any((ident := _identifier(sub)) is not None
                   and ("engine" in ident.lower() or "backend" in ident.lower() or ident in tainted)
                   for sub in ast.walk(node))

    def bindings(node: ast.AST) -> list[tuple[list[ast.AST], ast.AST]]:
        """(targets, value) of assignments, loops and comprehensions: a target holds what value reads."""
        if isinstance(node, ast.Assign):
            return [(node.targets, node.value)]
        if isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            return [([node.target], node.value)]
        if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            return [([node.target], node.iter)]
        return []

    aliases: set[str] = set()
    tainted: set[str] = set()
    changed = True
    while changed:  # to a fixed point: a copy of a copy counts
        changed = False
        for node in ast.walk(tree):
            for targets, value in bindings(node):
                for target in targets:
                    for sub in ast.walk(target):
                        if not isinstance(sub, ast.Name):
                            continue
                        for found, test in ((aliases, literal), (tainted, reads_engine)):
                            if sub.id not in found and test(value, aliases if found is aliases else tainted):
                                found.add(sub.id)
                                changed = True
    offenders = []
    for node in ast.walk(tree):
        pairs: list[tuple[ast.AST, ast.AST]] = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            pairs = [(a, b) for a in operands for b in operands if a is not b]
        elif isinstance(node, ast.Match):
            pairs = [(node.subject, pattern.value) for case in node.cases for pattern in ast.walk(case.pattern)
                     if isinstance(pattern, ast.MatchValue)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "startswith", "endswith", "__eq__", "__ne__", "__contains__", "find", "index", "count"):
            pairs = [(node.func.value, arg) for arg in node.args]
        if any(literal(b, aliases) and reads_engine(a, tainted) for a, b in pairs):
            offenders.append(f"{filename}:{node.lineno} {ast.unparse(node)[:80]}")
    return offenders


def test_nothing_outside_the_backends_compares_the_engines_name():
    """The planner and validation ask the engine's facts (backends/facts.py: the stages it runs, its
    memory terms) and its rules instead of testing which engine it is: a third engine is its own
    folder, not a hunt for every `== "fsdp2"`. Inside backends/ the registry and the engines may."""
    names = _engine_names()
    assert names >= {"deepspeed", "fsdp2", "plain"}, names
    inside = MEGAFRAME / "backends"
    offenders = [hit for path in _source_files() if inside not in path.parents
                 for hit in _engine_name_compares(path.read_text(), str(path.relative_to(MEGAFRAME.parent)), names)]
    assert offenders == []
    registry = (inside / "registry.py").read_text()  # the check sees the comparisons that are allowed there
    assert _engine_name_compares(registry, "registry.py", names)


def test_the_engine_name_check_finds_planted_comparisons():
    names = {"deepspeed", "fsdp2", "plain"}
    planted = {
        'if lay.engine == "fsdp2": pass': True,
        'x = cfg.backend.name != "deepspeed"': True,
        'x = "plain" in (self.engine, other)': True,
        'x = cfg.backend.name in ("fsdp2", "megatron")': True,
        'n = cfg.backend.name\nm = n\nif m == "fsdp2": pass': True,  # a copy of a copy
        'FSDP = "fsdp2"\nif lay.engine == FSDP: pass': True,  # the literal behind a constant
        'x = cfg.backend.name.startswith("fsdp")': True,  # a piece of the name
        'for e in cfg.plan.engines:\n    if e == "deepspeed": pass': True,
        'match cfg.backend.name:\n    case "fsdp2": pass': True,
        'x = engine_of(cfg) == "deepspeed"': True,
        'x = fmt == "plain"': False,  # the word, not an engine
        'x = lay.engine != DEFAULT': False,  # asks the registry's default, names no engine
        'x = name == base.engine': False,
        'x = {"deepspeed": 0}[cfg.backend.name]': False,  # a table keyed by name is not a comparison (config/schema.py's ENGINE_ZERO_STAGE, the one left)
    }
    for source, flagged in planted.items():
        assert bool(_engine_name_compares(source, "planted.py", names)) is flagged, source


def _entry_points() -> set[str]:
    """megaframe's entry points: the modules [project.scripts] in pyproject.toml names (megaframe-train's
    is megaframe/train.py, which every rank also runs as `python -m megaframe.train`)."""
    import tomllib

    scripts = tomllib.loads((MEGAFRAME.parent / "pyproject.toml").read_text())["project"]["scripts"]
    return {target.split(":")[0] for target in scripts.values()}


def _importers_of(package: str, graph: dict[str, set[str]], allowed: set[str]) -> list[str]:
    """'A imports B' for every module A outside `package` and not in `allowed` that imports B in it."""
    return [f"{module} imports {target}" for module, targets in sorted(graph.items())
            if module not in allowed and not (module + ".").startswith(package + ".")
            for target in sorted(targets) if (target + ".").startswith(package + ".")]


def test_only_the_entry_points_import_launch():
    """launch/ is the top floor (argv, the checks before launch, the launchers, Hydra's run): a
    module below it that imported it would make the layers a knot, so only the entry points do."""
    entry = _entry_points()
    assert "megaframe.train" in entry and "megaframe.plan.console" in entry, entry
    graph = _file_graph()
    assert "megaframe.launch.main" in graph.get("megaframe.train", set()), "megaframe-train starts in launch/"
    assert _importers_of("megaframe.launch", graph, entry) == []


def test_the_launch_check_finds_a_planted_importer():
    graph = {"megaframe.train": {"megaframe.launch.main"}, "megaframe.launch.main": {"megaframe.launch.base"},
             "megaframe.training.trainer": {"megaframe.launch.base", "megaframe.launcher_x"}}
    assert _importers_of("megaframe.launch", graph, {"megaframe.train"}) == [
        "megaframe.training.trainer imports megaframe.launch.base"]
    assert _importers_of("megaframe.launch", graph, {"megaframe.train", "megaframe.training.trainer"}) == []


def _outside_imports(package: str, graph: dict[str, set[str]]) -> list[str]:
    """'A imports B' for every module A in `package` that imports a megaframe module B outside it."""
    def inside(name: str) -> bool:
        return (name + ".").startswith(package + ".")

    return [f"{module} imports {target}" for module, targets in sorted(graph.items()) if inside(module)
            for target in sorted(targets) if not inside(target)]


def test_common_imports_nothing_of_megaframe():
    """megaframe/common/ holds the leaves (atomic_io, failures, paths, run_lock, ...) every floor uses:
    one that imported megaframe above it would tie every floor to that module."""
    graph = _file_graph()
    assert "megaframe.common.safe_files" in graph.get("megaframe.common.atomic_io", set()), "no imports found"
    assert _outside_imports("megaframe.common", graph) == []


def test_the_common_check_finds_a_planted_import():
    graph = {"megaframe.common.atomic_io": {"megaframe.common.safe_files"},
             "megaframe.common.failures": {"megaframe.config.schema"},
             "megaframe.training.trainer": {"megaframe.common.paths"}}
    assert _outside_imports("megaframe.common", graph) == ["megaframe.common.failures imports megaframe.config.schema"]


# ---- the trainer talks to a Backend, never to the engine's model behind it ----------------------

def _module_reads(path: Path) -> list[str]:
    """Each `.module` `path` reads: x.module, or getattr(x, "module")."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "module":
            found.append(f"{path.name}:{node.lineno}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "module"):
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_the_module_finder_finds_a_planted_read(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f(backend):\n    x = 1\n    return backend.module.rng, getattr(backend, 'module')\n")
    assert _module_reads(planted) == ["planted.py:3", "planted.py:3"]
    planted.write_text("def f(backend):\n    return backend.hook_forward(print)\n")
    assert _module_reads(planted) == []


def test_training_never_reads_the_backends_module():
    """The training loop talks to a Backend through its methods, never to the engine's model behind
    it (Backend.module): the RNG, router biases and fault hooks an engine holds reach the trainer as
    the backend's own calls (state_parts, hook_forward), so a new engine implements the Protocol and
    nothing in training/ changes."""
    reads = [read for path in sorted((MEGAFRAME / "training").rglob("*.py")) for read in _module_reads(path)]
    assert reads == [], "Backend.module read in megaframe/training/ at " + ", ".join(reads)


def test_the_wheel_lists_every_package():
    """setuptools ships only the packages pyproject.toml names: a package folder left out of the
    list is missing from an installed wheel (backend=fsdp2 and one-process runs failed so, with
    megaframe.backends.fsdp2 and .plain unlisted, while an editable install hid it)."""
    import tomllib

    listed = set(tomllib.loads((MEGAFRAME.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(init.parent.relative_to(MEGAFRAME.parent).parts)
               for folder in ("megaframe", "hydra_plugins") for init in (MEGAFRAME.parent / folder).rglob("__init__.py")}
    assert on_disk - listed == set(), f"packages missing from pyproject.toml [tool.setuptools] packages: {sorted(on_disk - listed)}"


# ---- one attention core per run, chosen in one place -------------------------------------------

# what computes attention (SDPA, its aten ops, the cp kernels) or picks how: the cores and their table
_ATTENTION_NAMES = {"scaled_dot_product_attention", "ring_attention", "ulysses_attention", "AttentionDropout",
                    "SDPACore", "RingCore", "UlyssesCore", "_CP_CORES"}
# model/attention.py chooses the core; parallel/ holds the kernels it wraps (and their own SDPA calls)
_ATTENTION_HOMES = {"megaframe/model/attention.py", "megaframe/parallel/context.py", "megaframe/parallel/ring.py",
                    "megaframe/parallel/attention_blocks.py"}


def _attention_kernel_uses(source: str, filename: str) -> list[str]:
    """Each place `source` names an attention kernel or core: a call, a reference handed on, an
    import, or an aten `_scaled_dot_product_*` op."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        names = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
        if any(n in _ATTENTION_NAMES or n.startswith("_scaled_dot_product") for n in names):
            found.append(f"{filename}:{node.lineno}")
    return found


def test_the_attention_core_is_chosen_in_one_place():
    """Attention runs through the core build_attention_core (model/attention.py) picks once per run:
    nothing else calls SDPA or a cp kernel, or builds a core, so a new attention variant is a core
    there and not another branch in a block (issue 54)."""
    offenders = [hit for path in _source_files() if str(path.relative_to(MEGAFRAME.parent)) not in _ATTENTION_HOMES
                 for hit in _attention_kernel_uses(path.read_text(), str(path.relative_to(MEGAFRAME.parent)))]
    assert offenders == [], "attention computed or chosen outside model/attention.py at " + ", ".join(offenders)
    home = MEGAFRAME / "model" / "attention.py"  # the check sees the uses that are allowed there
    assert len(_attention_kernel_uses(home.read_text(), "attention.py")) >= 4


def test_the_attention_check_finds_planted_uses():
    planted = {
        "y = F.scaled_dot_product_attention(q, k, v, is_causal=True)": True,
        "from torch.nn.functional import scaled_dot_product_attention as sdpa": True,
        "y = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)": True,
        "attend = ring_attention if impl == 'ring' else ulysses_attention": True,
        "from megaframe.parallel.ring import ring_attention": True,
        "core = RingCore(0.0, None, cp)": True,
        "d = AttentionDropout(p, seed)": True,
        "core = build_attention_core(p, rng, gqa, context, cp_impl)": False,  # asking the one place
        "y = self.core(q, k, v, self.mask)": False,
        "y = decode_attention(q, k, v, past, gqa)": False,
    }
    for source, flagged in planted.items():
        assert bool(_attention_kernel_uses(source, "planted.py")) is flagged, source


# ---- the model's weight matmuls go through one seam -----------------------------------------------

_MATMUL_SEAM = MEGAFRAME / "parallel" / "matmul.py"
_MATMUL_CALLS = {"F.linear", "functional.linear", "torch.nn.functional.linear", "torch._grouped_mm",
                 "torch.matmul", "torch.mm", "torch.bmm", "torch.addmm", "torch.baddbmm"}


def _direct_matmuls(path: Path) -> list[str]:
    """Each matmul `path` computes without the seam: a call of torch's linear, grouped GEMM or
    matmul functions, an import of them by name, or the `@` operator (attention's activation
    products use einsum, so every `@` here would be a weight matmul)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in _MATMUL_CALLS:
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            found.append(f"{path.name}:{node.lineno} @")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch") and any(
                alias.name in ("linear", "_grouped_mm", "matmul", "mm", "bmm") for alias in node.names):
            found.append(f"{path.name}:{node.lineno} import")
    return found


def test_the_matmul_finder_finds_planted_matmuls(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import torch\nimport torch.nn.functional as F\nfrom torch.nn.functional import linear\n"
                       "def f(x, w, o):\n    a = F.linear(x, w)\n    b = torch._grouped_mm(x, w, offs=o)\n"
                       "    return x @ w.t(), torch.nn.functional.linear(x, w), torch.matmul(x, w)\n")
    assert _direct_matmuls(planted) == ["planted.py:3 import", "planted.py:5 F.linear", "planted.py:6 torch._grouped_mm",
                                        "planted.py:7 @", "planted.py:7 torch.nn.functional.linear",
                                        "planted.py:7 torch.matmul"]
    planted.write_text("import torch\ndef f(site, x, w):\n    return site.linear(x, w), torch.einsum('ij,jk->ik', x, w)\n")
    assert _direct_matmuls(planted) == []


def test_the_models_weight_matmuls_go_through_the_seam():
    """Every weight matmul of the model (TP linears, the LM head, the router, the expert GEMM)
    computes through parallel/matmul.py's recipe, where a precision recipe (fp8) plugs in before the
    model is built: one that called torch directly would silently stay in the model's dtype."""
    paths = [path for package in ("model", "parallel") for path in sorted((MEGAFRAME / package).rglob("*.py"))
             if path != _MATMUL_SEAM]
    assert len(paths) > 10 and _direct_matmuls(_MATMUL_SEAM), "the walk found no files or the seam no matmul"
    found = [hit for path in paths for hit in _direct_matmuls(path)]
    assert found == [], "matmuls outside parallel/matmul.py: " + ", ".join(found)

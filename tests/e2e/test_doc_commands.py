"""Every megaframe-* command in README.md and docs/*.md does what its guide says (issue 34): run
blocks run (guide by guide, in reverse order, in one directory all the guides share) and exit as
marked; the other megaframe-train commands pass the pre-launch checks; megaframe-plan commands run.
A documented command that is refused as written fails here. The markers: tests/support/doc_commands.py."""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.console_zygote import console_scripts
from tests.support.doc_commands import GUIDES, REPO, Block, all_blocks, guide_paths, shown_plans
from tests.support.helpers import cli_env

BLOCKS = all_blocks()
FILE_COMMANDS = ("megaframe-eval", "megaframe-convert", "megaframe-preprocess", "megaframe-sample")


def _validated() -> list[tuple[str, list[str], str]]:
    """Every command of the blocks that do not run, and the plans a run block quotes figures of (its
    run checks the exit code, not the figures)."""
    return [(f"{block.where} {' '.join(words[:3])}", words, comment)
            for block in BLOCKS for words, comment in block.commented_commands()
            if not block.run or (words[0] == "megaframe-plan" and "GiB" in comment)]


def _train_problem(args: list[str]) -> str | None:
    """What megaframe-train would refuse before launch, in one line, or None: composition,
    validation at the world it would start, the planner's fit and an elastic job's whole range.
    What depends on this host (sbatch, Ray, the dataset's files) is left out."""
    from megaframe.launch.elastic import check_range
    from megaframe.launch.slurm import job_world_size as slurm_world_size
    from megaframe.backends.registry import validate_for_engine
    from megaframe.config.compose import compose
    from megaframe.config.validate import ConfigError, requested_world_size
    from megaframe.plan.cli import fit_problem
    from megaframe.launch.sweep import check_sweep

    def check_point(point: list[str]) -> None:
        cfg, _ = compose(point)
        if cfg.launcher.min_nodes is not None:
            stderr = io.StringIO()
            try:
                with contextlib.redirect_stderr(stderr):
                    check_range(cfg, point)  # exits 2 with one line, as before launch
            except SystemExit:
                raise ConfigError(stderr.getvalue().strip()) from None
        layout = validate_for_engine(cfg, slurm_world_size(cfg) or requested_world_size(cfg), ask_bf16=False)
        if problem := fit_problem(cfg, layout):
            raise ConfigError(problem)

    # megaframe-train replaces train.resume=latest-run by the run it picks before composing (resume_hint.py,
    # run by tests/e2e/test_resume_hint.py); composed as it stands, validation refuses it as unresolved
    args = ["train.resume=auto" if a == "train.resume=latest-run" else a for a in args]
    flags = [a for a in args if a in ("-m", "--multirun")]
    rest = [a for a in args if a not in flags]
    check = check_point
    if "--cfg" in rest or "-c" in rest:  # Hydra prints the composed config: composition is all it does
        at = rest.index("--cfg") if "--cfg" in rest else rest.index("-c")
        rest, check = rest[:at] + rest[at + 2:], compose
    try:  # compose() refuses renamed keys and unknown recipes itself
        if flags:
            check_sweep(rest, check)
        else:
            check(rest)
    except ConfigError as err:
        return str(err)
    return None


def _parsers() -> dict:
    from megaframe.convert.cli import build_parser as convert_parser
    from megaframe.data.preprocess_cli import build_parser as preprocess_parser
    from megaframe.eval_cli import build_parser as eval_parser
    from megaframe.sample_cli import build_parser as sample_parser

    return {"megaframe-convert": convert_parser, "megaframe-eval": eval_parser,
            "megaframe-preprocess": preprocess_parser, "megaframe-sample": sample_parser}


@pytest.mark.parametrize("where, words, comment", _validated(), ids=[w for w, *_ in _validated()])
def test_a_documented_command_passes_the_checks_before_launch(where, words, comment, capsys, monkeypatch, tmp_path):
    """... and a plan's figures that the command's comment quotes ("# tp=8 dp=16: 19.42 GiB of 80") are the
    ones it prints now: a planner change that moves them leaves no stale figure in a guide."""
    name, args = words[0], words[1:]
    if name in FILE_COMMANDS:  # its files are the user's: its arguments must parse (argparse exits 2 if not)
        _parsers()[name]().parse_args(args)
        return
    if name == "megaframe-plan":
        from megaframe.plan.cli import main

        with pytest.raises(SystemExit) if "--help" in args else contextlib.nullcontext():
            main(args)
        printed = capsys.readouterr()
        assert "error" not in printed.err, where
        stale = [f for f in re.findall(r"\d[\d,]*\.\d+ GiB", comment)  # each a whole figure of the output
                 if not re.search(rf"(?<![\d.,]){re.escape(f)}", printed.out)]
        assert not stale, f"{where}: the comment quotes {stale}, the plan now prints:\n{printed.out}"
        return
    assert name == "megaframe-train", f"{where}: no check for {name}; run it in a <!-- doc-test: run --> block"
    monkeypatch.chdir(tmp_path)
    _stand_in_user_files(args, tmp_path)
    problem = _train_problem(args)
    assert problem is None, f"{where}: refused as written: {problem}"


@pytest.mark.parametrize("where, words, shown", shown_plans(), ids=[w for w, *_ in shown_plans()])
def test_a_plan_output_a_guide_shows_is_what_the_plan_prints(where, words, shown, capsys):
    """A guide's ```text block of megaframe-plan's output (of the last megaframe-plan command above it)
    is what that command prints now, line for line, where "…" stands for lines left out."""
    from megaframe.plan.cli import main

    main(words[1:])
    captured = capsys.readouterr()  # its notes (stderr) come before the plan, as a terminal shows them
    printed = [line.rstrip() for line in (captured.err + captured.out).rstrip("\n").split("\n")]
    parts, part = [], []
    for line in (line.rstrip() for line in shown):
        if line == "…":
            parts.append(part)
            part = []
        else:
            part.append(line)
    parts.append(part)
    at = 0
    for n, part in enumerate(parts):  # each part in order; the first at the top
        starts = [i for i in range(at, len(printed) - len(part) + 1) if printed[i:i + len(part)] == part]
        assert starts and (n > 0 or starts[0] == 0), f"{where}: the guide shows {part}, the plan prints:\n" + \
            "\n".join(printed)
        at = starts[0] + len(part)
    assert len(parts) > 1 or at == len(printed), f"{where}: the plan prints more:\n" + "\n".join(printed[at:])


def test_the_planners_recipe_table_is_what_the_planner_says_now():
    """docs/planner.md's table of every recipe's peak per GPU is tools/recipe_table.py's output: a planner
    change that moves a figure leaves no stale row (mixtral's 43.3 GiB outlived two such changes)."""
    table = subprocess.run([sys.executable, "tools/recipe_table.py", "cluster=h100_80g"], cwd=REPO, env=_environment(),
                           capture_output=True, text=True, timeout=600)
    assert table.returncode == 0, table.stderr[-3000:]
    rows = table.stdout.strip().splitlines()
    guide = (REPO / "docs" / "planner.md").read_text().splitlines()
    at = guide.index(rows[0])
    assert guide[at:at + len(rows)] == rows, "docs/planner.md's recipe table differs from:\n" + table.stdout


def _stand_in_user_files(args: list[str], cwd: Path) -> None:
    """The user's own files, taken as present where a command names them (relative paths, as the
    guides write them): a tokenizer directory (validation asks only that it be one) and a small
    byte-level dataset at data.path / data.valid_path (validation opens its header)."""
    from megaframe.data import preprocess

    for arg in args:
        key, _, value = arg.partition("=")
        if not value or value in ("byte", "null") or Path(value).is_absolute():
            continue
        if key == "data.tokenizer":
            (cwd / value).mkdir(parents=True, exist_ok=True)
        elif key in ("data.path", "data.valid_path") and not Path(f"{cwd / value}.bin").exists():
            text = cwd / "stand_in.txt"
            text.write_text("a stand-in for the user's corpus. " * 400)
            preprocess([text], cwd / value, "byte")


def _environment() -> dict[str, str]:
    """cli_env() with the console scripts (beside this interpreter) first on PATH."""
    env = cli_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("WANDB_MODE", "disabled")
    return env


def _guides_with_runs() -> list[Path]:
    return [guide for guide in GUIDES if any(block.run for block in BLOCKS if block.guide == guide)]


@pytest.fixture(scope="module")
def shared_directory(tmp_path_factory) -> Path:
    """One directory for every guide's run blocks, as a user who follows several guides has."""
    return tmp_path_factory.mktemp("guides")


@pytest.fixture(scope="module")
def guide_environment(tmp_path_factory):
    """_environment(), where megaframe-train, -eval, -convert, ... found on PATH fork from one warm
    interpreter (tests/support/console_zygote.py): each command line runs as written, without its 6 CPU-s
    of imports."""
    with console_scripts(_environment(), tmp_path_factory.mktemp("console-scripts")) as env:
        yield env


# in reverse order: getting-started.md runs before checkpoints.md (issue 51: the guides run in any order)
@pytest.mark.slow
@pytest.mark.parametrize("guide", _guides_with_runs()[::-1], ids=lambda g: str(g.relative_to(REPO)))
def test_a_guides_run_blocks_run_as_written(guide, shared_directory, guide_environment):
    """The guide's run blocks in order, each line as bash runs it, in the directory all the guides
    share (the file runs on one test worker: --dist loadfile). A refusal before launch (exit 2) runs
    the installed console scripts themselves, each a fresh interpreter: what a user's terminal shows."""
    fresh = _environment()
    for block in (b for b in BLOCKS if b.guide == guide and b.run):
        _run_block(block, shared_directory, fresh if block.exit_code == 2 else guide_environment)


def test_no_two_guides_share_a_path_and_none_reads_anothers():
    """The guides run in any order in one directory: no two of them write the same run directory,
    dataset or file, and none reads what only another writes (checkpoints.md once resumed
    getting-started.md's finished runs/demo, and its resume demo silently did nothing)."""
    paths = {guide.name: guide_paths(guide) for guide in GUIDES}
    shared = sorted({f"{min(a, b)} and {max(a, b)}: {path}" for a, pa in paths.items() for b, pb in paths.items()
                     if a != b for path in pa.writes if pb.owns(path)})
    assert not shared, shared
    foreign = sorted(f"{name} reads {path}" for name, p in paths.items() for path in p.reads if not p.owns(path))
    assert not foreign, foreign


def _run_block(block: Block, cwd: Path, env: dict[str, str]) -> None:
    if block.exit_code == 0:
        script = "set -euo pipefail\n" + "\n".join(block.lines)
        done = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (f"{block.where}: exit {done.returncode}\nSTDOUT:\n{done.stdout[-3000:]}\n"
                                      f"STDERR:\n{done.stderr[-3000:]}")
        return
    for line in block.lines:
        done = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == block.exit_code, (f"{block.where}: `{line}` exited {done.returncode}, the guide "
                                                    f"says {block.exit_code}\nSTDERR:\n{done.stderr[-3000:]}")
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, f"{block.where}: a refusal is one line, got:\n{done.stderr[-3000:]}"
        # the refusal the guide shows below the block is the one printed now ("…" stands for what this
        # host decides, such as its memory)
        shown = [re.compile(".*".join(map(re.escape, text.split("…")))) for text in block.shown]
        assert not shown or any(s.fullmatch(lines[0]) for s in shown), (
            f"{block.where}: `{line}` now prints\n{lines[0]}\nthe guide shows\n" + "\n".join(block.shown))


def test_every_guide_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    missing = [g.name for g in GUIDES[1:] if f"docs/{g.name}" not in readme]
    assert not missing, f"README.md does not link {missing}"

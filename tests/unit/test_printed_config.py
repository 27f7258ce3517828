"""`megaframe-train --cfg job OVERRIDES` (the documented preview of a command) composes as a run
would (megaframe/launch/main.py printed_config_problem): a mistyped key, group or value is one line,
where Hydra printed its own multi-line error and exit 1."""
from __future__ import annotations

import pytest

from megaframe.launch.main import printed_config_problem


@pytest.mark.parametrize("args, said", [
    (["--cfg", "job", "model.hiden_size=1"], "unknown key 'model.hiden_size'"),
    (["--cfg", "job", "model=foo"], "model=foo: no such option"),
    (["--cfg=job", "--resolve", "train.max_steps=x"], "train.max_steps: Value 'x'"),
    (["-c", "all", "-p", "model", "train.max_steps=x"], "train.max_steps: Value 'x'"),
])
def test_a_previewed_command_with_a_mistake_is_one_line(args, said):
    problem = printed_config_problem(args)
    assert problem is not None and said in problem and "\n" not in problem, problem


@pytest.mark.parametrize("args", [
    ["--cfg", "job", "model.hidden_size=128"],  # a good preview: Hydra prints it
    ["-m", "--cfg", "job", "optim.lr=1e-3,2e-3"],  # a sweep: its own checks (launch/sweep.py)
    ["--help"], ["--cfg", "job", "--config-name", "other"],  # not a preview of megaframe's config
])
def test_what_is_not_a_previewed_run_is_left_to_hydra(args):
    assert printed_config_problem(args) is None


def test_two_of_hydras_modes_at_once_are_one_line():
    """-m with --cfg job was Hydra's ValueError traceback."""
    from megaframe.launch.main import modes_problem

    assert modes_problem(["-m", "--cfg", "job", "optim.lr=1e-3,2e-3"]) == (
        "-m and --cfg: Hydra runs one of -m, --cfg, --info and --shell-completion at a time; drop all but one")
    assert modes_problem(["--cfg=job", "--multirun"]) is not None
    assert modes_problem(["-m", "optim.lr=1e-3,2e-3"]) is None and modes_problem(["--cfg", "job", "-p", "model"]) is None


@pytest.mark.parametrize("flag", ["--config-name", "-cn", "--config-path", "-cp"])
def test_another_primary_config_is_one_line_naming_the_flag_and_the_way_in(flag):
    """--config-name was Hydra's multi-line "Cannot find primary config" with exit 1 (hostile review)."""
    from megaframe.launch.main import modes_problem

    problem = modes_problem([flag, "mine", "train.max_steps=2"])
    assert problem.startswith(f"{flag}: megaframe composes its own primary config (conf/config.yaml)")
    assert "--config-dir DIR GROUP=NAME" in problem and "\n" not in problem


@pytest.mark.parametrize("arg", ["--foo", "--max-steps=3", "-x"])
def test_a_dashed_argument_that_is_no_flag_is_one_line(arg):
    """Hydra's parser answered with its lexer's exception text (LexerNoViableAltException: --foo ^)."""
    from megaframe.config.compose import override_problem

    assert override_problem([arg, "train.max_steps=3"]).startswith(f"{arg}: not an option of this command")
    assert override_problem(["--cfg", "job", "train.max_steps=3"]) is None


def test_the_flags_megaframe_leaves_to_hydra_are_hydras():
    """HYDRA_FLAGS is what Hydra's own argument parser takes: none is called "not an option"."""
    from hydra._internal.utils import get_args_parser

    from megaframe.config.compose import HYDRA_FLAGS

    hydras = {flag for action in get_args_parser()._actions for flag in action.option_strings}
    assert set(HYDRA_FLAGS) == hydras

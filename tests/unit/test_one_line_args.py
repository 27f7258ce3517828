"""Every tool's bad flag is one line naming --help, exit 2 (common/one_line_args.py): megaframe-convert
and megaframe-preprocess printed argparse's usage block of four to six lines before the error."""
from __future__ import annotations

import pytest

from megaframe import eval_cli, sample_cli
from megaframe.convert import cli as convert_cli
from megaframe.data import preprocess_cli


@pytest.mark.parametrize("parser, argv, line", [
    (convert_cli.build_parser, ["to-hf", "--bogus"],
     "megaframe-convert to-hf: error: the following arguments are required: ckpt, out "
     "(see megaframe-convert to-hf --help)"),
    (convert_cli.build_parser, [], "megaframe-convert: error: the following arguments are required: command "
                                   "(see megaframe-convert --help)"),
    (preprocess_cli.build_parser, ["--input", "x", "--output-prefix", "y", "--workers", "abc"],
     "megaframe-preprocess: error: argument --workers: invalid int value: 'abc' (see megaframe-preprocess --help)"),
    (sample_cli.build_parser, ["ckpt", "--top-k", "x"],
     "megaframe-sample: error: argument --top-k: invalid int value: 'x' (see megaframe-sample --help)"),
    (eval_cli.build_parser, [], "megaframe-eval: error: the following arguments are required: checkpoint, "
                                "overrides (see megaframe-eval --help)"),
])
def test_a_bad_flag_is_one_line_naming_help(parser, argv, line, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        parser().parse_args(argv)
    assert (done.value.code, capsys.readouterr().err) == (2, line + "\n")

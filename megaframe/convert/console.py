"""megaframe-convert's console entry point: the tool (convert/cli.py) imports torch as it loads, a
second or more, so it is imported inside the Ctrl-C guard (common/ctrl_c.py)."""
from __future__ import annotations

from typing import Optional, Sequence

from megaframe.common.ctrl_c import interrupted_in_one_line


def main(argv: Optional[Sequence[str]] = None) -> None:
    with interrupted_in_one_line("megaframe-convert"):
        from megaframe.convert.cli import main as convert

        convert(argv)

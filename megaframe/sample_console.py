"""megaframe-sample's console entry point: the tool (sample_cli.py) imports argparse, io and
megaframe's modules as it loads, so it is imported inside the Ctrl-C guard (common/ctrl_c.py), as
megaframe-plan's is; a Ctrl-C during those imports printed a KeyboardInterrupt traceback (review)."""
from __future__ import annotations

from megaframe.common.ctrl_c import interrupted_in_one_line


def main() -> None:
    with interrupted_in_one_line("megaframe-sample"):
        from megaframe.sample_cli import main as sample

        sample()

"""megaframe-preprocess's console entry point: the tool (data/preprocess_cli.py) imports numpy, tqdm
and the dataset writers as it loads, about 0.1 s, so it is imported inside the Ctrl-C guard
(common/ctrl_c.py); from then on the tool's own stop handling answers a signal."""
from __future__ import annotations

import sys

from megaframe.common.ctrl_c import interrupted_in_one_line


def main() -> None:
    with interrupted_in_one_line("megaframe-preprocess"):
        from megaframe.data.preprocess_cli import main as preprocess

        code = preprocess()
    sys.exit(code)

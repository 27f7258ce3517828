"""Ctrl-C in a tool that has no stop handling of its own at that moment (its imports, a planner's
search, an evaluation): one line and exit 130, as megaframe-train and megaframe-sample end, not the
traceback of wherever the KeyboardInterrupt landed (torch's import machinery printed 50 lines)."""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator


@contextlib.contextmanager
def interrupted_in_one_line(prog: str) -> Iterator[None]:
    """Within the block, a KeyboardInterrupt ends the process with `PROG: interrupted` and exit 130
    (128 + SIGINT, docs/failures.md)."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None

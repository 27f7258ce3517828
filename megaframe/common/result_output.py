"""A tool's result on standard output, written whole or said in one line why not.

megaframe-eval, -sample and -plan print their result last. A reader that closed the pipe
(`| head`, `| true`) ended them in a BrokenPipeError traceback; a full disk or a quota behind a
redirect (`> result.txt`) in an OSError traceback; a closed stdout (`>&-`) made them exit 0 having
printed nothing. Here a closed pipe is the reader's choice (exit 0, as megaframe-convert's summary
ends), a write that fails or a closed stdout is one line and exit 1 (docs/failures.md). Python
flushes stdout once more as it exits: it is pointed at /dev/null first, so that flush cannot fail
again and print "Exception ignored"."""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

EXIT_NOT_WRITTEN = 1  # docs/failures.md's exit 1 for the tools: a write failed (as megaframe-preprocess's)


def require_stdout(prog: str) -> None:
    """Before the work: a tool started with stdout closed (`>&-`) would evaluate or generate for
    hours and then print nothing (Python made print() a no-op)."""
    if sys.stdout is None:
        _fail(prog, "standard output is closed, so the result cannot be printed; run it with stdout open "
                    "(a file or a pipe)")


@contextlib.contextmanager
def printed_to_stdout(prog: str) -> Iterator[None]:
    """Around the printing of a tool's result (flushed before the block ends)."""
    require_stdout(prog)
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:  # the reader has what it wanted
        _stdout_to_devnull()
    except OSError as err:
        _stdout_to_devnull()
        _fail(prog, f"cannot write the result to standard output ({err.strerror or err}); free space where "
                    f"it goes (a full disk or a quota) or print it elsewhere")


def _fail(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_NOT_WRITTEN)


def _stdout_to_devnull() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)

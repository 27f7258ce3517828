"""argparse for megaframe's tools whose refusals are one line: argparse's own prints a usage block of
up to eight lines before its error, which a scheduler's log or a wrapper script then shows as the
failure. Exit code 2, as argparse's."""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser (its subcommands' parsers too) refusing in one line that names --help."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr, flush=True)
        sys.exit(2)

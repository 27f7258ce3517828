"""Plot one or more megaframe runs: loss and eval loss against tokens, tokens/s against step.

usage: python tools/plot_run.py RUN_DIR [RUN_DIR ...] [--out runs.png]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
try:
    import megaframe  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from megaframe.tracking.plot import plot_runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="megaframe run directories (with metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=Path("runs.png"), help="PNG to write (default runs.png)")
    args = parser.parse_args()
    try:
        out = plot_runs(args.run_dirs, args.out)
    except ValueError as err:
        print(f"plot_run: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

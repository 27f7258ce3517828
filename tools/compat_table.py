"""Print, write or check docs/parallelism.md's ZeRO x offload x precision x layout compatibility table.

usage: python tools/compat_table.py [--write | --check] [--readme docs/parallelism.md]

The table comes from megaframe/backends/deepspeed/compat.py, which asks validation, with DeepSpeed's
rules (backends/deepspeed/rules.py), about every combination. --write replaces the table between
the guide's compat-table markers; --check exits 1 when its table differs from what the rules say
(tests/unit/backends/test_compat.py does the same).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megaframe.backends.deepspeed.compat import markdown, with_table  # noqa: E402
from megaframe.common.atomic_io import atomic_write_text  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the table in the guide")
    mode.add_argument("--check", action="store_true", help="exit 1 when the guide's table is out of date")
    parser.add_argument("--readme", type=Path, default=REPO / "docs" / "parallelism.md",
                        help="the Markdown file holding the table's markers")
    args = parser.parse_args()
    if not (args.write or args.check):
        print(markdown(), end="")
        return 0
    current = args.readme.read_text()
    wanted = with_table(current)
    if args.check:
        if wanted != current:
            print(f"{args.readme}: the compatibility table is out of date; run python tools/compat_table.py --write",
                  file=sys.stderr)
            return 1
        return 0
    if wanted != current:
        atomic_write_text(args.readme, wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())

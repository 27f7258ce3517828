"""megaframe-plan's console entry point: the planner (plan/cli.py) loads the config schema, the
recipes' registry and the engines' rules as it is imported, about 0.1 s, so it is imported inside the
Ctrl-C guard (common/ctrl_c.py), as megaframe-convert's is."""
from __future__ import annotations

from megaframe.common.ctrl_c import interrupted_in_one_line


def main() -> None:
    with interrupted_in_one_line("megaframe-plan"):
        from megaframe.plan.cli import main as plan

        plan()

"""docs/planner.md's recipe table: every recipe's size, its authors' layout and the planner's memory per GPU.

    python tools/recipe_table.py [cluster=h100_80g] [MORE OVERRIDES]
"""
from __future__ import annotations

import contextlib
import sys

from megaframe.config.compose import compose
from megaframe.common.paths import recipes_dir
from megaframe.plan.cli import plan, planned_world_size
from megaframe.plan.memory import GIB


def main(extra: list[str]) -> None:
    extra = extra or ["cluster=h100_80g"]
    print("| recipe | parameters (active) | layout (tp × pp × dp, and cp, ep where used) | ZeRO | GPUs | planner peak per GPU | fits |")
    print("|---|---|---|---|---|---|---|")
    for path in sorted(recipes_dir().glob("*.yaml")):
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's notices are not table rows
            cfg, _ = compose([f"recipe={path.stem}", *extra])
            layout, est, _ = plan(cfg, planned_world_size(cfg))
        active = f" ({est.active_parameters / 1e9:,.2f}B)" if est.active_parameters != est.total_parameters else ""
        print(f"| `{path.stem}` | {est.total_parameters / 1e9:,.2f}B{active} | {layout.tp} × {layout.pp} × {layout.dp}"
              f"{f', cp {layout.cp}' if layout.cp > 1 else ''}{f', ep {layout.grid.ep}' if layout.grid.ep > 1 else ''} | "
              f"{cfg.zero.stage} | {layout.world_size:,} | {est.peak / GIB:.1f} GiB of {est.capacity / GIB:.0f} | "
              f"{'yes' if est.fits else 'no'} |")


if __name__ == "__main__":
    main(sys.argv[1:])

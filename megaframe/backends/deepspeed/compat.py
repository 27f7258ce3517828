"""DeepSpeed's ZeRO x offload x precision x layout compatibility table, decided by validation with
DeepSpeed's rules (rules.py) handed to it, as the CLI hands them.

docs/parallelism.md's table is this module's output (`python tools/compat_table.py --write`), and a test fails
when the two differ, so the documentation cannot drift from what validation accepts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megaframe.config.schema import TrainConfig
from megaframe.backends.deepspeed.rules import config_problem
from megaframe.config.validate import ConfigError, validate

STAGES = (0, 1, 2, 3)
DEVICES = ("none", "cpu", "nvme")
OFFLOADS = tuple((optimizer, param) for optimizer in DEVICES for param in DEVICES)
PRECISIONS = ("fp32", "bf16", "fp16")
# Columns: the layouts whose rules differ; dp=2 in each so that ZeRO really partitions.
LAYOUTS = {"dp=2": (1, 1, 2), "tp=2 × dp=2": (2, 1, 2), "pp=2 × dp=2": (1, 2, 2)}
EXAMPLE_NVME_PATH = "/local_nvme"  # any path: the rules ask only that one is set


@dataclass(frozen=True)
class Combination:
    """One cell of the table for one precision."""

    stage: int
    optimizer: str
    param: str
    dtype: str
    layout: str

    def config(self) -> TrainConfig:
        """The default config with this combination applied (the tiny default model: 2 layers, 4 heads)."""
        cfg = TrainConfig()
        cfg.zero.stage = self.stage
        cfg.offload.optimizer, cfg.offload.param = self.optimizer, self.param
        if "nvme" in (self.optimizer, self.param):
            cfg.offload.nvme_path = EXAMPLE_NVME_PATH
        cfg.precision.dtype = self.dtype
        cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp = LAYOUTS[self.layout]
        return cfg

    @property
    def world_size(self) -> int:
        tp, pp, dp = LAYOUTS[self.layout]
        return tp * pp * dp

    def overrides(self) -> list[str]:
        """The same combination as megaframe-train arguments."""
        tp, pp, dp = LAYOUTS[self.layout]
        args = [f"zero=stage{self.stage}", f"offload.optimizer={self.optimizer}", f"offload.param={self.param}",
                f"precision={self.dtype}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}"]
        if "nvme" in (self.optimizer, self.param):
            args.append(f"offload.nvme_path={EXAMPLE_NVME_PATH}")
        return args


def refusal(combo: Combination, fp16_supported: bool = True) -> Optional[str]:
    """validate()'s one-line message for this combination, or None when it is accepted."""
    try:
        validate(combo.config(), combo.world_size, lambda: fp16_supported, engine_problem=config_problem)
    except ConfigError as err:
        return str(err)
    return None


def combinations() -> list[Combination]:
    """Every cell of the table, for every precision."""
    return [Combination(stage, optimizer, param, dtype, layout) for stage in STAGES for optimizer, param in OFFLOADS
            for layout in LAYOUTS for dtype in PRECISIONS]


def legal_combinations() -> list[Combination]:
    """The combinations validation accepts on a device with fp16."""
    return [c for c in combinations() if refusal(c) is None]


def refused_combinations() -> list[tuple[Combination, str]]:
    """The combinations validation refuses on a device with fp16, with the message."""
    return [(c, msg) for c in combinations() if (msg := refusal(c)) is not None]


def markdown() -> str:
    """The table: one row per stage x offload, one column per layout; a refused cell names the
    problem (a numbered note) and the nearest legal settings that validation suggests."""
    problems: dict[str, int] = {}
    lines = ["| zero | offload.optimizer | offload.param | " + " | ".join(LAYOUTS) + " |",
             "|" + "---|" * (3 + len(LAYOUTS))]
    for stage in STAGES:
        for optimizer, param in OFFLOADS:
            cells = []
            for layout in LAYOUTS:
                messages = {d: refusal(Combination(stage, optimizer, param, d, layout)) for d in PRECISIONS}
                legal = [d for d in PRECISIONS if messages[d] is None]
                if len(legal) == len(PRECISIONS):
                    cells.append("yes")
                    continue
                refs, fixes = [], []
                for message in dict.fromkeys(m for m in messages.values() if m):
                    problem, _, fix = message.rpartition("; use ")
                    refs.append(f"<sup>{problems.setdefault(problem or message, len(problems) + 1)}</sup>")
                    fixes += [f"`{f}`" for f in fix.split(" or ")] if problem else []
                verdict = f"{', '.join(legal)} only" if legal else "no"
                cells.append(verdict + "".join(refs) + (": " + " or ".join(fixes) if fixes else ""))
            lines.append(f"| stage{stage} | {optimizer} | {param} | " + " | ".join(cells) + " |")
    lines += ["", "\"yes\": accepted in fp32, bf16 and fp16 (fp16 where the device has it: it is refused on CPUs "
              "without AVX512-FP16, such as this project's CI machine). \"no\": refused before launch with the "
              "problem below and the nearest legal settings shown in the cell:", ""]
    lines += [f"{n}. {problem}" for problem, n in problems.items()]
    return "\n".join(lines) + "\n"


BEGIN = "<!-- compat-table: generated from megaframe/backends/deepspeed/rules.py by `python tools/compat_table.py --write`; do not edit -->"
END = "<!-- /compat-table -->"


def with_table(readme: str) -> str:
    """readme with the text between BEGIN and END replaced by markdown(); ValueError without both markers."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the guide lacks the markers {BEGIN!r} ... {END!r}")
    return readme[:start + len(BEGIN)] + "\n\n" + markdown() + "\n" + readme[end:]

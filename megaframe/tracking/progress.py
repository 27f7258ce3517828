"""Rank-0 console progress: a tqdm bar with loss, tokens/s and ETA."""
from __future__ import annotations

import sys
from typing import Optional

from tqdm import tqdm


def wants_bar(progress_bar: Optional[bool]) -> bool:
    """logging.progress_bar: None draws the bar only where someone watches it, a terminal; a log
    file would fill with its carriage-return redraws."""
    if progress_bar is not None:
        return progress_bar
    return sys.stderr.isatty()


class Progress:
    """A progress bar over optimizer steps; disabled it prints one line per log step instead."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool = True):
        self.enabled = enabled
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                        dynamic_ncols=True) if enabled else None

    def update(self, step: int, record: dict) -> None:
        # loss: the step's; loss_avg: the mean over the log interval (docs/metrics.md)
        postfix = {"loss": f"{record['loss']:.4f}"}
        if "loss_avg" in record:
            postfix["loss_avg"] = f"{record['loss_avg']:.4f}"
        postfix.update({"tok/s": f"{record['tokens_per_s']:.0f}", "TFLOP/s": f"{record['tflops']:.3g}",
                        "lr": f"{record['lr']:.2e}"})
        if "mfu" in record:
            postfix["MFU"] = f"{record['mfu']:.1%}"
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(step - self.bar.n)
        else:
            print(f"step {step}: " + " ".join(f"{k}={v}" for k, v in postfix.items()), flush=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

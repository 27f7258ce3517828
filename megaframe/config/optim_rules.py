"""optim's keys before launch (validate.check_optim runs them): optim.name among the optimizers
megaframe has (megaframe/optim/table.py names their state; tests hold the two lists equal), and
optim.muon's ranges; a Muon key set under another optimizer, which would read nothing of it, too.
Which layouts each optimizer steps correctly is the seam's rule (megaframe/optim/rules.py)."""
from __future__ import annotations

import math
from typing import Optional

from megaframe.config.choices import choice_problem, first_changed
from megaframe.config.schema import TrainConfig

OPTIMIZERS = ("adamw", "muon")  # optim.name (conf/optim/NAME.yaml)
FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max, without importing torch here
ADJUST_LR = ("spectral", "match_rms_adamw")  # optim.muon.adjust_lr (optim/muon.py's adjusted_lr)


def _finite(value, low: float, strict: bool) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and (value > low if strict else value >= low)


def optim_problem(cfg: TrainConfig) -> Optional[str]:
    """optim.name and, under optim=muon, optim.muon's keys; a Muon key set under another optimizer."""
    o, m = cfg.optim, cfg.optim.muon
    if err := choice_problem("optim.name", o.name, OPTIMIZERS):
        return f"{err} (optim=adamw or optim=muon)"
    if o.name != "muon":
        if changed := first_changed(m):
            return (f"optim.muon.{changed} is read only under optim=muon, and this run's optimizer is "
                    f"optim.name={o.name}: select optim=muon, or drop the key")
        return None
    if err := choice_problem("optim.muon.adjust_lr", m.adjust_lr, ADJUST_LR):
        return err
    if not (_finite(m.momentum, 0, False) and m.momentum < 1):
        return f"optim.muon.momentum={m.momentum} must be in [0, 1), e.g. 0.95"
    if not 1 <= m.ns_steps < 100:
        return f"optim.muon.ns_steps={m.ns_steps} must be in [1, 99], e.g. 5"
    if len(m.ns_coefficients) != 3 or not all(_finite(c, -math.inf, False) and abs(c) <= FLOAT32_MAX
                                                  for c in m.ns_coefficients):
        # Newton-Schulz runs in fp32 or bf16: 1e300 was "cannot be converted to type float" at step 0
        return (f"optim.muon.ns_coefficients={list(m.ns_coefficients)} must be three finite numbers (a, b, c) "
                f"within fp32's range, e.g. [3.4445,-4.775,2.0315]")
    if isinstance(m.exchange_bucket_size, bool) or not isinstance(m.exchange_bucket_size, int) \
            or m.exchange_bucket_size < 0:
        return (f"optim.muon.exchange_bucket_size={m.exchange_bucket_size} must be a whole number of matrix elements "
                f">= 0 (0: one exchange per group of ranks), e.g. 1000000000")
    for key, value, strict in (("eps", m.eps, True), ("adamw_lr", m.adamw_lr, True),
                               ("adamw_weight_decay", m.adamw_weight_decay, False)):
        if value is not None and not _finite(value, 0, strict):
            return f"optim.muon.{key}={value} must be a finite number {'>' if strict else '>='} 0"
    return None

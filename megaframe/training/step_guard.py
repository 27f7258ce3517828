"""Which steps may update the model: non-finite steps and loss spikes are skipped before the update.

The rule, in every layout:
- A step whose gradients are non-finite (NaN or inf anywhere, on any rank) is skipped by every rank
  together: the optimizer does not run, so parameters and moments are unchanged. The backend decides
  it from the global gradient norm, which every rank shares.
- A loss spike (train.spike) is judged on the global batch's mean loss before the update, from a
  window of the last applied steps' losses; with action=skip the step is skipped the same way.
- A skipped step consumes its batch (the data position is the step number) but does not advance the
  learning-rate schedule, as DeepSpeed and Megatron do for an fp16 overflow: after k skips the run
  is k steps behind on the schedule.
- A data.blend_schedule stage starts a new baseline: the window empties after the last step of
  the old weights and is judged again once full.
- train.max_consecutive_skips skipped steps in a row stop the run (Diverged, exit 3). In fp16, a
  skip while the loss scale can still shrink is the scaler searching for its scale, not divergence,
  and does not count towards that limit.

Every rank holds the same guard state (it is fed the same global values), and it is saved in the
checkpoint so a resumed run decides exactly as the uninterrupted one would have.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from megaframe.config.schema import SpikeConfig
from megaframe.common.failures import Diverged


@dataclass
class SkipEvent:
    """One skipped or flagged step, for metrics.jsonl and W&B."""

    step: int
    reason: str  # non_finite | spike | overflow (fp16 loss-scale search)
    action: str  # skipped | warned | stopped
    loss: Optional[float]
    metric: Optional[float]  # the spike metric (z-score or ratio), when a spike
    message: str = ""  # action == stopped: why, and what to try (the run's one-line error)

    def record(self, skipped_steps: int) -> dict[str, Any]:
        """The metrics.jsonl line of this event."""
        record = {"step": self.step, "event": f"{self.reason}_{self.action}", "skipped_steps": skipped_steps}
        if self.loss is not None and math.isfinite(self.loss):
            record["event_loss"] = self.loss
        if self.metric is not None:
            record["spike_metric"] = self.metric
        return record


class StepGuard:
    """Spike detection over a window of applied losses, and the skipped-step counters."""

    def __init__(self, spike: SpikeConfig, max_consecutive_skips: int, data_changes_after: tuple[int, ...] = ()):
        """data_changes_after: the steps after which the training data changes (a data.blend_schedule
        stage starts): the baseline starts over there. A level the new data sets is not a spike, and
        spikes never enter the window: judged against the old data's window, a lasting rise (harder
        data) was skipped max_consecutive_skips times and stopped the run as diverged."""
        self.spike, self.max_consecutive_skips = spike, max_consecutive_skips
        self.data_changes_after = frozenset(data_changes_after)
        self.window: deque[float] = deque(maxlen=spike.window)
        self.skipped_steps = 0
        self.consecutive_skips = 0

    @property
    def gates_updates(self) -> bool:
        """Whether the backend must ask spike() before each update (it costs a host read mid-step)."""
        return self.spike.action == "skip"

    def metric(self, loss: float) -> Optional[float]:
        """The spike metric of `loss` against the window, None while the window is not yet full."""
        if self.spike.action == "off" or len(self.window) < self.window.maxlen or not math.isfinite(loss):
            return None
        mean = math.fsum(self.window) / len(self.window)
        if self.spike.metric == "ratio":
            return loss / mean if mean > 0 else None
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in self.window) / (len(self.window) - 1))
        return (loss - mean) / std if std > 0 else None

    def is_spike(self, loss: float) -> bool:
        """Whether `loss` (the global batch's mean) is a spike by train.spike."""
        metric = self.metric(loss)
        return metric is not None and metric > self.spike.threshold

    def skip_before_update(self, loss: float) -> bool:
        """Asked by the backend before the update, with the global mean loss: skip this step?"""
        return self.gates_updates and self.is_spike(loss)

    def after_step(self, step: int, loss: float, applied: bool, scale_can_shrink: bool = False) -> Optional[SkipEvent]:
        """Account for the step just taken; return the event to log (None for a normal step). An
        event with action "stopped" ends the run: log it, then raise Diverged(event.message)."""
        event = self._after_step(step, loss, applied, scale_can_shrink)
        if step in self.data_changes_after:
            self.window.clear()  # the next step trains on other data: a new baseline, armed once full
        return event

    def _after_step(self, step: int, loss: float, applied: bool, scale_can_shrink: bool) -> Optional[SkipEvent]:
        metric = self.metric(loss)
        spiked = metric is not None and metric > self.spike.threshold
        if applied:
            self.consecutive_skips = 0
            if not math.isfinite(loss):  # cannot happen with finite gradients; refuse to go on from it
                raise Diverged(f"the loss is {loss} at step {step} but the update was applied; "
                               "lower optim.lr or check the data")
            if spiked and self.spike.action == "stop":
                return SkipEvent(step, "spike", "stopped", loss, metric,
                                 f"loss spike at step {step}: loss {loss:.4g} is {self._describe(metric)} "
                                 f"(train.spike.action=stop); lower optim.lr, raise train.spike.threshold, "
                                 f"or set train.spike.action=skip")
            if spiked:  # warn: applied, logged, kept out of the baseline
                return SkipEvent(step, "spike", "warned", loss, metric)
            self.window.append(loss)
            return None
        self.skipped_steps += 1
        reason = "spike" if spiked and self.spike.action == "skip" else ("overflow" if scale_can_shrink else "non_finite")
        if reason != "overflow":
            self.consecutive_skips += 1
        metric = metric if reason == "spike" else None
        if self.consecutive_skips >= self.max_consecutive_skips:
            what = f"a loss spike ({self._describe(metric)})" if reason == "spike" else "a non-finite gradient norm"
            return SkipEvent(step, reason, "stopped", loss, metric,
                             f"diverged: {self.consecutive_skips} steps in a row skipped, the last (step {step}) for "
                             f"{what}; lower optim.lr, check the data, or raise "
                             f"train.max_consecutive_skips={self.max_consecutive_skips}")
        return SkipEvent(step, reason, "skipped", loss, metric)

    def _describe(self, metric: Optional[float]) -> str:
        if self.spike.metric == "ratio":
            return f"{metric:.3g}x the mean of the last {len(self.window)} steps"
        return f"{metric:.3g} standard deviations above the last {len(self.window)} steps"

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps so a resumed run judges spikes and counts skips as before."""
        return {"window": list(self.window), "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict(); a window saved under another train.spike.window keeps its newest losses."""
        self.window.clear()
        self.window.extend(float(x) for x in state.get("window", []))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))


def loss_scale_can_shrink(precision_state: dict[str, Any], min_loss_scale: float) -> bool:
    """fp16 only: whether the loss scale (Backend.precision_state) is still above its floor; a
    skipped step is then the scaler's search, not a failure (after_step's scale_can_shrink)."""
    scale = precision_state.get("loss_scale")
    return scale is not None and scale > min_loss_scale

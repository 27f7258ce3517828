"""The step guard's rules (training/step_guard.py): when a spike triggers, what a skip does to the
baseline and the counters, when the run stops, and that its state survives a checkpoint."""
from __future__ import annotations

import statistics

import pytest

from megaframe.config.schema import SpikeConfig
from megaframe.training.step_guard import StepGuard

CALM = [3.00, 2.95, 3.02, 2.90, 2.97]


def _guard(**spike) -> StepGuard:
    guard = StepGuard(SpikeConfig(**{"window": 5, "threshold": 4.0, **spike}), max_consecutive_skips=3)
    for step, loss in enumerate(CALM, 1):
        assert guard.after_step(step, loss, applied=True) is None
    return guard


def test_zscore_against_the_window_and_unarmed_until_it_is_full():
    guard = StepGuard(SpikeConfig(window=5, threshold=4.0), 3)
    guard.after_step(1, 3.0, True)
    assert not guard.is_spike(100.0)  # one loss is no baseline
    guard = _guard()
    z = (3.5 - statistics.mean(CALM)) / statistics.stdev(CALM)  # the sample standard deviation
    assert guard.metric(3.5) == pytest.approx(z) and z > 4 and guard.is_spike(3.5)
    assert not guard.is_spike(3.05)


def test_ratio_metric():
    guard = _guard(metric="ratio", threshold=1.1)
    assert guard.metric(3.3) == pytest.approx(3.3 / statistics.mean(CALM))
    assert guard.is_spike(3.3) and not guard.is_spike(3.1)


def test_a_skipped_spike_stays_out_of_the_baseline_and_counts():
    guard = _guard()
    window = list(guard.window)
    assert guard.skip_before_update(9.0)
    event = guard.after_step(6, 9.0, applied=False)
    assert (event.reason, event.action, event.step) == ("spike", "skipped", 6) and event.metric > 4
    assert list(guard.window) == window and guard.skipped_steps == 1 and guard.consecutive_skips == 1
    assert guard.after_step(7, 2.96, applied=True) is None
    assert guard.consecutive_skips == 0 and guard.skipped_steps == 1 and guard.window[-1] == 2.96


def test_consecutive_skips_stop_the_run_with_a_message_naming_the_fix():
    guard = _guard()
    assert guard.after_step(6, float("nan"), applied=False).action == "skipped"
    assert guard.after_step(7, float("nan"), applied=False).action == "skipped"
    event = guard.after_step(8, float("nan"), applied=False)
    assert (event.reason, event.action) == ("non_finite", "stopped")
    assert "3 steps in a row" in event.message and "train.max_consecutive_skips=3" in event.message


def test_fp16_overflow_while_the_scale_can_shrink_does_not_count_towards_the_stop():
    guard = _guard()
    for step in range(6, 12):
        event = guard.after_step(step, float("nan"), applied=False, scale_can_shrink=True)
        assert (event.reason, event.action) == ("overflow", "skipped")
    assert guard.consecutive_skips == 0 and guard.skipped_steps == 6


def test_warn_applies_but_keeps_the_spike_out_of_the_baseline_and_stop_ends_the_run():
    guard = _guard(action="warn")
    assert not guard.skip_before_update(9.0)  # only action=skip gates the update
    event = guard.after_step(6, 9.0, applied=True)
    assert (event.reason, event.action) == ("spike", "warned") and 9.0 not in guard.window
    stop = _guard(action="stop").after_step(6, 9.0, applied=True)
    assert stop.action == "stopped" and "train.spike.action=stop" in stop.message


def test_off_never_triggers():
    guard = _guard(action="off")
    assert guard.metric(1e9) is None and guard.after_step(6, 1e9, applied=True) is None


def test_state_round_trip_gives_the_same_decisions():
    guard = _guard()
    guard.after_step(6, 9.0, applied=False)
    restored = StepGuard(SpikeConfig(window=5, threshold=4.0), 3)
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict()
    assert restored.metric(3.4) == guard.metric(3.4) and restored.is_spike(9.0)


def test_a_blend_schedules_new_data_starts_a_new_baseline_instead_of_a_divergence():
    """Spikes never enter the window, so a lasting rise that harder data brings (a data.blend_schedule
    stage) was judged against the old data's window forever: skipped max_consecutive_skips times,
    then the run stopped as diverged. The window now starts over after the last old-data step."""
    def run(changes):
        guard = StepGuard(SpikeConfig(window=5, threshold=4.0), 3, data_changes_after=changes)
        for step, loss in enumerate(CALM, 1):
            guard.after_step(step, loss, applied=True)
        events = []
        for step in range(6, 16):  # the new stage's data: a level 0.5 higher, as steady
            loss = 3.5 + 0.01 * (step % 3)
            skip = guard.skip_before_update(loss)
            events.append(guard.after_step(step, loss, applied=not skip))
            if events[-1] is not None and events[-1].action == "stopped":
                break
        return events

    assert run(changes=(5,)) == [None] * 10
    assert run(changes=())[-1].action == "stopped"  # the same losses against the old window
    assert run(changes=(9,))[-1].action == "stopped"  # a change elsewhere does not hide it


def test_a_blend_says_after_which_steps_its_data_changes(tmp_path):
    from tests.unit.data.test_blend import blend, sample_set

    sources = [sample_set(tmp_path / "a", 0, 10), sample_set(tmp_path / "b", 100, 17)]
    assert blend(sources, [0.5, 0.5], schedule=[(6, [0.1, 0.9]), (20, [0.9, 0.1])]).data_changes() == (6, 20)
    assert sources[0].data_changes() == ()

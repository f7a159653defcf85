"""The pure step judge: its rules one by one, and properties over any sequence of steps."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer_sidecar.contract.settings import GuardThresholds
from trainer_sidecar.guardian.judge import (
    GRAD_NORM_SPIKE,
    LOSS_SPIKE,
    NON_FINITE_GRADIENTS,
    NON_FINITE_LOSS,
    NON_FINITE_STATE,
    Action,
    StepHistory,
    StepReading,
    classify_step,
    judge_saved_state,
    judge_step,
    rollbacks_in_window,
)

DEFAULT = GuardThresholds(spike_min_history=10)  # the rules, with a short history to judge spikes on


def steady(n: int, loss: float = 1.0, norm: float = 1.0) -> StepHistory:
    return StepHistory(losses=(loss,) * n, grad_norms=(norm,) * n, iteration=n)


def test_a_good_step_is_applied_and_enters_the_windows() -> None:
    verdict = judge_step(DEFAULT, steady(3), StepReading(loss=0.9, grad_norm=0.8))
    assert verdict.action is Action.APPLY
    assert verdict.reason == verdict.cause == ""
    assert verdict.history.losses[-1] == 0.9
    assert verdict.history.grad_norms[-1] == 0.8
    assert verdict.history.iteration == 4


@pytest.mark.parametrize(
    ("reading", "cause"),
    [
        (StepReading(loss=math.nan, grad_norm=1.0), NON_FINITE_LOSS),
        (StepReading(loss=math.inf, grad_norm=1.0), NON_FINITE_LOSS),
        (StepReading(loss=1.0, grad_norm=1.0, loss_nonfinite=True), NON_FINITE_LOSS),  # inf + -inf on ranks
        (StepReading(loss=1.0, grad_norm=math.nan), NON_FINITE_GRADIENTS),
        (StepReading(loss=2.5, grad_norm=1.0), LOSS_SPIKE),
        (StepReading(loss=1.0, grad_norm=5.5), GRAD_NORM_SPIKE),
    ],
)
def test_bad_steps_are_skipped_with_their_cause(reading: StepReading, cause: str) -> None:
    verdict = judge_step(DEFAULT, steady(10), reading)
    assert verdict.action is Action.SKIP
    assert verdict.cause == verdict.reason == cause
    assert verdict.counts_as_bad
    assert verdict.spike == (cause in (LOSS_SPIKE, GRAD_NORM_SPIKE))
    assert verdict.history.consecutive_bad == 1
    assert verdict.history.losses == steady(10).losses  # a bad step never enters the windows


def test_spikes_are_judged_only_with_enough_history() -> None:
    assert classify_step(DEFAULT, steady(9), StepReading(loss=100.0, grad_norm=100.0)) == ""
    assert classify_step(DEFAULT, steady(10), StepReading(loss=100.0, grad_norm=1.0)) == LOSS_SPIKE


def test_a_benign_scaler_overflow_is_skipped_but_never_counts() -> None:
    history = replace(steady(10), consecutive_bad=2)
    reading = StepReading(loss=1.0, grad_norm=math.inf, scaler_overflow_benign=True)
    verdict = judge_step(DEFAULT, history, reading)
    assert verdict.action is Action.SKIP
    assert not verdict.counts_as_bad
    assert verdict.history.consecutive_bad == 2


def test_the_third_bad_step_in_a_row_rolls_back_and_resets_the_count() -> None:
    history = replace(steady(10), consecutive_bad=2)
    verdict = judge_step(DEFAULT, history, StepReading(loss=math.nan, grad_norm=1.0))
    assert verdict.action is Action.ROLL_BACK
    assert verdict.history.consecutive_bad == 0
    assert verdict.history.rollback_iterations == (11,)


def test_rollbacks_beyond_the_budget_within_the_window_diverge() -> None:
    thresholds = GuardThresholds(max_rollbacks=2, max_consecutive_bad_steps=1, rollback_window_steps=10)
    history = replace(steady(20), rollback_iterations=(15, 18))
    verdict = judge_step(thresholds, history, StepReading(loss=math.nan, grad_norm=1.0))
    assert verdict.action is Action.DIVERGE
    assert verdict.cause == NON_FINITE_LOSS
    assert verdict.reason == "2 rollbacks within 10 steps and still non-finite loss"
    old = replace(steady(40), rollback_iterations=(15, 18))  # both outside the window now
    assert judge_step(thresholds, old, StepReading(loss=math.nan, grad_norm=1.0)).action is Action.ROLL_BACK


def test_a_non_finite_state_rolls_back_at_once_then_diverges() -> None:
    assert judge_saved_state(DEFAULT, steady(5), state_finite=True).action is Action.APPLY
    verdict = judge_saved_state(DEFAULT, steady(5), state_finite=False)
    assert verdict.action is Action.ROLL_BACK
    assert verdict.cause == NON_FINITE_STATE
    spent = replace(steady(5), rollback_iterations=(1, 2, 3, 4, 5))
    assert judge_saved_state(DEFAULT, spent, state_finite=False).action is Action.DIVERGE


finite_or_not = st.one_of(
    st.floats(min_value=0.0, max_value=1e6, allow_nan=False), st.sampled_from([math.nan, math.inf, -math.inf])
)
readings = st.builds(
    StepReading,
    loss=finite_or_not,
    grad_norm=finite_or_not,
    loss_nonfinite=st.booleans(),
    scaler_overflow_benign=st.booleans(),
)
thresholds = st.builds(
    GuardThresholds,
    max_consecutive_bad_steps=st.integers(1, 5),
    loss_spike_factor=st.floats(1.01, 10.0),
    loss_spike_window=st.integers(10, 30),
    grad_norm_spike_factor=st.floats(1.01, 10.0),
    spike_min_history=st.integers(1, 10),
    max_rollbacks=st.integers(1, 4),
    rollback_window_steps=st.integers(1, 50),
)


@given(thresholds, st.lists(readings, max_size=80))
def test_any_sequence_of_steps_keeps_the_rules(limits: GuardThresholds, steps: list[StepReading]) -> None:
    history = StepHistory()
    for reading in steps:
        verdict = judge_step(limits, history, reading)
        after = verdict.history
        assert after.iteration == history.iteration + 1
        good = classify_step(limits, history, reading) == ""
        assert (verdict.action is Action.APPLY) == good
        assert len(after.losses) <= limits.loss_spike_window
        assert all(math.isfinite(x) for x in (*after.losses, *after.grad_norms))
        if verdict.action is Action.APPLY:
            assert after.consecutive_bad == 0
        elif verdict.action is Action.SKIP:
            assert 0 < after.consecutive_bad < limits.max_consecutive_bad_steps or not verdict.counts_as_bad
        elif verdict.action is Action.ROLL_BACK:
            assert history.consecutive_bad + 1 >= limits.max_consecutive_bad_steps
            assert rollbacks_in_window(limits, after) <= limits.max_rollbacks
        else:
            assert rollbacks_in_window(limits, history) >= limits.max_rollbacks
            return  # the worker exits
        # The rollback history stays bounded by the budget, however long the job runs.
        assert len(after.rollback_iterations) <= limits.max_rollbacks
        history = after


@given(thresholds, st.lists(readings, max_size=30))
def test_the_same_history_and_numbers_give_the_same_verdict(
    limits: GuardThresholds, steps: list[StepReading]
) -> None:
    # Every rank holds the same history and the same agreed numbers: they must decide alike.
    history = StepHistory()
    for reading in steps:
        first, second = judge_step(limits, history, reading), judge_step(limits, history, reading)
        assert first == second
        if first.action is Action.DIVERGE:
            return
        history = first.history

"""The Young-Daly checkpoint interval (``trainer_sidecar.contract.cadence``)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from trainer_sidecar.contract.cadence import (
    ASSUMED,
    OBSERVED,
    auto_interval,
    choose_interval,
    estimated_mtbf,
    young_daly_seconds,
)

seconds = st.floats(min_value=0.0, max_value=1e7, allow_nan=False)
positive = st.floats(min_value=1e-3, max_value=1e7, allow_nan=False)
steps = st.integers(min_value=1, max_value=10**9)


def test_the_rule_by_hand() -> None:
    assert young_daly_seconds(2.0, 3600.0) == 120.0
    assert auto_interval(2.0, 3600.0, 0.5, 1, 10**6) == 240
    assert auto_interval(2.0, 3600.0, 0.5, 300, 10**6) == 300
    assert auto_interval(2.0, 3600.0, 0.5, 1, 100) == 100
    assert auto_interval(0.0, 3600.0, 0.5, 5, 100) == 5  # a free save: as often as allowed
    assert auto_interval(2.0, 3600.0, 0.0, 5, 100) == 100  # no step time yet: as rarely as allowed


def test_the_mtbf_is_assumed_until_failures_are_seen() -> None:
    assert estimated_mtbf(86_400, 0, 0.0) == (86_400, ASSUMED)
    assert estimated_mtbf(86_400, 0, 10_000.0) == (96_400, ASSUMED)
    assert estimated_mtbf(3600, 3, 10_800.0) == (3600.0, OBSERVED)  # 4 failures in 4 hours, prior included
    choice = choose_interval(2.0, 1.0, 1, 10**6, 3600, failures=3, run_seconds=10_800.0)
    assert (choice.steps, choice.mtbf_source, choice.bound) == (120, OBSERVED, "")


@given(seconds, seconds, seconds, steps, steps)
def test_within_bounds(save: float, mtbf: float, step: float, low: int, high: int) -> None:
    chosen = auto_interval(save, mtbf, step, low, high)
    assert isinstance(chosen, int)
    assert low <= chosen <= max(low, high)


@given(seconds, seconds, positive, seconds, steps, steps)
def test_a_costlier_save_never_shortens_the_interval(
    save: float, extra: float, step: float, mtbf: float, low: int, high: int
) -> None:
    assert auto_interval(save + extra, mtbf, step, low, high) >= auto_interval(save, mtbf, step, low, high)


@given(seconds, st.integers(0, 10_000), st.integers(0, 10_000), seconds, positive, seconds, steps, steps)
def test_more_failures_never_lengthen_the_interval(
    assumed: float, failures: int, more: int, run: float, step: float, save: float, low: int, high: int
) -> None:
    assumed = max(assumed, 60.0)
    few = choose_interval(save, step, low, high, assumed, failures, run)
    many = choose_interval(save, step, low, high, assumed, failures + more, run)
    assert many.mtbf_seconds <= few.mtbf_seconds
    assert many.steps <= few.steps


@given(seconds, seconds, positive, positive, steps, steps)
def test_longer_steps_never_add_steps(
    save: float, mtbf: float, step: float, longer: float, low: int, high: int
) -> None:
    assert auto_interval(save, mtbf, step + longer, low, high) <= auto_interval(save, mtbf, step, low, high)


@given(positive, positive, positive)
def test_unbounded_it_is_the_optimum_in_steps(save: float, mtbf: float, step: float) -> None:
    chosen = auto_interval(save, mtbf, step, 1, 2**62)
    optimum = math.sqrt(2 * save * mtbf) / step
    assert chosen == max(1, round(optimum)) or chosen == 2**62

"""Loss-explosion patterns: the design's seed examples, and properties over arbitrary histories."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer_sidecar.guardian.explosion import ExplosionPattern, classify_explosion

NAN = math.nan
INF = math.inf


@pytest.mark.parametrize(
    ("losses", "expected"),
    [
        ([2.1, 2.0, 1.9, 8734.5, NAN], ExplosionPattern.SUDDEN_JUMP),
        ([2.1, 2.3, 2.8, 4.5, 12.3, 89.7, NAN], ExplosionPattern.EXPONENTIAL_GROWTH),
        ([2.1, 1.8, 2.5, 1.6, 3.2, 1.4, 5.8, NAN], ExplosionPattern.OSCILLATING_DIVERGENCE),
    ],
    ids=["sudden-jump", "exponential-growth", "oscillating-divergence"],
)
def test_seed_examples(losses: list[float], expected: ExplosionPattern) -> None:
    assert classify_explosion(losses) == expected


@pytest.mark.parametrize(
    ("losses", "expected"),
    [
        ([2.1, 2.0, 1.9, 2.0, 8734.5], ExplosionPattern.SUDDEN_JUMP),
        ([2.1, 2.0, 1.9, 2.0, INF], ExplosionPattern.SUDDEN_JUMP),
        ([1.0, 1.1, 1.3, 1.8, 3.0, 6.0, 14.0], ExplosionPattern.EXPONENTIAL_GROWTH),
        ([2.0, 1.9, 2.2, 1.7, 2.6, 1.2, 3.5], ExplosionPattern.OSCILLATING_DIVERGENCE),
    ],
    ids=["finite-jump", "inf-jump", "finite-exponential", "finite-oscillation"],
)
def test_patterns_without_a_non_finite_newest_value(losses: list[float], expected: ExplosionPattern) -> None:
    assert classify_explosion(losses) == expected


def test_the_seed_examples_stay_classified_behind_a_long_clean_history() -> None:
    history = [3.0 - 0.01 * i for i in range(50)]
    assert classify_explosion([*history, 2.1, 2.0, 1.9, 8734.5, NAN]) == ExplosionPattern.SUDDEN_JUMP
    assert classify_explosion([*history, 2.1, 2.3, 2.8, 4.5, 12.3, 89.7, NAN]) == (
        ExplosionPattern.EXPONENTIAL_GROWTH
    )


def test_smooth_decreasing_loss_is_not_an_explosion() -> None:
    losses = [0.3 + 2.5 * math.exp(-step / 40) for step in range(400)]
    for end in range(len(losses) + 1):
        assert classify_explosion(losses[:end]) is None, losses[:end][-7:]


def test_a_modest_rise_is_not_an_explosion() -> None:
    assert classify_explosion([2.0, 1.9, 1.8, 1.85]) is None
    assert classify_explosion([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # linear, not accelerating


def test_a_jump_at_the_end_of_a_steady_climb_is_not_a_sudden_jump() -> None:
    # The history was itself climbing, linearly: neither a jump from a stable loss nor accelerating.
    assert classify_explosion([1.0, 2.0, 3.0, 4.0, 30.0]) is None


def test_the_window_is_the_last_seven_values() -> None:
    # The jump threshold is against the mean of the six values before the newest: the 7th from the
    # end counts, the 8th does not.
    assert classify_explosion([1.0, 1.0, 1.0, 1.0, 1.0, 4.0]) == ExplosionPattern.SUDDEN_JUMP
    assert classify_explosion([10.0, 1.0, 1.0, 1.0, 1.0, 1.0, 4.0]) is None
    assert classify_explosion([1000.0, 10.0, 1.0, 1.0, 1.0, 1.0, 1.0, 4.0]) is None
    assert classify_explosion([1000.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 4.0]) == ExplosionPattern.SUDDEN_JUMP


def test_the_window_does_not_reach_the_eighth_value() -> None:
    oscillation = [2.0, 1.9, 2.2, 1.7, 2.6, 1.2, 3.5]
    # An eighth value that would break the alternation is outside the window.
    assert classify_explosion([5.0, *oscillation]) == ExplosionPattern.OSCILLATING_DIVERGENCE


def test_a_damped_oscillation_is_not_a_divergence() -> None:
    assert classify_explosion([3.0, 1.0, 2.5, 1.5, 2.2, 1.8, 2.0]) is None


def test_too_short_histories_are_not_classified() -> None:
    assert classify_explosion([]) is None
    assert classify_explosion([NAN]) is None
    assert classify_explosion([1e9]) is None


def test_the_spike_factor_sets_the_jump_threshold() -> None:
    losses = [2.0, 2.0, 2.0, 2.0, 7.0]
    assert classify_explosion(losses, spike_factor=3.0) == ExplosionPattern.SUDDEN_JUMP
    assert classify_explosion(losses, spike_factor=4.0) is None


# --- properties ----------------------------------------------------------------------------------------

_any_float = st.floats(allow_nan=True, allow_infinity=True)
_positive = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False)


@given(st.lists(_positive, max_size=30, unique=True))
def test_any_strictly_decreasing_positive_history_is_not_an_explosion(values: list[float]) -> None:
    losses = sorted(values, reverse=True)
    assert classify_explosion(losses) is None


@given(st.lists(_any_float, max_size=30), st.floats(min_value=1.01, max_value=100.0))
def test_never_raises_and_returns_a_pattern_or_none(losses: list[float], spike_factor: float) -> None:
    result = classify_explosion(losses, spike_factor)
    assert result is None or isinstance(result, ExplosionPattern)


@given(st.lists(_any_float, max_size=20), st.lists(_any_float, min_size=7, max_size=7))
def test_only_the_last_seven_values_matter(prefix: list[float], tail: list[float]) -> None:
    assert classify_explosion([*prefix, *tail]) == classify_explosion(tail)


@given(_positive, st.integers(1, 10), st.sampled_from([NAN, INF]))
def test_a_flat_history_ending_non_finite_is_a_sudden_jump(level: float, length: int, last: float) -> None:
    assert classify_explosion([level] * length + [last]) == ExplosionPattern.SUDDEN_JUMP


@given(st.lists(_positive, min_size=2, max_size=12))
def test_a_history_ending_in_a_drop_is_never_exponential_growth(values: list[float]) -> None:
    losses = [*values, values[-1] / 2]
    assert classify_explosion(losses) != ExplosionPattern.EXPONENTIAL_GROWTH

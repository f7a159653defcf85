"""Classifies a loss explosion into the three patterns of the design's seed 002.

- sudden jump: a stable loss followed by one huge value (a bad sample, an overflow);
- exponential growth: the loss rises step after step, faster and faster (learning rate too high);
- oscillating divergence: the loss swings up and down with a growing amplitude (optimizer state damage).

Pure functions over a short history of losses; no torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from enum import StrEnum


class ExplosionPattern(StrEnum):
    """The shape of a loss explosion."""

    SUDDEN_JUMP = "sudden_jump"
    EXPONENTIAL_GROWTH = "exponential_growth"
    OSCILLATING_DIVERGENCE = "oscillating_divergence"


def classify_explosion(losses: Sequence[float], spike_factor: float = 2.0) -> ExplosionPattern | None:
    """Name the pattern that ends ``losses`` (oldest first; the last is the newest, possibly inf or NaN).

    Returns None when the tail of the history does not look like an explosion. Looks at the last
    seven values at most, like the seed's examples. A non-finite newest value counts as "very large".
    """
    tail = [float(x) for x in losses[-7:]]
    if len(tail) < 2:
        return None
    newest = tail[-1]
    finite = [x for x in tail if math.isfinite(x)]
    body = tail[:-1]
    if any(not math.isfinite(x) for x in body):
        # Already exploded earlier in the window; classify on the finite prefix that led there.
        return classify_explosion(finite, spike_factor) if len(finite) >= 2 else None

    diffs = [b - a for a, b in itertools.pairwise(tail) if math.isfinite(b)]
    # Oscillating: at least four sign changes... scaled down for short windows, with growing swings.
    if len(diffs) >= 4 and all(d != 0 for d in diffs):
        signs = [d > 0 for d in diffs]
        alternating = all(a != b for a, b in itertools.pairwise(signs))
        amplitudes = [abs(d) for d in diffs]
        growing = amplitudes[-1] > amplitudes[0] and _mostly_increasing(amplitudes)
        if alternating and growing:
            return ExplosionPattern.OSCILLATING_DIVERGENCE

    # Exponential: the last three or more steps all rise, and the rises themselves grow.
    rising = 0
    for a, b in zip(reversed(tail[:-1]), reversed(tail), strict=False):
        if b > a or (not math.isfinite(b) and math.isfinite(a)):
            rising += 1
        else:
            break
    if rising >= 3:
        run = tail[-(rising + 1) :]
        finite_run = [x for x in run if math.isfinite(x)]
        rises = [b - a for a, b in itertools.pairwise(finite_run)]
        if len(rises) < 2 or _mostly_increasing(rises):
            return ExplosionPattern.EXPONENTIAL_GROWTH

    # Sudden jump: the newest value is far above a history that was not itself climbing.
    history = body[-6:]
    mean = sum(history) / len(history)
    if (not math.isfinite(newest) or (mean > 0 and newest > spike_factor * mean)) and rising <= 2:
        return ExplosionPattern.SUDDEN_JUMP
    return None


def _mostly_increasing(values: Sequence[float]) -> bool:
    """True when at least all but one consecutive pair increases (noise tolerant for short runs)."""
    ups = sum(1 for a, b in itertools.pairwise(values) if b > a)
    return ups >= len(values) - 2 and len(values) >= 2

"""How long a worker may stay in its open busy sections: one pure rule, shared by the sidecar (which
judges) and the guardian (which also states the answer in the status fields older sidecars read).

The rule: **every open section is measured from its own start**, and is allowed what it asked
(``limit``), at most ``cap`` (the sidecar's startup grace); a section that asked for nothing is allowed
``cap``. The open sections together are allowed until the *earliest* of their own deadlines. So:

* a bounded section entered late inside an unbounded one (``busy("save", seconds=4)`` 5 s into
  ``busy("eval")``) gets its 4 s from its own start, not from the outer section's;
* an outer bounded section still bounds everything inside it: an unbounded section opened inside
  ``busy("save", seconds=10)`` ends with the save's 10 s, not with the grace;
* the whole busy stretch never outlasts ``cap`` from its first section's start, so a hang inside busy
  sections is caught within the startup grace whatever the loop nests.

Nothing here depends on the order of the sections, their depth, or on a clock: starts and ``now`` are
numbers on one clock the caller chooses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class OpenSection:
    """One open busy section: when it began (on the caller's clock), the seconds it asked for (None: as
    long as allowed), and what it is."""

    start: float
    limit: float | None
    reason: str = ""


@dataclass(frozen=True)
class Allowance:
    """The verdict of ``busy_allowance``: the section whose deadline comes first (``index`` into the
    sections given), how long it has been open, what it is allowed, and the seconds left (negative:
    overrun)."""

    index: int
    section: OpenSection
    elapsed: float
    allowed: float

    @property
    def remaining(self) -> float:
        """Seconds until the deadline (at most 0 once it passed)."""
        return self.allowed - self.elapsed

    @property
    def within(self) -> bool:
        """Whether the deadline is still ahead (``elapsed < allowed``; NaN counts as overrun)."""
        return self.elapsed < self.allowed


def section_allowance(section: OpenSection, cap: float | None) -> float | None:
    """What one section is allowed on its own: its limit, at most ``cap``; ``cap`` without a limit (None
    when both are None: unbounded). A limit that is not a positive finite number counts as 0."""
    limit = section.limit
    if limit is not None and not (math.isfinite(limit) and limit > 0):
        limit = 0.0
    if cap is None:
        return limit
    return cap if limit is None else min(limit, cap)


def busy_allowance(sections: Sequence[OpenSection], now: float, cap: float | None) -> Allowance | None:
    """The allowance of the open ``sections`` at ``now``: the section that runs out first, each measured
    from its own start and allowed ``section_allowance(section, cap)``. Ties go to the section given
    last (the innermost). None when no section has a bound (no sections, or ``cap`` None and none asked
    for a limit). Order-independent in its deadline; pure."""
    best: Allowance | None = None
    for index, section in enumerate(sections):
        allowed = section_allowance(section, cap)
        if allowed is None:
            continue
        candidate = Allowance(index, section, now - section.start, allowed)
        if best is None or _urgency(candidate) <= _urgency(best):
            best = candidate
    return best


def _urgency(allowance: Allowance) -> float:
    """Seconds left, a NaN (no comparable time) counting as already overrun."""
    remaining = allowance.remaining
    return -math.inf if math.isnan(remaining) else remaining

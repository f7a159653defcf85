"""How long the ranks of a broken gang get between SIGTERM and SIGKILL. Pure: plain values in and out.

A gang that lost a rank (dead, hung) cannot checkpoint: its survivors wait in a collective for the lost
rank and never reach a step boundary, so a long stop grace only holds the restart up. What they can
still do is finish a checkpoint write already in flight in the background (it needs no collective), and
losing it costs a whole checkpoint interval of work. So the grace is ``floor`` (a moment to flush their
output) unless a rank reported a write in flight, and then lasts until that write is expected to be
durable: twice the rank's last write, from when this one started, plus the floor; a rank that has not
finished a write yet (its first) gets the ceiling. Never more than ``ceiling`` (the job's stop grace,
which already allows three times the longest write). Both runners use it: the local runner with its
workers' status files, the operator with the sidecars' last reports.

The sidecar uses the same expectation (``write_expected_by``) for the one stop it does not order: the
kubelet's kill of a hung worker after its liveness probe failed. That kill's grace is fixed in the pod
spec, so it is a moment too, and the sidecar keeps the probe passing while the hung rank's own write in
flight is expected to finish (``trainer_sidecar.sidecar.health``).

The worker's start time is on its own wall clock and ``now`` on the executor's: a skew between them
moves the expectation by that much, inside the same bounds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

#: What a broken gang's ranks get with no write in flight: a moment to flush their output.
BROKEN_GANG_GRACE_SECONDS = 1.0
#: A write in flight is expected to take at most this many times the rank's last write.
WRITE_MARGIN = 2.0


@dataclass(frozen=True)
class WriteInFlight:
    """One rank's checkpoint write that was still in flight when it last reported: when it started
    (unix seconds, the worker's clock) and how long the rank's last completed write took (None: none
    completed yet)."""

    since: float
    last_write_seconds: float | None


def broken_gang_grace_seconds(
    writes: Iterable[WriteInFlight],
    now: float,
    ceiling: float,
    floor: float = BROKEN_GANG_GRACE_SECONDS,
) -> float:
    """The seconds a broken gang's ranks get between SIGTERM and SIGKILL (see the module docstring):
    between ``floor`` and ``ceiling`` (a ceiling below the floor gives the floor)."""
    grace = floor
    for write in writes:
        expected = write_expected_by(write)
        if not math.isfinite(expected):
            return max(floor, ceiling)
        grace = max(grace, expected + floor - now)
    return max(floor, min(grace, ceiling))


def write_expected_by(write: WriteInFlight) -> float:
    """When ``write`` is expected to be durable (unix seconds, the worker's clock): its start plus
    ``WRITE_MARGIN`` times the rank's last write. Infinite when nothing bounds it: no write completed yet,
    or a time that is not a finite number."""
    last = write.last_write_seconds
    if last is None or not math.isfinite(last) or not math.isfinite(write.since):
        return math.inf
    return write.since + WRITE_MARGIN * last

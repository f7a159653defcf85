"""When a job's daemon takes its next reconcile step. Pure: times are plain ``time.monotonic()`` floats.

A step's ``Outcome`` says when to come back by the clock (``requeue_seconds``, only while ``clock``: pods
run, or a backoff or bounded wait is pending) and whether the job is final. A change of the job's
PyTorchJob or pods calls for a step at once, whatever the clock says. A step another handler took (the
creation's, a spec update's) counts as the daemon's: the daemon waits out the rest of its requeue.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Outcome:
    """What a reconcile step tells its caller: when to come back (by the clock only when ``clock``),
    and whether the job is final."""

    requeue_seconds: float
    done: bool
    clock: bool = True

    def wait_seconds(self) -> float | None:
        """How long to wait right after this step: its requeue, or None when only a change calls."""
        return self.requeue_seconds if self.clock else None


@dataclass(frozen=True)
class LastStep:
    """When this process last finished a step of a job (``time.monotonic()``), and its outcome."""

    finished: float
    outcome: Outcome


def wait_before_step(last: LastStep | None, changed: bool, now: float) -> float | None:
    """Seconds until the next step is due: 0.0 when it is due now (no step was taken yet, a change
    arrived since the last one began, or its requeue has run out); otherwise what is left of the last
    step's requeue, or None when that step asked for no clock (only a change calls for the next)."""
    if last is None or changed:
        return 0.0
    wait = last.outcome.wait_seconds()
    if wait is None:
        return None
    return max(0.0, wait - (now - last.finished))

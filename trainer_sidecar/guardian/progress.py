"""The progress clock: when the worker last made progress, the time the hang checks count from.

A step boundary is progress; so is the end of a stretch that makes no step but is no hang (a busy
section, a pause the guardian saw, a wait for a busy peer, a rollback): without it the first status after
such a stretch would read "no step for" its whole length, which the sidecar counts against the hang
timeout. Before the first step there is no progress time (the startup grace applies), and the end of a
pause does not invent one. This clock is the only writer of the status's ``last_step_time``.
"""

from __future__ import annotations

import time

__all__ = ["ProgressClock"]


class ProgressClock:
    """The time of the worker's last progress (unix seconds), None before the first; written only here."""

    def __init__(self) -> None:
        self._last: float | None = None

    @property
    def last(self) -> float | None:
        """The time of the last progress, or None before any."""
        return self._last

    def stepped(self, now: float | None = None) -> None:
        """Progress at ``now`` (the current time when not given): a step boundary, or a rollback's end."""
        self._last = time.time() if now is None else now

    def pause_ended(self, now: float | None = None) -> None:
        """A stretch without steps that is no hang ended at ``now``: progress, once there was any."""
        if self._last is not None:
            self.stepped(now)

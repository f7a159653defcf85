"""Where the training thread is: the guardian's marks of its own calls, read by the status and the gang.

The guardian marks an ``Activity`` at its own calls (the backward pass, the step's collective, a
checkpoint, a busy section, the loop's code in between); what is marked is published with the status
(``StatusReporter``), so that a rank waiting in a collective is told apart from one stuck in its own work
(``trainguard.core.policy``). Marking must cost nothing a step can measure: two stores at most.
"""

from __future__ import annotations

import time

from trainer_sidecar.contract.status import Activity


class ActivityTracker:
    """Where the training thread is, and since when (unix seconds): ``current`` is one tuple, replaced
    whole, so another thread reads a consistent pair. ``mark`` costs a comparison, and a clock reading
    when the activity changes."""

    __slots__ = ("current",)

    def __init__(self, activity: Activity = Activity.LOOP) -> None:
        self.current: tuple[Activity, float] = (activity, time.time())

    @property
    def activity(self) -> Activity:
        """The current activity."""
        return self.current[0]

    def mark(self, activity: Activity) -> Activity:
        """Enter ``activity`` (its start is kept when it is the current one already); returns the activity
        it replaced, for a caller that goes back to it."""
        previous = self.current[0]
        if activity is not previous:
            self.current = (activity, time.time())
        return previous

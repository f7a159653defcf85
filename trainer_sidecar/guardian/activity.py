"""Where the training thread is: the guardian's marks of its own calls, read by the status and the gang.

The guardian marks an ``Activity`` at its own calls (the backward pass, the step's collective, a
checkpoint, a busy section, the loop's code in between); what is marked is published with the status
(``StatusReporter``), so that a rank waiting in a collective is told apart from one stuck in its own work
(``trainguard.core.policy``); the waits of the loop's own torch.distributed collectives are marked too
(``trainer_sidecar.guardian.collectives``). The same marks sum the time spent in the rank's own work
(``own``), from which a step's compute is read (``trainer_sidecar.contract.compute``). Marking must
cost nothing a step can measure: a comparison, and on a change a clock reading, an addition and two
stores.
"""

from __future__ import annotations

import time

from trainer_sidecar.contract.status import Activity

#: The activities that are the rank's own work: its compute. A collective waits for peers; a checkpoint
#: and a busy section (an evaluation) are not steps.
OWN_WORK = frozenset({Activity.LOOP, Activity.DATA, Activity.BACKWARD, Activity.STEP})


class ActivityTracker:
    """Where the training thread is, and since when (unix seconds): ``current`` is one tuple, replaced
    whole, so another thread reads a consistent pair. ``mark`` costs a comparison, and a clock reading
    when the activity changes. ``own`` is the seconds spent in ``OWN_WORK`` before the current activity
    began, less the waits inside it since (``resume``); written by the training thread alone."""

    __slots__ = ("current", "own")

    def __init__(self, activity: Activity = Activity.LOOP) -> None:
        self.current: tuple[Activity, float] = (activity, time.time())
        self.own = 0.0

    @property
    def activity(self) -> Activity:
        """The current activity."""
        return self.current[0]

    def mark(self, activity: Activity) -> Activity:
        """Enter ``activity`` (its start is kept when it is the current one already); returns the activity
        it replaced, for a caller that goes back to it."""
        previous, since = self.current
        if activity is not previous:
            now = time.time()
            if previous in OWN_WORK:
                self.own += now - since
            self.current = (activity, now)
        return previous

    def resume(self, entry: tuple[Activity, float]) -> None:
        """Go back to ``entry`` (``current`` as read before a wait inside it: the activity and its start
        as they were), the time since it was left not counted as its own work: the activity goes on from
        its old start (a loop's code that waited in a collective of its own), and ``mark`` counts from
        that start again when it leaves it, less the wait."""
        activity, since = entry
        left, left_since = self.current
        now = time.time()
        if left in OWN_WORK:
            self.own += now - left_since
        if activity in OWN_WORK:
            self.own -= now - since
        self.current = entry

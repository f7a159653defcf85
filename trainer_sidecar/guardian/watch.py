"""The activity watch's looks: an evaluation inferred from eval mode, a pause the guardian can see.

The status reporter's watch thread looks at the training thread every period (``ActivityWatch.look``):
the guarded model in eval mode between steps is an evaluation the loop did not declare
(``busy.evaluation_change``); a long fetch from the loader or a long step computing is a pause
(``guardian.pauses``). Either opens an implicit busy section, so it is no hang and no step gap, and
closes it when it ends (the end is progress). The peer watch's thread tells it when a busy peer this
rank waits for came or went (``peer_changed``). Nothing here runs on the training thread, so a step pays
nothing for it.

Built by the Guardian with what it looks at, called only by it and by the watch threads it starts.
"""

from __future__ import annotations

import logging
import time

import torch

from trainer_sidecar.contract.status import Phase
from trainer_sidecar.guardian.activity import ActivityTracker
from trainer_sidecar.guardian.busy import (
    EVAL_MODE_REASON,
    STEP_ACTIVITIES,
    BusySections,
    EvalChange,
    StepProgress,
    evaluation_change,
)
from trainer_sidecar.guardian.counters import GuardCounters
from trainer_sidecar.guardian.ending import Lifecycle
from trainer_sidecar.guardian.pauses import (
    PauseChange,
    PauseKind,
    PauseLook,
    ThreadClock,
    pause_change,
    pause_threshold,
)
from trainer_sidecar.guardian.progress import ProgressClock
from trainer_sidecar.guardian.reporting import StatusReporter

log = logging.getLogger("trainguard")

__all__ = ["ActivityWatch"]


class ActivityWatch:
    """What the watch threads infer about the training thread: one implicit section at a time (an
    evaluation or a pause), opened and closed from the watch's thread alone."""

    def __init__(
        self,
        activity: ActivityTracker,
        busy: BusySections,
        counters: GuardCounters,
        life: Lifecycle,
        module: torch.nn.Module,
        reporter: StatusReporter,
        progress: ProgressClock,
    ) -> None:
        self._activity, self._busy, self.counters, self._life = activity, busy, counters, life
        self.module, self._reporter, self._progress = module, reporter, progress
        # The evaluation inferred from the model's eval mode (``evaluation``, the watch's thread alone):
        # its section's token and the progress it began at; and whether the loop trains in eval mode
        # (then eval mode says nothing).
        self._evaluation: tuple[object, StepProgress] | None = None
        self._trains_in_eval_mode = False
        self._train_mode_seen = time.time()  # the last look that found the model in train mode
        # A pause the watch sees (``guardian.pauses``): its section's token, the progress it began at and
        # its kind; and the training thread's CPU clock (``begin``).
        self._pause: tuple[object, StepProgress, PauseKind] | None = None
        self._thread_clock: ThreadClock | None = None

    @property
    def phase(self) -> Phase:
        """The worker's phase, as its status publishes it."""
        return self._life.phase

    def begin(self, thread: int) -> None:
        """The loop begins on the thread of id ``thread``: its CPU clock tells computing from waiting."""
        self._thread_clock = ThreadClock(thread)

    def withdraw(self) -> None:
        """Close an evaluation the watch inferred and still holds open (the watch is stopped already:
        the peers would read this rank busy on)."""
        opened, self._evaluation = self._evaluation, None
        if opened is not None:
            self._busy.leave(opened[0])

    def progress(self) -> StepProgress:
        """The progress the steps made: the step kept and the cumulative step count."""
        return (self.counters.step, self.counters.iterations)

    def look(self, period: float) -> float | None:
        """The activity watch's look (every ``period``, from its own thread): an evaluation inferred from
        the model's eval mode (``evaluation``), else a pause the guardian can see
        (``pause``); one implicit section at a time. Returns when the status changed, or None."""
        share = None if self._thread_clock is None else self._thread_clock.share()  # sampled every look
        if self._pause is None:
            changed = self.evaluation(period)
            if changed is not None or self._evaluation is not None:
                return changed
        return self.pause(share)

    def pause(self, cpu_share: float | None) -> float | None:
        """Open or close the section of a pause the guardian can see (``guardian.pauses``: a long fetch
        from its loader, a long step computing): the pause is no hang and no step gap. Returns when the
        status changed (unix seconds: a section opens as of the pause's start, so the gap it ends is not
        the watch's delay), or None."""
        progress = self.progress()  # first: a step after this makes the section stale, not missed
        activity, since = self._activity.current
        now, age = time.time(), time.monotonic() - self._busy.last_progress
        look = PauseLook(self.phase, activity, now - since, age, cpu_share)
        opened = self._pause
        change = pause_change(
            None if opened is None else opened[2],
            opened is not None and progress != opened[1],
            look,
            pause_threshold(self._reporter.pace.longest),
        )
        if change in (PauseChange.BEGIN_DATA, PauseChange.BEGIN_COMPUTING):
            kind = PauseKind.DATA if change is PauseChange.BEGIN_DATA else PauseKind.COMPUTING
            self._pause = (self._busy.enter_implicit(kind.value, progress), progress, kind)
            return since if kind is PauseKind.DATA else now - age
        if opened is None or change is PauseChange.NONE:
            return None
        self._pause = None
        self._busy.leave(opened[0])
        if change is PauseChange.END and self.phase is Phase.RUNNING and self._busy.since is None:
            self._progress.pause_ended(now)  # the end of the pause is progress (see ``Guardian.busy``)
        return now

    def evaluation(self, period: float) -> float | None:
        """Open or close the implicit evaluation section (``busy.evaluation_change``); called by the
        activity watch's thread every ``period``, never by the training thread, so a step pays nothing
        for it. Reads the model's ``training`` flag (a plain attribute: fine from another thread; the
        thread-local ``torch.no_grad`` is not visible from here). Returns when the status changed (unix
        seconds: an evaluation began after the loop's code did and after the last look that found the model
        in train mode, so the watch's delay is no step gap), or None when it did not."""
        progress = self.progress()  # first: a step after this makes the section stale, not missed
        current = self._activity.current
        activity, since = current
        eval_mode = not self.module.training
        now = time.time()
        if not eval_mode:
            self._train_mode_seen = now
        if (
            eval_mode
            and activity in STEP_ACTIVITIES
            and self.phase is Phase.RUNNING  # a rollback's validation runs in a step, in eval mode
            and self._activity.current is current  # the mode was read inside that very activity
            and not self._trains_in_eval_mode
        ):
            self._trains_in_eval_mode = True
            log.info("the model is trained in eval mode: eval mode no longer counts as an evaluation")
        opened = self._evaluation
        change = evaluation_change(
            None if opened is None else opened[1],
            progress,
            self.phase,
            activity,
            now - since,
            period,
            eval_mode,
            self._trains_in_eval_mode,
        )
        if change is EvalChange.BEGIN:
            self._evaluation = (self._busy.enter_implicit(EVAL_MODE_REASON, progress), progress)
            return max(since, self._train_mode_seen)  # it began after both
        if opened is None or change is EvalChange.NONE:
            return None
        self._evaluation = None
        self._busy.leave(opened[0])
        stepped = progress != opened[1]  # the step set the step time itself
        if not stepped and self.phase is Phase.RUNNING and self._busy.since is None:
            # The end of the pause is progress, as a busy section's is (see ``Guardian.busy``), also when the
            # watch first sees the next step's work (model.train() and a backward within one look):
            # until that step's own status, this one must not carry the step time from before it.
            self._progress.pause_ended(now)
        return now

    def peer_changed(self) -> None:
        """The busy peer this rank waits for appeared or went (the peer watch's thread)."""
        if self.phase is Phase.RUNNING and not self._busy.waiting and self._busy.since is None:
            # The end of the wait is progress, as the end of a busy section is: the status that says
            # "running" again must not carry the step time from before the wait, which the sidecar
            # would count against the hang timeout until this rank's next step.
            self._progress.pause_ended()
        self._reporter.publish(self._life.phase, True)

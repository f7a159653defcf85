"""Publishing a worker's status: the file its sidecar reads, and the termination message that outlives it.

``StatusReporter`` turns the guardian's ``status()`` into the status file at most every
``status_interval_seconds`` (a phase change or a forced publish: at once), from the training thread and
the peer watch alike, and writes the final status into the container's termination message. The payload
itself is the contract's ``WorkerStatus`` (``trainer_sidecar.contract.status``).

``ActivityTracker`` holds where the training thread is (``Activity``) and since when. The guardian marks
it at its own calls (``mark``: two stores, no write, a few times a step) and the tracker's watch publishes
it from a thread of its own once the training thread has stayed in one activity for a watch period: a
rank that blocks in a collective (or anywhere) has said so within a period or two of blocking, well
inside any hang timeout, and a rank that steps normally costs no extra write. The training thread itself
cannot publish "about to block" for free: it cannot know which collective will block, and writing the
file before every one would be a write a step. A thread that holds the GIL while it hangs (a C extension
stuck without releasing it) starves the watch too; its status then keeps the last activity published.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from trainer_sidecar.contract.env import STATUS_FILE_ENV
from trainer_sidecar.contract.hang import GapLearner, ProgressGaps
from trainer_sidecar.contract.status import (
    Activity,
    Phase,
    StatusPublisher,
    WorkerStatus,
    write_termination_message,
)
from trainer_sidecar.guardian.activity import ActivityTracker
from trainer_sidecar.guardian.config import ConfigError

log = logging.getLogger("trainguard")

#: How often the activity watch looks, and how long an activity must last before it is published.
ACTIVITY_WATCH_SECONDS = 0.5


class StatusReporter:
    """Publishes what ``status`` returns; safe to call from several threads.

    Promises: a status file that cannot be written the first time is a ``ConfigError`` (a setting that
    cannot work); one that stops being writable later (a full disk) is logged once per outage and
    training goes on, the sidecar judging the silence as it judges a hang. The termination message is
    best effort: a worker never fails for it.
    """

    def __init__(
        self,
        status_file: Path | None,
        interval_seconds: float,
        termination_message_path: Path | None,
        status: Callable[[], WorkerStatus],
        tracker: ActivityTracker | None = None,
    ) -> None:
        self._publisher = StatusPublisher(status_file, interval_seconds)
        self._termination_message_path = termination_message_path
        self._status = status
        self._lock = threading.Lock()  # the main thread, the peer watch and the activity watch publish
        self._failing = False
        self.tracker = tracker if tracker is not None else ActivityTracker()
        self._published: tuple[Activity, float] | None = None  # the activity the file says
        self._watch_stop = threading.Event()
        self._watch: threading.Thread | None = None
        self._learner = GapLearner()
        self._carried: ProgressGaps | None = None

    def publish(self, phase: Phase, force: bool = False, at: float | None = None) -> None:
        """Write the current status if it is due for ``phase`` (or ``force``). Each status written carries
        the gaps between the progress changes published so far (``contract.hang``): timed here, where
        the sidecar's view of progress is made, on the monotonic clock. ``at``: when the change this
        status publishes happened (unix seconds), if it was found later (a pause the activity watch
        inferred): the gap it ends is timed to then, not to the watch's delay."""
        with self._lock:
            if force or self._publisher.due(phase):
                activity = self.tracker.current  # read before the status: never newer than what it says
                status = self._status()
                progress = (status.phase.value, status.step, status.steps_total)
                now = time.monotonic()
                if at is not None:
                    now -= max(0.0, time.time() - at)
                learner = self._learner.published(progress, status.phase is Phase.RUNNING, now)
                status.progress_gaps = learner.gaps.count
                status.longest_progress_gap_seconds = learner.gaps.longest
                try:
                    self._publisher.publish(status, force=True)
                except OSError as exc:
                    self._unwritable(exc)
                else:
                    self._failing = False
                    self._published = activity
                    self._learner = learner  # unwritten progress is none the sidecar saw

    @property
    def pace(self) -> ProgressGaps:
        """What the job has learned of its pace (``contract.hang``), for a checkpoint: this process's
        record once its warm-up is over; before, the record it carried over from its resume, if any."""
        with self._lock:
            gaps = self._learner.gaps
            if not gaps.learned(self._learner.warmup) and self._carried is not None:
                return self._carried
            return ProgressGaps(gaps.count, gaps.longest)

    def carry(self, saved: ProgressGaps) -> None:
        """Start from the pace a checkpoint this run resumed from saved (``ProgressGaps.resumed``: its
        longest gap, after a short warm-up of this process), unless this process has learned its own."""
        with self._lock:
            learner = self._learner
            resumed = saved.resumed(learner.warmup)
            if not learner.gaps.learned(learner.warmup) and resumed != ProgressGaps():
                self._learner = replace(learner, gaps=resumed)
                self._carried = saved

    def stale_activity(self, now: float, period: float) -> bool:
        """Whether the file says another activity (or start) than the training thread's current one,
        which has lasted ``period`` seconds by ``now``: a stall worth a write."""
        current = self.tracker.current
        return self._published is not None and current != self._published and now - current[1] >= period

    def watch_activity(
        self,
        phase: Callable[[], Phase],
        period: float = ACTIVITY_WATCH_SECONDS,
        look: Callable[[float], float | None] | None = None,
    ) -> None:
        """Publish, from a daemon thread, an activity the training thread has stayed in for ``period``
        seconds that the file does not say yet (see the module docstring); nothing without a status file.
        ``look(period)``, if given, is called from that thread every period first; when it returns a time
        (unix seconds) something changed then (the guardian's inferred evaluation began or ended), and a
        status is published (see ``publish``'s ``at``). ``stop_watching`` ends it."""
        if self._publisher.path is None or self._watch is not None:
            return

        def run() -> None:
            while not self._watch_stop.wait(period):
                try:
                    changed = None if look is None else look(period)
                except Exception:  # as below: the watch must go on
                    log.debug("looking at the training thread failed", exc_info=True)
                    changed = None
                if changed is None and not self.stale_activity(time.time(), period):
                    continue
                try:
                    self.publish(phase(), force=True, at=changed)
                except Exception:  # the sidecar judges a silent worker; the watch must not die loudly
                    log.debug("publishing the activity failed", exc_info=True)

        self._watch = threading.Thread(target=run, name="trainguard-activity-watch", daemon=True)
        self._watch.start()

    def stop_watching(self, wait_seconds: float = 5.0) -> None:
        """Stop the activity watch, and wait (at most ``wait_seconds``) for its thread to end: once this
        returns, the watch neither publishes nor looks (``look``) again, unless a write hung past it."""
        self._watch_stop.set()
        watch = self._watch
        if watch is not None and watch is not threading.current_thread():
            watch.join(wait_seconds)

    def _unwritable(self, exc: OSError) -> None:
        where = f"the status file {self._publisher.path} ({STATUS_FILE_ENV} or status_file=)"
        if not self._publisher.written:
            raise ConfigError(f"{where} cannot be written: {exc}") from exc
        if not self._failing:
            log.error("%s cannot be written; the sidecar sees no progress until it can: %s", where, exc)
        self._failing = True

    def write_termination_message(self) -> None:
        """The final status into the container's termination message (``TRAINGUARD_TERMINATION_MESSAGE_PATH``,
        set by the orchestrator): it is read from the pod after the sidecar has gone."""
        path = self._termination_message_path
        if path is None:
            return
        try:
            status = self._status()
            status.progress_gaps = self._learner.gaps.count
            status.longest_progress_gap_seconds = self._learner.gaps.longest
            write_termination_message(path, status)
        except OSError as exc:
            log.warning("could not write the termination message to %s: %s", path, exc)

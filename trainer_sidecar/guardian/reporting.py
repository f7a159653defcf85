"""Publishing a worker's status: the file its sidecar reads, and the termination message that outlives it.

``StatusReporter`` turns the guardian's ``status()`` into the status file at most every
``status_interval_seconds`` (a phase change or a forced publish: at once), from the training thread and
the peer watch alike, and writes the final status into the container's termination message. The payload
itself is the contract's ``WorkerStatus`` (``trainer_sidecar.contract.status``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainer_sidecar.contract.env import STATUS_FILE_ENV
from trainer_sidecar.contract.hang import GapLearner
from trainer_sidecar.contract.status import (
    Phase,
    StatusPublisher,
    WorkerStatus,
    write_termination_message,
)
from trainer_sidecar.guardian.config import ConfigError

log = logging.getLogger("trainguard")


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
    ) -> None:
        self._publisher = StatusPublisher(status_file, interval_seconds)
        self._termination_message_path = termination_message_path
        self._status = status
        self._lock = threading.Lock()  # the main thread and the peer watch both publish
        self._failing = False
        self._learner = GapLearner()

    def publish(self, phase: Phase, force: bool = False) -> None:
        """Write the current status if it is due for ``phase`` (or ``force``). Each status written carries
        the gaps between the progress changes published so far (``contract.hang``): timed here, where
        the sidecar's view of progress is made, on the monotonic clock."""
        with self._lock:
            if force or self._publisher.due(phase):
                status = self._status()
                progress = (status.phase.value, status.step, status.steps_total)
                learner = self._learner.published(progress, status.phase is Phase.RUNNING, time.monotonic())
                status.progress_gaps = learner.gaps.count
                status.longest_progress_gap_seconds = learner.gaps.longest
                try:
                    self._publisher.publish(status, force=True)
                except OSError as exc:
                    self._unwritable(exc)
                else:
                    self._failing = False
                    self._learner = learner  # unwritten progress is none the sidecar saw

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

"""Where a run starts: the newest checkpoint restored, or the loop's own start step.

``Start.resume`` restores the newest checkpoint every rank can load (through the checkpoint manager,
``guardian.checkpointing`` and ``guardian.resume``), adopts its counters, carries the learned pace into
the status reporter, makes it the first rollback point and validates it; with no checkpoint of the
guardian's own and a loop that says where it is (``start_step``), the run continues there
(``continue_at``). ``resumed_step`` is where this attempt started.

Built by the Guardian with what it starts, called only by it.
"""

from __future__ import annotations

import logging

from trainer_sidecar.contract.settings import GuardianSettings
from trainer_sidecar.guardian.checkpointing import CheckpointManager
from trainer_sidecar.guardian.counters import GuardCounters
from trainer_sidecar.guardian.recovery import Recovery
from trainer_sidecar.guardian.reporting import StatusReporter
from trainer_sidecar.guardian.training import TrainingObjects

__all__ = ["Start"]


class Start:
    """The start of this attempt: from the guardian's own checkpoint, or at the loop's ``start_step``."""

    def __init__(
        self,
        settings: GuardianSettings,
        training: TrainingObjects,
        counters: GuardCounters,
        checkpoints: CheckpointManager,
        recovery: Recovery,
        reporter: StatusReporter,
        start_step: int | None,
    ) -> None:
        self.settings, self.training, self.counters = settings, training, counters
        self.checkpoints, self._recovery, self._reporter = checkpoints, recovery, reporter
        self.gang, self.checkpoint_dir = checkpoints.gang, checkpoints.directory
        self._start_step = start_step
        self.resumed_step = 0

    def resume(self) -> int | None:
        """Restore the newest checkpoint every rank can load (see ``Guardian.resume``): its step, or None."""
        resumed = self.checkpoints.resume(self.settings.guard.loss_spike_window)
        if resumed is None:
            if self._start_step is not None:
                self.continue_at(self._start_step)
            return None
        checkpoint, counters = resumed
        self.counters.adopt(counters)
        self.resumed_step = checkpoint.step
        self._reporter.carry(self.counters.pace)
        self._recovery.take_snapshot()
        self.gang.log(
            logging.WARNING,
            "resumed from the clean checkpoint at step %d (%s)",
            checkpoint.step,
            self.checkpoint_dir,
        )
        if self._start_step is not None and self._start_step != checkpoint.step:
            self.gang.log(
                logging.WARNING,
                "start_step=%d is not used: the guardian's own checkpoint at step %d takes over (its "
                "weights, optimizer, data position and counters replace what the loop loaded)",
                self._start_step,
                checkpoint.step,
            )
        self._recovery.validated("resume")
        return checkpoint.step

    def continue_at(self, step: int) -> None:
        """Continue a run whose earlier steps the guardian did not see (the loop loaded its own checkpoint):
        ``step_count`` starts at ``step``. The weights, optimizer and scheduler are whatever the loop loaded
        before the guardian was made; the starting snapshot (a rollback's floor) is taken of them. Data:
        a loop drawing its own batches draws on as it would; a loader given to the guardian starts at the
        beginning of its order (epoch 0), since the earlier run's order was not the guardian's. From the
        guardian's first checkpoint on, step, weights and data position are saved together."""
        self.counters.step = step
        self.resumed_step = step
        scheduler = self.training.scheduler
        if scheduler is not None and scheduler.last_epoch != step:
            self.gang.log(
                logging.WARNING,
                "start_step=%d but the scheduler given to the guardian has stepped %d times: load its "
                "state_dict from the loop's checkpoint too, or the schedule restarts",
                step,
                scheduler.last_epoch,
            )
        self.gang.log(
            logging.WARNING,
            "no checkpoint of the guardian's own yet: continuing at start_step=%d as the loop says",
            step,
        )

"""The step pipeline's verdict carried out: a kept step applied, a bad one rejected.

After the measurement (``guardian.measure``) and the judge (``guardian.judge``), ``StepPipeline`` applies a
kept step (the clipped, remediated update; the counters; a snapshot and a checkpoint when due, through
``guardian.recovery``) or rejects a bad one (nothing reaches the weights; the batches of a non-finite
step dead-lettered; the first non-finite module named; a forensics bundle; then skip, roll back or
diverge as the verdict says). A step boundary past the declared end is refused.

Built by the Guardian with what it works on, called only by it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer_sidecar.contract.compute import ComputeWindow
from trainer_sidecar.contract.settings import GuardianSettings
from trainer_sidecar.contract.status import Activity
from trainer_sidecar.guardian.activity import ActivityTracker
from trainer_sidecar.guardian.checkpointing import CheckpointManager
from trainer_sidecar.guardian.counters import GuardCounters
from trainer_sidecar.guardian.data import DeadLetters
from trainer_sidecar.guardian.ending import Lifecycle
from trainer_sidecar.guardian.faults import FaultInjector
from trainer_sidecar.guardian.feed import DataFeed
from trainer_sidecar.guardian.forensics import Anomaly, BatchRef, write_bundle
from trainer_sidecar.guardian.gang import Gang
from trainer_sidecar.guardian.judge import NON_FINITE_GRADIENTS, NON_FINITE_LOSS, Action, StepReading, Verdict
from trainer_sidecar.guardian.loading import Accumulation
from trainer_sidecar.guardian.localize import NaNLocator
from trainer_sidecar.guardian.measure import StepMeasure
from trainer_sidecar.guardian.progress import ProgressClock
from trainer_sidecar.guardian.recovery import Recovery
from trainer_sidecar.guardian.reporting import StatusReporter
from trainer_sidecar.guardian.training import TrainingObjects

log = logging.getLogger("trainguard")


@dataclass(frozen=True)
class StepOutcome:
    """What one call to ``Guardian.step`` did."""

    boundary: bool
    applied: bool = False
    loss: float = math.nan
    grad_norm: float = math.nan
    reason: str = ""
    rolled_back: bool = False


class StepPipeline:
    """Carries out a step's verdict: ``apply`` a kept step, ``reject`` a bad one, ``past_the_end`` refuse
    one after the declared end. ``last_grad_norm`` is the newest step's norm, ``nan_location`` the module
    whose output went non-finite first (once found)."""

    def __init__(
        self,
        settings: GuardianSettings,
        training: TrainingObjects,
        counters: GuardCounters,
        parts: tuple[StepMeasure, Recovery, CheckpointManager, NaNLocator, FaultInjector],
        data: tuple[DataFeed, DeadLetters, Accumulation],
        status: tuple[Lifecycle, StatusReporter, ProgressClock, ActivityTracker, ComputeWindow],
        gang: Gang,
    ) -> None:
        self.settings, self.training, self.counters, self.gang = settings, training, counters, gang
        self._meter, self._recovery, self._checkpoints, self._locator, self._faults = parts
        self.feed, self.dead_letters, self._acc = data
        self._life, self._reporter, self._progress, self._activity, self._compute = status
        self._mark = self._activity.mark
        self.checkpoint_dir = self._checkpoints.directory
        self.last_grad_norm: float | None = None
        self.nan_location: str | None = None
        self._past_end_warned = False

    def _publish(self, force: bool = False) -> None:
        self._reporter.publish(self._life.phase, force)

    def slow_down(self) -> None:
        """The ``slow`` fault: stretch this step's own compute so far (the loop's forward and backward) by
        its factor, with a sleep in the guardian's step, before the step's collective: the rank's own work,
        as a slow machine's would be."""
        factor = self._faults.slow_factor(self.counters.step)
        if factor > 1.0:
            time.sleep((factor - 1.0) * self._compute.since_lap(self._activity.own))

    def past_the_end(self, max_steps: int | None) -> StepOutcome:
        """A step boundary once ``max_steps`` steps are kept: nothing is applied, counted or saved.

        A loop that tests its end after the step (nanoGPT's ``iter_num += 1; if iter_num > max_iters:
        break``) trains once more on every start: rerunning a finished job would train (and, at its
        end, checkpoint) one more step each time. The declared end is the guardian's to keep; every
        rank holds the same step, so every rank refuses alike, without a collective."""
        self.training.unscale()  # a GradScaler's update needs its inf checks recorded
        self.training.drop_update()
        self._acc.loss_sum, self._acc.batches = None, []
        self._mark(Activity.LOOP)
        reason = f"past max_steps={max_steps}: not applied (training is over)"
        if not self._past_end_warned:
            self._past_end_warned = True
            self.gang.log(logging.WARNING, "step %d is %s", self.counters.step, reason)
        return StepOutcome(boundary=True, applied=False, reason=reason)

    def apply(
        self,
        verdict: Verdict,
        reading: StepReading,
        current_norm: float,
        batches: list[BatchRef],
        when: tuple[bool, int | None],
    ) -> StepOutcome:
        """A kept step: the update applied, counted, snapshot and checkpoint when due (``when``: whether the
        gang agreed a checkpoint is due by time, and the run's declared last step)."""
        time_due, last_step = when
        counters = self.counters
        self._recovery.settle()
        self.training.apply_update(
            current_norm,
            counters.max_grad_norm,
            self._meter.grads,
            self._meter.norm,
            lr_scale=counters.lr_scale,
        )
        counters.history, counters.explosion_pattern = verdict.history, None
        counters.optimizer_steps += 1
        counters.step += 1
        self.last_grad_norm = reading.grad_norm
        self._progress.stepped()
        self._recovery.kept(batches)
        if self._locator.armed:
            self._located(self._locator.after_good_step())
        unclean = self._recovery.save_if_due(time_due, counters.step == last_step)
        self._mark(Activity.LOOP)  # what a periodic status says until the next mark is published
        self._publish()
        return StepOutcome(
            boundary=True, applied=unclean is None, loss=reading.loss, grad_norm=reading.grad_norm,
            reason=unclean.reason if unclean else "", rolled_back=unclean is not None,
        )  # fmt: skip

    def reject(
        self,
        verdict: Verdict,
        reading: StepReading,
        batches: list[BatchRef],
        replay: Callable[[], Any] | None,
        locally_nonfinite: bool,
    ) -> StepOutcome:
        """A bad step: nothing reaches the weights; then skip, roll back or diverge as the judge says."""
        self.training.drop_update()
        counters = self.counters
        in_a_row = counters.history.consecutive_bad + int(verdict.counts_as_bad)
        counters.history = verdict.history
        counters.skipped_steps += 1
        counters.step += 1
        counters.spikes += int(verdict.spike)
        counters.explosion_pattern = verdict.pattern or counters.explosion_pattern
        self.last_grad_norm = reading.grad_norm
        self._progress.stepped()
        self.gang.log(
            logging.WARNING,
            "step %d skipped: %s (loss %.4g, grad norm %.4g, %d bad in a row%s)",
            counters.step - 1, verdict.reason, reading.loss, reading.grad_norm,
            in_a_row, f", pattern {verdict.pattern}" if verdict.pattern else "",
        )  # fmt: skip
        if verdict.cause in (NON_FINITE_LOSS, NON_FINITE_GRADIENTS):
            for batch in batches:
                self.dead_letters.add(
                    batch.epoch, batch.index, write=self.gang.rank == 0, step=counters.step - 1,
                    reason=verdict.reason, kind="non-finite", span=self.feed.span(batch.epoch, batch.index),
                )  # fmt: skip
        if verdict.cause == NON_FINITE_LOSS:
            self._localize(replay, locally_nonfinite)
        self._forensics(verdict.cause, reading, batches)
        self._recovery.carry_out(verdict)
        self._mark(Activity.LOOP)
        self._publish(force=True)
        return StepOutcome(
            boundary=True, applied=False, loss=reading.loss, grad_norm=reading.grad_norm,
            reason=verdict.reason, rolled_back=verdict.action is Action.ROLL_BACK,
        )  # fmt: skip

    def _localize(self, replay: Callable[[], Any] | None, locally_nonfinite: bool) -> None:
        if self.nan_location is not None or not locally_nonfinite:
            return
        budget = self.settings.guard.max_consecutive_bad_steps
        self._located(self._locator.after_nonfinite_loss(replay, budget))

    def _located(self, where: str | None) -> None:
        if where is not None:
            self.nan_location = where
            log.warning("NaN localisation: first non-finite output from %s", where)

    def _forensics(self, reason: str, reading: StepReading, batches: list[BatchRef]) -> None:
        if self.checkpoint_dir is None:
            return
        history = self.counters.history
        anomaly = Anomaly(
            step=self.counters.step - 1,
            iteration=history.iteration,
            rank=self.gang.rank,
            reason=reason,
            loss=reading.loss,
            grad_norm=reading.grad_norm,
            explosion_pattern=self.counters.explosion_pattern,
            nan_location=self.nan_location,
            batches=batches,
            losses=history.losses,
            grad_norms=history.grad_norms,
        )
        write_bundle(self.checkpoint_dir, anomaly)

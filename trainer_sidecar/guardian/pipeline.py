"""The step pipeline's verdict carried out: a kept step applied, a bad one rejected.

(Moved verbatim out of ``guardian.py``; reshaped into a collaborator in the next commit.)
"""
# mypy: disable-error-code="attr-defined"

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer_sidecar.contract.status import Activity
from trainer_sidecar.guardian.forensics import Anomaly, BatchRef, write_bundle
from trainer_sidecar.guardian.judge import NON_FINITE_GRADIENTS, NON_FINITE_LOSS, Action, StepReading, Verdict

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


class PipelineMixin:
    """The Guardian's step pipeline methods (moved verbatim)."""

    def _slow_down(self) -> None:
        """The ``slow`` fault: stretch this step's own compute so far (the loop's forward and backward) by
        its factor, with a sleep in the guardian's step, before the step's collective: the rank's own work,
        as a slow machine's would be."""
        factor = self._faults.slow_factor(self.counters.step)
        if factor > 1.0:
            time.sleep((factor - 1.0) * self._compute.since_lap(self._activity.own))

    def _past_the_end(self) -> StepOutcome:
        """A step boundary once ``max_steps`` steps are kept: nothing is applied, counted or saved.

        A loop that tests its end after the step (nanoGPT's ``iter_num += 1; if iter_num > max_iters:
        break``) trains once more on every start: rerunning a finished job would train (and, at its
        end, checkpoint) one more step each time. The declared end is the guardian's to keep; every
        rank holds the same step, so every rank refuses alike, without a collective."""
        self.training.unscale()  # a GradScaler's update needs its inf checks recorded
        self.training.drop_update()
        self._acc.loss_sum, self._acc.batches = None, []
        self._mark(Activity.LOOP)
        reason = f"past max_steps={self.max_steps}: not applied (training is over)"
        if not self._past_end_warned:
            self._past_end_warned = True
            self.gang.log(logging.WARNING, "step %d is %s", self.counters.step, reason)
        return StepOutcome(boundary=True, applied=False, reason=reason)

    def _apply(
        self,
        verdict: Verdict,
        reading: StepReading,
        current_norm: float,
        batches: list[BatchRef],
        time_due: bool = False,
    ) -> StepOutcome:
        counters = self.counters
        self.settle()
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
        unclean = self._recovery.save_if_due(time_due, counters.step == self.max_steps)
        self._mark(Activity.LOOP)  # what a periodic status says until the next mark is published
        self._publish()
        return StepOutcome(
            boundary=True, applied=unclean is None, loss=reading.loss, grad_norm=reading.grad_norm,
            reason=unclean.reason if unclean else "", rolled_back=unclean is not None,
        )  # fmt: skip

    def _reject(
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
                    batch.epoch, batch.index, write=self.rank == 0, step=counters.step - 1,
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
            rank=self.rank,
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

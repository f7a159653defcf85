"""Recovery: the snapshot, whether the state is clean, the rollback and the remediation.

(Moved verbatim out of ``guardian.py``; reshaped into a collaborator in the next commit.)
"""
# mypy: disable-error-code="attr-defined"

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from trainer_sidecar.checkpoint import FencedError
from trainer_sidecar.contract.settings import Remediation, RemediationOrder
from trainer_sidecar.contract.status import Activity, Phase
from trainer_sidecar.guardian.counters import describe_clip
from trainer_sidecar.guardian.judge import Action, Verdict, judge_saved_state

log = logging.getLogger("trainguard")


class RecoveryMixin:
    """The Guardian's recovery methods (moved verbatim)."""

    def _carry_out(self, verdict: Verdict) -> None:
        if verdict.action is Action.DIVERGE:
            self._end.diverge(verdict.reason, self.checkpoints)
        elif verdict.action is Action.ROLL_BACK:
            self._rollback(verdict.reason)

    def _save_if_due(self, time_due: bool = False) -> Verdict | None:
        """After a kept step: snapshot and checkpoint when due (by steps, or by time as the gang agreed), if
        the whole state is finite. Returns the verdict that rolled back (or diverged) when the state was
        not clean, else None."""
        policy = self.settings.checkpoint
        step = self.counters.step
        snapshot_due = step % policy.snapshot_every_steps == 0
        # The declared end is checkpointed where every rank is, at its step boundary: at exit a gang may
        # no longer agree on anything (``trainer_sidecar.guardian.ending``).
        checkpoint_due = self.checkpoints.due(step, time_due or step == self.max_steps)
        if not (snapshot_due or checkpoint_due):
            return None
        unclean = self._unclean_state()
        if unclean is not None:
            return unclean
        # A checkpoint is a snapshot too: a rollback never returns behind the newest clean checkpoint.
        self._take_snapshot()
        if checkpoint_due:
            self._save_checkpoint()
        if step == self.max_steps:
            # No next step to overlap the copies with, and what follows the end often changes the weights
            # in place (loading the best model to test it): the copies land before the loop goes on.
            self.settle()
        return None

    def _unclean_state(self) -> Verdict | None:
        """None when the whole training state is finite on every rank (one collective, one host sync; a
        second of each only when the fast screen cannot prove it finite: a real NaN, or huge values).

        When it is not, the judge decides (roll back at once, or diverge when the budget is spent), the
        verdict is carried out and returned."""
        finite = not self._agreed_flag(self.training.maybe_nonfinite_flag)
        if not finite:
            # The screen can overflow on large finite values: only the exact check may call a state unclean
            # (every rank saw the same screen, so every rank takes this second collective alike).
            finite = not self._agreed_flag(self.training.nonfinite_flag)
        verdict = judge_saved_state(self.settings.guard, self.counters.history, finite)
        if verdict.action is Action.APPLY:
            return None
        self._log_gang(
            logging.ERROR,
            "step %d: the training state holds non-finite values; it is not saved",
            self.counters.step,
        )
        self.counters.history = verdict.history
        self.message = verdict.reason
        self._carry_out(verdict)
        return verdict

    def _agreed_flag(self, flag: Callable[[], torch.Tensor]) -> bool:
        """Whether ``flag()`` (a 0-dim 0.0/1.0 tensor) is set on any rank: one collective, one host sync."""
        local = flag().reshape(1)
        with self.gang.waiting():
            return bool(self.gang.all_reduce(local, _MAX).item())

    def _take_snapshot(self) -> None:
        # Parameters and optimizer state are copied while the next forward and backward passes run; the
        # next optimizer step (or a rollback) waits for the copy first (``_settle_copies``).
        self._snapshot.capture(
            self.counters.step,
            self.module,
            self.optimizer,
            self.training.small_state(),
            {"counters": self.counters.copy(), "tracked": self.feed.rollback_state()},
            background=self._copies_in_background,
        )
        self._window_batches.clear()

    def settle(self) -> None:
        """Wait until the snapshot and checkpoint copies running in the background have read the state.

        The guardian copies parameters and optimizer state while the next forward and backward passes
        run, and waits only before the next optimizer step. A loop that changes parameters or optimizer
        state in place between steps (weight clamping, a manual re-initialisation) calls this first; on
        a GPU the current stream waits, not the host. A loop that does not is noticed at the next step
        (by the tensors' version counters): nothing torn is kept, and copies are synchronous after."""
        snapshot_changed = self._snapshot.settle()
        checkpoint_changed = self.checkpoints.settle()
        if snapshot_changed or checkpoint_changed:
            self._changed_before_settle(checkpoint_changed)

    def _changed_before_settle(self, checkpoint_changed: bool) -> None:
        """The loop changed parameters or optimizer state in place after a step without calling ``settle``
        first, so a background copy may hold part of the change. The snapshot has copied the state again
        (as it is now); a checkpoint whose copy had not landed first is not written. Every later copy is
        synchronous: one stall per snapshot and checkpoint, and no torn copy again."""
        if self._copies_in_background:
            self._log_gang(
                logging.WARNING,
                "step %d: the training loop changed parameters or optimizer state in place between steps "
                "without calling guardian.settle() first; snapshots and checkpoints are copied "
                "synchronously from now on%s",
                self.counters.step,
                f" (the checkpoint of step {self.checkpoints.checkpointed_step} may be lost)"
                if checkpoint_changed
                else "",
            )
        self._copies_in_background = False

    def _save_checkpoint(self) -> None:
        stable = self.training.stable_storage() if self._copies_in_background else None
        before = self._mark(Activity.CHECKPOINT)
        try:
            if self.checkpoints.writing:
                # A save waits for the previous write still in flight (checkpoints slower than their
                # cadence): a pause of the checkpoint's length, declared so that no learned hang deadline
                # (``contract.hang``) takes it for a hang; its end is progress.
                with self.busy("checkpoint: waiting for the previous write"):
                    self.checkpoints.wait()
            self.counters.pace = self._reporter.pace
            self.checkpoints.save(self.counters, stable, self.rank)
        except FencedError as exc:
            self._end.fenced(exc)
        self._mark(before)

    def save_checkpoint(self) -> bool:
        """Start an asynchronous checkpoint of the current step if the whole state is clean.

        Returns False without a checkpoint directory, or when the state is not clean (then the guardian
        rolled back, or diverged). Every rank must call it at the same step (it agrees collectively).
        """
        if not self.checkpoints.enabled or self._unclean_state() is not None:
            return False
        self._save_checkpoint()
        return True

    def _rollback(self, reason: str) -> None:
        # A rollback makes no steps for a while (the restore, then the held-out validation, which may take
        # minutes on a large model): the status says so, and the sidecar gives it the startup grace
        # instead of the hang timeout.
        self.phase = Phase.ROLLING_BACK
        self.busy_since = time.time()
        self._publish(force=True)
        from_step = self.counters.step
        self.settle()
        self.training.load_small_state(self._snapshot.restore(self.module, self.optimizer))
        self.counters.rewind_to(self._snapshot.extra["counters"])
        self.feed.roll_back(self._snapshot.extra["tracked"])  # a per-epoch scheduler agrees with the lr
        # The data does not rewind: the window that led here is skipped, and remembered for replays.
        for batch in self._window_batches:
            span = self.feed.span(batch.epoch, batch.index)
            self.dead_letters.add(
                batch.epoch, batch.index, write=self.rank == 0, kind="rolled-back window", span=span
            )
        self.counters.rollbacks += 1
        self._remediate(self.settings.remediation)
        # The restored state is clean; re-snapshot it so a further rollback compounds the remediation.
        self._take_snapshot()
        self._log_gang(
            logging.WARNING,
            "rolled back from step %d to step %d after %s; lr scale now %.4g, %s",
            from_step, self.counters.step, reason, self.counters.lr_scale,
            describe_clip(self.counters.max_grad_norm),
        )  # fmt: skip
        if not self._driven:
            # The loop is not iterating ``guardian.steps()``/``run()``, so it may count steps of its own:
            # such a counter now runs ahead of the model (the schedule shifts, fewer steps are kept).
            self._log_gang(
                logging.WARNING,
                "step_count went back to %d: a loop that counts its own steps must take guardian.step_count "
                "again (for iter_num in guardian.steps(max_iters): ... cannot drift)",
                self.counters.step,
            )
        self._check_validation("rollback")
        # Every rank stays "rolling back" until the slowest one has validated: otherwise the faster
        # ranks would wait for it in their next all-reduce and look hung.
        self.gang.barrier()
        self.phase = Phase.RUNNING
        self.busy_since = None
        self._progress.stepped()  # the rollback itself is progress: the hang clock restarts
        self._publish(force=True)

    def _remediate(self, remediation: Remediation) -> None:
        # The learning rates are scaled when the optimizer steps (``TrainingObjects.apply_update``), so a
        # loop that sets its own learning rate every iteration cannot undo the remediation.
        self.counters.lr_scale *= remediation.lr_scale
        self.counters.tighten_clip(remediation.max_grad_norm)

    def _apply_orchestrator_remediation(self) -> None:
        order: RemediationOrder | None = self.config.remediation
        if order is None or order.id in self.counters.remediations_applied:
            return
        self._remediate(order)
        self.counters.remediations_applied.append(order.id)
        self._log_gang(
            logging.WARNING,
            "applied remediation %s from the orchestrator: lr scale %.4g, %s",
            order.id,
            self.lr_scale,
            describe_clip(self.max_grad_norm),
        )

    def _check_validation(self, when: str) -> None:
        if self.validate is None:
            return
        value = float(self.validate())
        self.message = f"held-out loss after {when}: {value:.4g}"
        log.info("%s", self.message)


_MAX = torch.distributed.ReduceOp.MAX

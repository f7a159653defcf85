"""Recovery: the rollback point (the snapshot), whether the state is clean, the rollback, the remediation.

``Recovery`` keeps the last clean state in memory (``guardian.snapshot``), checks the whole training state
is finite before anything is kept (a snapshot, a checkpoint: one collective), rolls the model, optimizer,
counters and tracked objects back to the snapshot when the judge says so (the data does not rewind: the
window that led there is dead-lettered), and applies remediation (the learning rates scaled, the clip
tightened) after each rollback and once per orchestrator order. What to do with a bad step is the
judge's (``guardian.judge``); the facade hands the verdict over.

Built by the Guardian with the collaborators it works on, and called only by it: nothing here reads the
Guardian.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from trainer_sidecar.checkpoint import FencedError
from trainer_sidecar.contract.settings import GuardianSettings, Remediation, RemediationOrder
from trainer_sidecar.contract.status import Activity, Phase
from trainer_sidecar.guardian.busy import BusySections, held
from trainer_sidecar.guardian.checkpointing import CheckpointManager
from trainer_sidecar.guardian.config import ConfigError
from trainer_sidecar.guardian.counters import GuardCounters, describe_clip
from trainer_sidecar.guardian.data import DeadLetters
from trainer_sidecar.guardian.ending import Lifecycle, WorkerEnd
from trainer_sidecar.guardian.feed import DataFeed
from trainer_sidecar.guardian.forensics import BatchRef
from trainer_sidecar.guardian.gang import Gang
from trainer_sidecar.guardian.judge import Action, Verdict, judge_saved_state
from trainer_sidecar.guardian.progress import ProgressClock
from trainer_sidecar.guardian.reporting import StatusReporter
from trainer_sidecar.guardian.snapshot import Snapshot
from trainer_sidecar.guardian.training import TrainingObjects

log = logging.getLogger("trainguard")

__all__ = ["Recovery"]


class Recovery:
    """The snapshot, the cleanliness check, the rollback and the remediation of one worker.

    Promises: nothing is kept (snapshot or checkpoint) unless every value of the training state is finite
    on every rank; a rollback restores weights, optimizer, learning rates, tracked objects and counters of
    one clean step together, and every rank leaves it together; ``driven`` (set by the facade) says the
    loop takes its step numbers from the guardian, so a rollback need not warn of a drifting counter."""

    def __init__(
        self,
        settings: GuardianSettings,
        training: TrainingObjects,
        counters: GuardCounters,
        feed: DataFeed,
        dead_letters: DeadLetters,
        checkpoints: CheckpointManager,
        end: WorkerEnd,
        status: tuple[Lifecycle, StatusReporter, ProgressClock, BusySections],
        mark: Callable[[Activity], Activity],
        validate: Callable[[], float] | None,
    ) -> None:
        self.settings, self.training, self.counters = settings, training, counters
        self.feed, self.dead_letters, self.checkpoints = feed, dead_letters, checkpoints
        self.gang = checkpoints.gang
        self._end, self._mark, self.validate = end, mark, validate
        self._life, self._reporter, self._progress, self._busy = status
        self.snapshot = Snapshot()
        # Batches of the steps kept since the snapshot: dead-lettered when a rollback skips them.
        self._window_batches: list[BatchRef] = []
        # Parameters and optimizer state are copied while the next forward and backward run, until the
        # loop is seen changing them in place between steps without ``settle`` (see ``settle``).
        self._copies_in_background = True
        self.driven = False

    def _publish(self) -> None:
        self._reporter.publish(self._life.phase, True)

    @contextmanager
    def _declared(self, reason: str) -> Iterator[None]:
        """A busy section of the guardian's own (as ``Guardian.busy``)."""
        try:
            section = self._busy.enter(reason, None)
        except ConfigError as error:
            self._end.misused(error)
        with held(self._busy, section, self._mark, self._publish, self._progress):
            yield

    def step_begins(self) -> None:
        """A step begins: the snapshot takes the loop's own state (tracked objects, learning rates) as the
        loop left it after the snapshot's step, once (``Snapshot.complete_loop_state``)."""
        self.snapshot.complete_loop_state(self.feed.rollback_state, self.training.optimizer)

    def kept(self, batches: list[BatchRef]) -> None:
        """A step of ``batches`` was kept: they join the window a rollback skips."""
        self._window_batches.extend(batches)

    def carry_out(self, verdict: Verdict) -> None:
        """Diverge, or roll back, as ``verdict`` says (anything else: nothing to do)."""
        if verdict.action is Action.DIVERGE:
            self._end.diverge(verdict.reason, self.checkpoints)
        elif verdict.action is Action.ROLL_BACK:
            self.rollback(verdict.reason)

    def save_if_due(self, time_due: bool, final: bool) -> Verdict | None:
        """After a kept step: snapshot and checkpoint when due (by steps, by time as the gang agreed, or
        ``final``: the step is the run's declared last), if the whole state is finite. Returns the verdict
        that rolled back (or diverged) when the state was not clean, else None."""
        policy = self.settings.checkpoint
        step = self.counters.step
        snapshot_due = step % policy.snapshot_every_steps == 0
        # The declared end is checkpointed where every rank is, at its step boundary: at exit a gang may
        # no longer agree on anything (``trainer_sidecar.guardian.ending``).
        checkpoint_due = self.checkpoints.due(step, time_due or final)
        if not (snapshot_due or checkpoint_due):
            return None
        unclean = self.unclean_state()
        if unclean is not None:
            return unclean
        # A checkpoint is a snapshot too: a rollback never returns behind the newest clean checkpoint.
        self.take_snapshot()
        if checkpoint_due:
            self.save()
        if final:
            # No next step to overlap the copies with, and what follows the end often changes the weights
            # in place (loading the best model to test it): the copies land before the loop goes on.
            self.settle()
        return None

    def unclean_state(self) -> Verdict | None:
        """None when the whole training state is finite on every rank (one collective, one host sync; a
        second of each only when the fast screen cannot prove it finite: a real NaN, or huge values).

        When it is not, the judge decides (roll back at once, or diverge when the budget is spent), the
        verdict is carried out and returned."""
        finite = not _agreed_flag(self.gang, self.training.maybe_nonfinite_flag)
        if not finite:
            # The screen can overflow on large finite values: only the exact check may call a state unclean
            # (every rank saw the same screen, so every rank takes this second collective alike).
            finite = not _agreed_flag(self.gang, self.training.nonfinite_flag)
        verdict = judge_saved_state(self.settings.guard, self.counters.history, finite)
        if verdict.action is Action.APPLY:
            return None
        self.gang.log(
            logging.ERROR,
            "step %d: the training state holds non-finite values; it is not saved",
            self.counters.step,
        )
        self.counters.history = verdict.history
        self._life.message = verdict.reason
        self.carry_out(verdict)
        return verdict

    def take_snapshot(self) -> None:
        """Make the current state the rollback point (the caller knows it is clean)."""
        # Parameters and optimizer state are copied while the next forward and backward passes run; the
        # next optimizer step (or a rollback) waits for the copy first (``_settle_copies``).
        self.snapshot.capture(
            self.counters.step,
            self.training.module,
            self.training.optimizer,
            self.training.small_state(),
            # The tracked objects' state is taken once, as the loop leaves it after this step: when the next
            # step begins (``step_begins``), or by a rollback that comes first.
            {"counters": self.counters.copy()},
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
        snapshot_changed = self.snapshot.settle()
        checkpoint_changed = self.checkpoints.settle()
        if snapshot_changed or checkpoint_changed:
            self._changed_before_settle(checkpoint_changed)

    def _changed_before_settle(self, checkpoint_changed: bool) -> None:
        """The loop changed parameters or optimizer state in place after a step without calling ``settle``
        first, so a background copy may hold part of the change. The snapshot has copied the state again
        (as it is now); a checkpoint whose copy had not landed first is not written. Every later copy is
        synchronous: one stall per snapshot and checkpoint, and no torn copy again."""
        if self._copies_in_background:
            self.gang.log(
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

    def save(self) -> None:
        """Start a checkpoint of the current state (the caller knows it is clean); a newer writer's claim
        ends the worker (fenced)."""
        stable = self.training.stable_storage() if self._copies_in_background else None
        before = self._mark(Activity.CHECKPOINT)
        try:
            if self.checkpoints.writing:
                # A save waits for the previous write still in flight (checkpoints slower than their
                # cadence): a pause of the checkpoint's length, declared so that no learned hang deadline
                # (``contract.hang``) takes it for a hang; its end is progress.
                with self._declared("checkpoint: waiting for the previous write"):
                    self.checkpoints.wait()
            self.counters.pace = self._reporter.pace
            self.checkpoints.save(self.counters, stable, self.gang.rank)
        except FencedError as exc:
            self._end.fenced(exc)
        self._mark(before)

    def save_checkpoint(self) -> bool:
        """Start an asynchronous checkpoint of the current step if the whole state is clean.

        Returns False without a checkpoint directory, or when the state is not clean (then the guardian
        rolled back, or diverged). Every rank must call it at the same step (it agrees collectively).
        """
        if not self.checkpoints.enabled or self.unclean_state() is not None:
            return False
        self.save()
        return True

    def rollback(self, reason: str) -> None:
        """Go back to the snapshot after ``reason``, skip the window that led here, remediate, validate."""
        # A rollback makes no steps for a while (the restore, then the held-out validation, which may take
        # minutes on a large model): the status says so, and the sidecar gives it the startup grace
        # instead of the hang timeout.
        self._life.phase = Phase.ROLLING_BACK
        self._life.busy_since = time.time()
        self._publish()
        from_step = self.counters.step
        self.settle()
        self.step_begins()  # no step began since the snapshot: the loop's state is as it left it after
        self.training.load_small_state(self.snapshot.restore(self.training.module, self.training.optimizer))
        self.counters.rewind_to(self.snapshot.extra["counters"])
        self.feed.roll_back(self.snapshot.extra["tracked"])  # a per-epoch scheduler agrees with the lr
        # The data does not rewind: the window that led here is skipped, and remembered for replays.
        for batch in self._window_batches:
            span = self.feed.span(batch.epoch, batch.index)
            self.dead_letters.add(
                batch.epoch, batch.index, write=self.gang.rank == 0, kind="rolled-back window", span=span
            )
        self.counters.rollbacks += 1
        self.remediate(self.settings.remediation)
        # The restored state is clean; re-snapshot it so a further rollback compounds the remediation.
        self.take_snapshot()
        self.gang.log(
            logging.WARNING,
            "rolled back from step %d to step %d after %s; lr scale now %.4g, %s",
            from_step, self.counters.step, reason, self.counters.lr_scale,
            describe_clip(self.counters.max_grad_norm),
        )  # fmt: skip
        if not self.driven:
            # The loop is not iterating ``guardian.steps()``/``run()``, so it may count steps of its own:
            # such a counter now runs ahead of the model (the schedule shifts, fewer steps are kept).
            self.gang.log(
                logging.WARNING,
                "step_count went back to %d: a loop that counts its own steps must take guardian.step_count "
                "again (for iter_num in guardian.steps(max_iters): ... cannot drift)",
                self.counters.step,
            )
        self.validated("rollback")
        # Every rank stays "rolling back" until the slowest one has validated: otherwise the faster
        # ranks would wait for it in their next all-reduce and look hung.
        self.gang.barrier()
        self._life.phase = Phase.RUNNING
        self._life.busy_since = None
        self._progress.stepped()  # the rollback itself is progress: the hang clock restarts
        self._publish()

    def remediate(self, remediation: Remediation) -> None:
        """Scale the learning rates and tighten the clip as ``remediation`` says, from the next step on."""
        # The learning rates are scaled when the optimizer steps (``TrainingObjects.apply_update``), so a
        # loop that sets its own learning rate every iteration cannot undo the remediation.
        self.counters.lr_scale *= remediation.lr_scale
        self.counters.tighten_clip(remediation.max_grad_norm)

    def apply_orchestrator_remediation(self, order: RemediationOrder | None) -> None:
        """Apply the orchestrator's remediation ``order`` unless this job applied it already (once per id)."""
        if order is None or order.id in self.counters.remediations_applied:
            return
        self.remediate(order)
        self.counters.remediations_applied.append(order.id)
        self.gang.log(
            logging.WARNING,
            "applied remediation %s from the orchestrator: lr scale %.4g, %s",
            order.id,
            self.counters.lr_scale,
            describe_clip(self.counters.max_grad_norm),
        )

    def validated(self, when: str) -> None:
        """Run the loop's held-out validation (if given) after ``when``: its loss is the status's message."""
        if self.validate is None:
            return
        value = float(self.validate())
        self._life.message = f"held-out loss after {when}: {value:.4g}"
        log.info("%s", self._life.message)


def _agreed_flag(gang: Gang, flag: Callable[[], torch.Tensor]) -> bool:
    """Whether ``flag()`` (a 0-dim 0.0/1.0 tensor) is set on any rank: one collective, one host sync."""
    local = flag().reshape(1)
    with gang.waiting():
        return bool(gang.all_reduce(local, _MAX).item())


_MAX = torch.distributed.ReduceOp.MAX

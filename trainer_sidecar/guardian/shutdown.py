"""How the guardian's work ends: a stop at a signal, the final checkpoint, a close, the interpreter's exit.

``Shutdown`` holds the process's stop request while the loop runs (a SIGTERM is taken at a step
boundary), watches the loop's own collectives, and ends the guardian's work: ``stop_now`` (the gang was
told to stop: a checkpoint when the last step was clean, then 128 + the signal), ``finish`` (the final
checkpoint, then ``finished``), ``close``, and ``at_exit`` when the loop did neither (``ending.exit_plan``
decides). The worker's final status and exit code are ``WorkerEnd``'s (``guardian.ending``).

Built by the Guardian with what it ends, called only by it (the exit hook is armed on the Guardian).
"""

from __future__ import annotations

import logging
import signal
import weakref
from collections.abc import Callable

from trainer_sidecar.checkpoint import CheckpointError, FencedError
from trainer_sidecar.contract.exitcodes import ExitCode
from trainer_sidecar.contract.status import Activity, Phase
from trainer_sidecar.guardian.activity import ActivityTracker
from trainer_sidecar.guardian.busy import BusySections
from trainer_sidecar.guardian.checkpointing import CheckpointManager
from trainer_sidecar.guardian.collectives import unwatch as unwatch_collectives
from trainer_sidecar.guardian.collectives import watch as watch_collectives
from trainer_sidecar.guardian.counters import GuardCounters
from trainer_sidecar.guardian.ending import (
    ExitPlan,
    Lifecycle,
    UncleanState,
    WorkerEnd,
    arm_at_exit,
    crash_message,
    disarm_at_exit,
    end_worker,
    exit_error,
    exit_plan,
)
from trainer_sidecar.guardian.recovery import Recovery
from trainer_sidecar.guardian.reporting import StatusReporter
from trainer_sidecar.guardian.stopping import StopRequest
from trainer_sidecar.guardian.watch import ActivityWatch

log = logging.getLogger("trainguard")

__all__ = ["Shutdown"]


class Shutdown:
    """The end of the guardian's work, whichever way it comes. Promises: no rank reports ``finished``
    before every rank's final checkpoint is durable; an unhandled exception is never reported finished;
    the signal handlers, the watches and the exit hook are released exactly once."""

    def __init__(
        self,
        checkpoints: CheckpointManager,
        recovery: Recovery,
        counters: GuardCounters,
        end: WorkerEnd,
        status: tuple[Lifecycle, StatusReporter, ActivityWatch, BusySections, ActivityTracker],
        stop: StopRequest,
    ) -> None:
        self.checkpoints, self._recovery, self.counters, self._end = checkpoints, recovery, counters, end
        self._life, self._reporter, self._watch, self._busy, self._activity = status
        self.gang, self._stop = checkpoints.gang, stop
        self._holding_stop = False
        self._collectives: object = None  # the watch of the loop's collectives (``watch``)
        self._hook: weakref.WeakMethod[Callable[[bool], None]] | None = None

    def hold_stop(self) -> None:
        """Take SIGTERM and SIGINT at a step boundary from now on (``stopping.STOP``)."""
        self._stop.acquire()
        self._holding_stop = True

    def watch(self, on_exit: Callable[[bool], None]) -> None:
        """The loop begins: its own torch.distributed collectives mark their waits on this thread, and
        ``on_exit`` (a bound method, held weakly) is called at interpreter exit unless released first."""
        self._collectives = watch_collectives(self._activity)
        self._hook = weakref.WeakMethod(on_exit)
        arm_at_exit(on_exit)

    @property
    def max_steps(self) -> int | None:
        """The run's declared last step (None: not declared)."""
        return self.checkpoints.last_step

    def finish(self) -> None:
        """The final checkpoint (if not written and the state is clean), every write waited for, then
        ``finished`` (see ``Guardian.finish``). Raises UncleanState after rolling back."""
        self._recovery.settle()  # the loop may have changed the state in place since its last step
        self._activity.mark(Activity.CHECKPOINT)
        if self.checkpoints.enabled:
            self.checkpoints.wait()  # a save of this very step may still be in flight
            final = self.counters.step
            # Checked even when the final checkpoint is written already (at a declared max_steps, or by
            # cadence): the loop may have changed the state in place after its last step.
            if self._recovery.unclean_state() is not None:
                raise UncleanState(
                    f"the final state at step {final} holds non-finite values; rolled back to step "
                    f"{self.counters.step}"
                )
            if not self.checkpoints.saved(final):
                self._recovery.save()
            try:
                self.checkpoints.close()
            except FencedError as exc:
                self._end.fenced(exc)
        # No rank reports success before every rank's final checkpoint is durable, and ranks leave
        # together (a rank tearing down gloo while a peer is still in it can abort the peer).
        self.gang.barrier()
        self._release()
        self._end.report(Phase.FINISHED, self._life.message, ExitCode.SUCCEEDED)

    def close(self) -> None:
        """Wait for a checkpoint in flight without marking the job finished (see ``Guardian.close``)."""
        self._life.ended = True
        self._release()
        self.checkpoints.close()

    def stop_now(self) -> None:
        """Every rank was told, at this same boundary, that some rank must stop: save a checkpoint when the
        last step was clean (and wait until it is durable), then exit with 128 + the signal's number."""
        received = self._stop.signal or signal.SIGTERM
        saved = self.checkpoints.saved(self.counters.step)
        if not saved and self.checkpoints.enabled and self.counters.history.consecutive_bad == 0:
            saved = self._recovery.save_checkpoint()
        try:
            self.checkpoints.close()
        except FencedError as exc:
            self._end.fenced(exc)
        self.gang.barrier()
        what = "a checkpoint is written" if saved else "no checkpoint: the last step was not clean"
        if not self.checkpoints.enabled:
            what = "no checkpoint directory"
        message = f"stopped by {received.name} at step {self.counters.step}; {what}"
        self.gang.log(logging.WARNING, "%s", message)
        code = 128 + int(received)
        self._end.report(Phase.STOPPED, message, code)
        self._release()
        end_worker(self.gang, code, SystemExit(code))

    def at_exit(self, crashed: bool) -> None:
        """The interpreter exits and the loop neither finished nor closed the guardian
        (``trainer_sidecar.guardian.ending``): finish when the end is known and reached; never report an
        unhandled exception as finished; exit 1, loudly, when the declared end was not reached."""
        if self._life.ended:
            return
        step = self.counters.step
        plan = exit_plan(
            crashed=crashed, distributed=self.gang.distributed, step=step, max_steps=self.max_steps
        )
        if plan is ExitPlan.FINISH and not self.gang.distributed:
            try:
                self.finish()  # one process: nothing to agree with anyone
                return
            except UncleanState as exc:
                self._end.exit_short(f"{exc}; the job is not done")
        if plan is ExitPlan.FINISH:
            # The final checkpoint was started at the step boundary that reached max_steps, on every
            # rank; here each rank only waits for its own writes (no collective: see ending.py).
            self._release()
            if self.checkpoints.enabled and not self.checkpoints.saved(step):
                self._end.exit_short(f"no final checkpoint of step {step} was started")
            try:
                self.checkpoints.close()  # raises unless this rank's files of it are durable
            except FencedError as exc:
                self._end.fenced(exc)
            except CheckpointError as exc:
                self._end.exit_short(f"the final checkpoint of step {step} failed: {exc}")
            self._end.report(Phase.FINISHED, self._life.message, ExitCode.SUCCEEDED)
            return
        self._release()
        if plan is ExitPlan.CRASHED:
            # One final status and termination message, written before the wait for a checkpoint in
            # flight (which may be long, or fail): the step it failed at and why (the periodic status
            # may be steps behind, and whether a crash repeats at the same step is how a deterministic
            # failure is told from a transient one), and where the exception left the training thread
            # (a collective a dead peer broke, or its own work), which tells a crash's cause from its
            # victims (trainguard.core.policy).
            self._end.report(Phase.FAILED, crash_message(exit_error()), 1)
            self.checkpoints.close()  # a clean checkpoint in flight is still worth having
            return
        newest = self.checkpoints.checkpointed_step
        if plan is ExitPlan.UNDECLARED:
            self.checkpoints.close()
            log.error(
                "the loop ended at step %d without guardian.finish(); in a gang the final steps cannot "
                "be saved at exit (newest checkpoint: %s) and the worker is not reported finished: "
                "iterate guardian.steps(max_steps) or declare Guardian(..., max_steps=N)",
                step,
                newest,
            )
            return
        if not self.gang.distributed and self.checkpoints.enabled and not self.checkpoints.saved(step):
            self._recovery.save_checkpoint()  # one process: the clean state it stopped at, for a restart
        self.checkpoints.close()
        self._end.exit_short(
            f"the loop ended at step {step} of max_steps={self.max_steps} without guardian.finish() "
            f"({self.counters.rollbacks} rollbacks: a loop counter of its own drifts after one; "
            "iterate guardian.steps(max_steps), or call guardian.finish() to end early)"
        )

    def _release(self) -> None:
        """Stop watching peers and put back the signal handlers (the guardian's work is over); withdraw an
        evaluation the watch inferred and still holds open (the peers would read this rank busy on)."""
        on_exit = self._hook() if self._hook is not None else None
        if on_exit is not None:
            disarm_at_exit(on_exit)
        unwatch_collectives(self._collectives)
        if self._holding_stop:
            self._holding_stop = False
            self._stop.release()
        self._reporter.stop_watching()  # first: the watch opens and closes the inferred evaluation
        self._watch.withdraw()
        self._busy.stop()

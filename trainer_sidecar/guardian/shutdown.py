"""How the guardian's work ends: a stop at a signal, the final checkpoint, the interpreter's exit.

(Moved verbatim out of ``guardian.py``; reshaped into a collaborator in the next commit.)
"""
# mypy: disable-error-code="attr-defined"

from __future__ import annotations

import logging
import signal
import sys

from trainer_sidecar.checkpoint import CheckpointError, FencedError
from trainer_sidecar.contract.exitcodes import ExitCode
from trainer_sidecar.contract.status import Phase
from trainer_sidecar.guardian.collectives import unwatch as unwatch_collectives
from trainer_sidecar.guardian.ending import (
    ExitPlan,
    UncleanState,
    crash_message,
    disarm_at_exit,
    end_worker,
    exit_plan,
)

log = logging.getLogger("trainguard")


class ShutdownMixin:
    """The Guardian's ending methods (moved verbatim)."""

    def _stop_now(self) -> None:
        """Every rank was told, at this same boundary, that some rank must stop: save a checkpoint when the
        last step was clean (and wait until it is durable), then exit with 128 + the signal's number."""
        received = self._stop.signal or signal.SIGTERM
        saved = self.checkpoints.saved(self.counters.step)
        if not saved and self.checkpoints.enabled and self.counters.history.consecutive_bad == 0:
            saved = self.save_checkpoint()
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

    def _at_exit(self, crashed: bool) -> None:
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
            self._end.report(Phase.FINISHED, self.message, ExitCode.SUCCEEDED)
            return
        self._release()
        if plan is ExitPlan.CRASHED:
            # One final status and termination message, written before the wait for a checkpoint in
            # flight (which may be long, or fail): the step it failed at and why (the periodic status
            # may be steps behind, and whether a crash repeats at the same step is how a deterministic
            # failure is told from a transient one), and where the exception left the training thread
            # (a collective a dead peer broke, or its own work), which tells a crash's cause from its
            # victims (trainguard.core.policy).
            self._end.report(Phase.FAILED, crash_message(getattr(sys, "last_value", None)), 1)
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
            self.save_checkpoint()  # one process: the clean state it stopped at, so a restart goes on
        self.checkpoints.close()
        self._end.exit_short(
            f"the loop ended at step {step} of max_steps={self.max_steps} without guardian.finish() "
            f"({self.counters.rollbacks} rollbacks: a loop counter of its own drifts after one; "
            "iterate guardian.steps(max_steps), or call guardian.finish() to end early)"
        )

    def _release(self) -> None:
        """Stop watching peers and put back the signal handlers (the guardian's work is over); withdraw an
        evaluation the watch inferred and still holds open (the peers would read this rank busy on)."""
        disarm_at_exit(self._at_exit)
        unwatch_collectives(self._collectives)
        if self._holding_stop:
            self._holding_stop = False
            self._stop.release()
        self._reporter.stop_watching()  # first: the watch opens and closes the inferred evaluation
        self._watch.withdraw()
        self._busy.stop()

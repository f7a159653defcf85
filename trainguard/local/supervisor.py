"""The run loop of ``trainguard run`` apart from how a gang's processes are started, stopped and watched.

``GangSupervisor`` is a template, as ``torch.distributed.elastic``'s agent is over ``_start_workers``,
``_stop_workers`` and ``_monitor_workers``: it watches the gang, asks the recovery policy
(``trainguard.core.policy``) what to do, and carries it out: go on, succeed, fail, or recover (stop the
gang, back off, start the next attempt, with a remediation after a divergence). It keeps the run's
timeline and record, which the live view and the summary read. A subclass says how a gang starts, stops
and is observed; ``trainguard.local.runner.LocalRunner`` does it with processes on this machine.

One look, one source: each round takes one ``Look`` (the gang view and the policy's observation made
from it) and one clock reading; the record, the decision, its reason and the restart it leads to all
read that look. A run that ends (succeeded, failed or interrupted) stops its gang first and then takes
in the workers' final statuses, so the summary's figures are the workers' last word (the stop
checkpoint's step after Ctrl-C), not the last look before the end.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

from trainer_sidecar.contract.settings import RemediationOrder
from trainer_sidecar.contract.stopping import broken_gang_grace_seconds
from trainguard.core.observation import GangView
from trainguard.core.policy import Action, Decision, FailureKind, FailureSignature, Observation, decide
from trainguard.core.spec import GuardedTrainingJob
from trainguard.core.summary import Incident, RunFigures, RunRecord
from trainguard.local.launch import StopSignals

#: How often the loop looks again while nothing needs doing.
IDLE_SECONDS = 0.25


@dataclass
class Event:
    """A line of the job's timeline."""

    time: float
    kind: str
    message: str
    attempt: int
    step: int | None = None

    def as_dict(self, origin: float) -> dict[str, Any]:
        """JSON form, with the time relative to the run's start."""
        return {
            "t": round(self.time - origin, 3),
            "kind": self.kind,
            "attempt": self.attempt,
            "step": self.step,
            "message": self.message,
        }


@dataclass(frozen=True)
class Look:
    """One look at the gang: its view and the policy's observation made from that view (the observation's
    ``step`` is the view's last step), so that what is recorded and what is decided agree."""

    view: GangView
    observation: Observation


@dataclass(frozen=True)
class FinalCheckpoint:
    """The newest clean checkpoint a run left: its step, folder and data file's digest."""

    step: int
    path: str
    sha256: str


@dataclass(frozen=True)
class RunResult:
    """What one run of a job came to: the README's summary reference, typed.

    ``result`` is ``succeeded``, ``failed`` or ``interrupted`` (stopped by a signal before the policy
    decided); ``reason`` says why in words.
    """

    name: str
    namespace: str
    result: str
    reason: str
    attempts: int
    figures: RunFigures
    final_checkpoint: FinalCheckpoint | None
    timeline: list[dict[str, Any]]
    series: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        """The summary file's JSON object (``summary.json``), keys in the documented order."""
        checkpoint = self.final_checkpoint
        return {
            "job": {"name": self.name, "namespace": self.namespace},
            "result": self.result,
            "reason": self.reason,
            "attempts": self.attempts,
            **self.figures.as_dict(),
            "final_checkpoint": None
            if checkpoint is None
            else {"step": checkpoint.step, "path": checkpoint.path, "sha256": checkpoint.sha256},
            "timeline": self.timeline,
            "series": self.series,
        }


class RunView(Protocol):
    """What shows a run as it goes (``trainguard.local.view``)."""

    def event(self, entry: Event) -> None:
        """Show one timeline event."""

    def update(self, runner: Any) -> None:
        """Redraw from the runner's current state."""


#: ``trainguard run``'s exit code for a job that cannot run (here): an invalid job, a refused start,
#: or a worker's permanent failure (configuration error, fenced); as for an invalid job file.
EXIT_CANNOT_RUN = 2
#: ``trainguard run``'s exit code when the policy gives up on a job that could run (restarts exhausted).
EXIT_GAVE_UP = 1


def exit_code_of(decision: Decision) -> int:
    """The runner's exit code for a FAIL ``decision``: EXIT_CANNOT_RUN when the failure is permanent (a
    configuration error or a fenced worker: retrying cannot help, the job cannot run as it is), else
    EXIT_GAVE_UP."""
    if decision.failure in (FailureKind.CONFIG, FailureKind.FENCED):
        return EXIT_CANNOT_RUN
    return EXIT_GAVE_UP


class GangSupervisor(ABC):
    """Watch, decide, recover: one run of a job, whatever starts its processes.

    Promises: every decision is the shared policy's on what ``_monitor_workers`` observed; a restart stops
    the whole gang within the backoff (counted from the decision), prepares the next attempt once the stop
    is over (``_prepare_next_attempt``, within the backoff too) and starts it once both the backoff and
    the stop are over, handing a remediation (once per id) when the policy gives one; the
    timeline records every start, failure, restart and the end.
    """

    def __init__(
        self, job: GuardedTrainingJob, *, view: RunView | None = None, stop_grace_seconds: float = 10.0
    ) -> None:
        self.job = job
        self.spec = job.spec
        self.view = view
        #: How long a whole gang told to stop gets between SIGTERM and SIGKILL (time for a checkpoint).
        self.stop_grace_seconds = stop_grace_seconds
        self.attempt = 0
        self.restarts = 0
        # The attempt that introduced the remediation names it: workers apply a given id once, so a
        # later restart for another reason (a crash) does not lower the learning rate again.
        self.remediation: RemediationOrder | None = None
        self.events: list[Event] = []
        self.backoff_total = 0.0
        self.started = time.time()
        self.attempt_started = self.started
        self.record = RunRecord(self.started)
        self.final_decision: Decision | None = None
        #: The last failure acted on, as the policy signed it: the next observation's previous failure.
        self.last_failure: FailureSignature | None = None
        self._cadence = ""  # the checkpoint cadence last shown (a change is a timeline event)
        #: The rank last named a straggler (None: none): a change is a timeline event.
        self.straggler: int | None = None

    # ------------------------------------------------------------------------ what a subclass does ---
    @abstractmethod
    def _start_workers(self) -> None:
        """Start the gang of attempt ``self.attempt`` (already counted)."""

    @abstractmethod
    def _stop_workers(self, grace_seconds: float | None = None) -> None:
        """Stop every process of the current attempt (SIGTERM, then SIGKILL after ``grace_seconds``; None:
        the runner's stop grace, time for a checkpoint); nothing of it may be left running."""

    @abstractmethod
    def _monitor_workers(self) -> Look:
        """Look at the gang now (probes, statuses, exits): its view and what the policy should see."""

    @abstractmethod
    def gang_view(self) -> GangView:
        """The current attempt's gang as its ranks last reported."""

    @abstractmethod
    def _prepare_attempt(self) -> None:
        """Before the next attempt is counted: check what must hold for it to start."""

    @abstractmethod
    def _read_final_statuses(self) -> None:
        """Once the gang is stopped: take in the workers' final statuses (what they wrote as they ended),
        so that ``gang_view`` shows them."""

    @abstractmethod
    def _prepare_next_attempt(self) -> None:
        """During a restart's backoff, once the old gang is gone: start what the next attempt needs that
        runs none of the job's code (the local runner: its sidecars), so that its workers start when the
        backoff ends."""

    def _idle(self, seconds: float) -> None:
        """Wait before the next look: ``seconds``, or less where the subclass can tell that something
        changed (a worker ended)."""
        time.sleep(seconds)

    # ----------------------------------------------------------------------------- the template ---
    @property
    def incidents(self) -> list[Incident]:
        """The gang restarts so far (their recovery is filled in as it is seen)."""
        return self.record.incidents

    def event(self, kind: str, message: str, step: int | None = None) -> None:
        """Record a timeline event and show it."""
        entry = Event(time.time(), kind, message, self.attempt, step)
        self.events.append(entry)
        if self.view is not None:
            self.view.event(entry)

    def record_progress(self, view: GangView | None = None, now: float | None = None) -> None:
        """Take in the gang's progress (``view`` at ``now``; default: the gang as it is now) and turn what
        changed into timeline events."""
        if self.attempt == 0:
            return
        view = self.gang_view() if view is None else view
        now = time.time() if now is None else now
        for note in self.record.see(self.attempt, self.attempt_started, view, now):
            self.event(note.kind, note.message, note.step)
        chosen = self.spec.checkpoint.auto and view.checkpoint_every_steps is not None
        if chosen and view.checkpoint_cadence != self._cadence:
            # everySteps auto chose (or changed) its interval: say which and why.
            self._cadence = view.checkpoint_cadence
            self.event("checkpoint", f"checkpoint cadence {view.checkpoint_cadence}", view.last_step)

    def see_straggler(self, look: Look) -> None:
        """A timeline event when the gang view names a straggler other than the one named last (or
        none any more); what the policy does about it (``health.straggler.action``) is its decision."""
        found = look.observation.straggler
        rank = found.rank if found is not None else None
        threshold = self.spec.health.straggler.threshold
        if rank == self.straggler or (found is None and not look.view.straggler_scores(threshold)):
            return  # the same, or a gang not scored now (starting, ending): nothing new is known
        self.straggler = rank
        if found is None:
            self.event("straggler", "no rank is a straggler any more", look.view.last_step)
            return
        restart = self.spec.health.straggler.action == "restart"
        what = (
            "restart: the gang restarts (one machine: its next attempt runs on this same machine)"
            if restart
            else "report"
        )
        at = f" at step {look.view.last_step}" if look.view.last_step is not None else ""
        self.event(
            "straggler",
            f"rank {found.rank} is a straggler{at}: {found.reason} (action: {what})",
            look.view.last_step,
        )

    def start_attempt(self) -> None:
        """Count a new attempt and start its gang."""
        self._prepare_attempt()
        self.attempt += 1
        self.attempt_started = time.time()
        self._start_workers()

    def supervise(self, signals: StopSignals) -> int:
        """Watch the started gang until the policy ends the run; the run's exit code (``exit_code_of``)."""
        while True:
            look = self._monitor_workers()
            now = time.time()
            self.record_progress(look.view, now)
            if self.view is not None:
                self.view.update(self)
            self.see_straggler(look)
            decision = decide(self.spec.recovery, look.observation, self.spec.health.straggler)
            if decision.action is Action.CONTINUE or decision.action is Action.WAIT:
                self._idle(IDLE_SECONDS)
                continue
            if decision.action is Action.SUCCEED:
                signals.disarm()  # the job has finished: a late signal does not make it "interrupted"
                self._finish(decision)
                self.event("succeeded", "every rank exited 0")
                return 0
            if not self._recover(decision, look, now, signals):
                return exit_code_of(decision)

    def _recover(self, decision: Decision, look: Look, now: float, signals: StopSignals) -> bool:
        """Carry out a RESTART (stop, backoff, start the next attempt) or a FAIL (stop; returns False),
        decided on ``look`` taken at ``now``: the restart's figures come from that look."""
        kind = decision.action.value if decision.action is Action.FAIL else "failure"
        straggler = decision.failure is FailureKind.STRAGGLER
        self.event("straggler" if straggler else kind, decision.reason, decision.step)
        self.last_failure = decision.signature
        # A failure (a crash, a hang, a refused claim) leaves no gang that could checkpoint: stop it now.
        if decision.action is Action.FAIL:
            signals.disarm()
            self.final_decision = decision
            self._end(self._broken_gang_grace(look))
            return False
        # Recorded before the stop: the restart's last step is the one the reason names.
        self.record.failed(
            decision, look.view, attempt=self.attempt, attempt_started=self.attempt_started, now=now
        )
        # The backoff counts from the decision and the old gang's stop runs within it (the policy's wait is
        # between attempts, not after the stop): the stop costs the restart only what outlasts the backoff.
        # The next attempt still starts only once every process of the old one is gone.
        backoff_ends = time.monotonic() + decision.delay_seconds
        with signals.deferred():
            # A straggler's gang is whole: its stop grace lets it checkpoint first.
            self._stop_workers(None if straggler else self._broken_gang_grace(look))
            self._prepare_next_attempt()
        self.straggler = None
        self.restarts = decision.restarts
        if decision.remediation is not None:
            self.remediation = RemediationOrder.introduced_by(self.attempt + 1, decision.remediation)
        self.event(
            "restart",
            f"restarting the whole gang in {decision.delay_seconds:g} s "
            f"(restart {self.restarts} of {self.spec.recovery.max_restarts})",
        )
        time.sleep(max(0.0, backoff_ends - time.monotonic()))
        self.backoff_total += decision.delay_seconds
        self.start_attempt()
        return True

    def _finish(self, decision: Decision) -> None:
        """Record the final decision, let the gang go and take in its final statuses."""
        self.final_decision = decision
        self._end()

    def _broken_gang_grace(self, look: Look) -> float:
        """The stop grace of a gang that lost a rank (``contract.stopping``): a moment, unless a
        checkpoint write was in flight when its ranks last reported."""
        alive = (r.rank for r in look.observation.ranks if r.exit_code is None and not r.lost)
        writes = look.view.writes_in_flight(alive)
        return broken_gang_grace_seconds(writes, time.time(), ceiling=self.stop_grace_seconds)

    def _end(self, grace_seconds: float | None = None) -> None:
        """Stop the gang (``_stop_workers``' grace), then take in what its workers wrote as they ended (a
        stop checkpoint, their final counters): the summary's last view."""
        self._stop_workers(grace_seconds)
        self._read_final_statuses()
        self.record_progress()

    def interrupted(self, name: str) -> None:
        """End a run stopped by signal ``name`` before the policy decided: the gang stops (its workers
        write their stop checkpoint), and their final statuses are the summary's last view."""
        self._end()
        self.event("interrupted", f"stopped by {name}; checkpoints are intact")

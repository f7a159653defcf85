"""One reconcile step of a GuardedTrainingJob, as a pure function of what the API server and the sidecars
show: ``reconcile(World, OperatorSettings) -> Plan``. No I/O, no clock (``World.now``), no memory.

The plan says what to do (create attempt N's PyTorchJob now; delete attempt N's PyTorchJob and schedule
attempt N+1 at a time, with a remediation; order attempt N+1 into attempt N's pods; fall back from that
to a new PyTorchJob; mark the job Succeeded; mark it Failed; wait; nothing), the
whole new status, and the Events to post. Restarts are decided only by ``trainguard.core.policy.decide``.
This module is the state machine; ``pods`` reads the attempt's pods and sidecars into the gang view of
``trainguard.core.observation`` (the same view ``trainguard run`` decides from).

Every fact a decision needs is in the object's status (see ``status.JobStatus``), so a reconcile after an
operator restart, from the status read back, takes the same decision, and never a second restart for the
same failure: a failure is acted on once, by recording ``handledAttempt`` and moving ``attempt`` on in the
same status write, *before* the old attempt is deleted (``Plan.write_status_first``).

Two ways to restart the whole gang. In place, the default with an order key (``restart_in_place``):
the attempt's pods are kept, and every rank's launcher is ordered, through its sidecar, to stop its
worker now and to start the next attempt's after the backoff with that attempt's environment (never
before the old worker is gone, so no two gangs write the checkpoint volume at once); the
PyTorchJob stays, and ``hostAttempt`` names the attempt whose pods run the gang. This needs every rank's
pod running and reachable, its launcher at the failed attempt, no straggler to move off its node, no new
world size, and fewer than ``in_place_restarts`` restarts in place in a row; an attempt that cannot start
in its pods (an order refused, a pod lost, a launcher silent past ``order_timeout_seconds``) falls back
(``fall_back``). Otherwise, as a new PyTorchJob (``restart``): the attempt's PyTorchJob is deleted and one
is created for the next attempt, with a fresh rendezvous (new master service and pod names, so no rank
can reach a leftover peer of the old gang), a fresh environment, and its own history (conditions,
events, pods). Deleting pods under a live PyTorchJob instead would race the training operator, which
recreates them with the old environment. The old pods go with their PyTorchJob through garbage collection
(owner references); the next attempt waits, bounded, until the old PyTorchJob is gone, so two gangs never
write to the checkpoint volume at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError
from trainguard_operator.backends import Backend, RenderRequest
from trainguard_operator.backends.choice import backend_of, choose
from trainguard_operator.goodput import job_goodput, job_pace
from trainguard_operator.inplace_step import InPlace
from trainguard_operator.pinning import (
    IMMUTABLE_FIELDS,
    RESIZABLE_FIELDS,
    changed_paths,
    pin,
    repin_world,
    spec_change,
    without_nulls,
)
from trainguard_operator.plan import (
    MIN_REQUEUE_SECONDS,
    STALE_POLL_SECONDS,
    EventNote,
    Plan,
    PlanAction,
    World,
)
from trainguard_operator.pods import (
    GangReading,
    as_int,
    labels,
    meta,
    read_gang,
)
from trainguard_operator.render import (
    GIVEN_UP_GANG_GRACE_SECONDS,
    JOB_LABEL,
    FailureHistory,
    Owner,
    RenderError,
    stop_grace_seconds,
)
from trainguard_operator.settings import OperatorSettings
from trainguard_operator.status import (
    TERMINAL_PHASES,
    ConditionType,
    JobStatus,
    Phase,
    clip,
    failure_signature,
    iso,
    iso_precise,
    last_failure,
    merge_patch,
    parse_time,
    phase_conditions,
    set_condition,
)
from trainguard_operator.trackers import Trackers, rounded

from trainer_sidecar.contract.settings import RemediationOrder
from trainer_sidecar.contract.stopping import broken_gang_grace_seconds
from trainguard.core.policy import Action, Decision, FailureKind, Observation, decide
from trainguard.core.spec import GuardedTrainingJob, SpecError, parse_job
from trainguard.core.summary import duration_text

#: The public face of this module (the plan's types and the pinning are defined beside it).
__all__ = [
    "IMMUTABLE_FIELDS",
    "MIN_REQUEUE_SECONDS",
    "RESIZABLE_FIELDS",
    "STALE_POLL_SECONDS",
    "EventNote",
    "Plan",
    "PlanAction",
    "StepContext",
    "World",
    "changed_paths",
    "pin",
    "reconcile",
    "repin_world",
    "spec_change",
    "without_nulls",
]


def _manifest(body: Mapping[str, Any]) -> dict[str, Any]:
    return {key: body.get(key) for key in ("apiVersion", "kind", "metadata", "spec")}


# ---------------------------------------------------------------------------------------- the draft ---
class _Draft:
    """What one reconcile step writes while it is worked out: the new status (from the one read back),
    the Events to post, and the plan they end in. The step's opening (``_open``: a final job, an invalid
    spec, a missing CRD, refused changes) works on it alone; the step proper (``_Step``) on it and on the
    ``StepContext`` the opening builds."""

    def __init__(self, world: World, settings: OperatorSettings) -> None:
        self.world = world
        self.settings = settings
        self.now = world.now
        body_meta = meta(world.body)
        self.name = str(body_meta.get("name", ""))
        self.namespace = str(body_meta.get("namespace") or "default")
        self.uid = str(body_meta.get("uid", ""))
        generation = as_int(body_meta.get("generation"))
        self.generation = generation
        raw = world.body.get("status")
        self.raw_status: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
        self.old = JobStatus.from_body(world.body)
        self.st = self.old.model_copy(deep=True)
        self.st.observed_generation = generation
        self.events: list[EventNote] = []
        #: What the attempts run as: the status's, until the opening chooses (``choice.choose``).
        self.backend: Backend = backend_of(self.old.backend)

    # ------------------------------------------------------------------------------------ helpers ---
    def owns(self, obj: Mapping[str, Any]) -> bool:
        """Whether ``obj`` is owned by this GuardedTrainingJob (by uid; any owner if the uid is unknown)."""
        if not self.uid:
            return True
        refs = meta(obj).get("ownerReferences") or []
        return any(isinstance(r, Mapping) and r.get("uid") == self.uid for r in refs)

    def condition(self, type_: str, status: bool | None, reason: str, message: str = "") -> None:
        """Set a condition of the new status (its transition time moves only when its status does)."""
        self.st.conditions = set_condition(
            self.st.conditions, type_, status, reason, message, self.now, self.generation
        )

    def event(self, type_: str, reason: str, message: str) -> None:
        """Add an Event to the plan's."""
        self.events.append(EventNote(type_, reason, message))

    def became_true(self, type_: str, message: str) -> bool:
        """Whether the condition is True now but was not (or said something else) before this step."""
        before = self.old.condition(type_)
        return before is None or before.status != "True" or before.message != clip(message)

    def plan(self, action: PlanAction, requeue: float, *, measuring: bool = False, **extra: Any) -> Plan:
        """The plan of this step: the phase and its conditions set, the goodput and pace updated when
        ``measuring`` (not for a final or blocked job: they stay put), the status patch and the events."""
        phase = Phase(self.st.phase) if self.st.phase else Phase.PENDING
        self.st.phase = phase.value
        reason, message = extra.pop("phase_reason", phase.value), extra.pop("phase_message", "")
        self.st.conditions = phase_conditions(
            self.st.conditions, phase, reason, message, self.now, self.generation
        )
        if measuring:
            self.measure_goodput()
        patch = merge_patch(self.raw_status, self.st.to_wire())
        return Plan(
            action=action,
            status=self.st,
            patch=patch,
            requeue_seconds=max(MIN_REQUEUE_SECONDS, requeue),
            backend=self.backend.kind,
            events=tuple(self.events),
            **extra,
        )

    def measure_goodput(self) -> None:
        """Update the job's goodput, pace, ETA and lost time from its step history, as of now."""
        st = self.st
        if st.job_started_at is None and st.attempt_created >= 1:
            # A job whose first attempt predates the field: its creation stands for the start.
            created = parse_time(meta(self.world.body).get("creationTimestamp"))
            st.job_started_at = iso_precise(created) if created else st.attempt_started_at
        value = job_goodput(st.step_history or [], st.step_history_folded, st.job_started_at, self.now)
        if value is not None:
            st.goodput = value
        found = job_pace(
            st.step_history or [],
            st.step_history_folded,
            st.job_started_at,
            st.attempt,
            st.max_steps,
            self.now,
        )
        if found is not None:
            st.steps_per_second = rounded(found.steps_per_second, 4)
            st.eta_seconds = round(found.eta_seconds) if found.eta_seconds is not None else None
            st.lost_seconds = rounded(found.lost_seconds, 3)
            st.eta = duration_text(found.eta_seconds) if found.eta_seconds is not None else None
            st.lost = duration_text(found.lost_seconds) if found.lost_seconds is not None else None

    # ------------------------------------------------------------------------- the opening plans ---
    def terminal(self) -> Plan:
        """A final job stays put; a failed one's gang is stopped if it still runs (operator restarted)."""
        phase = Phase(self.st.phase or Phase.FAILED.value)
        delete: tuple[str, ...] = ()
        objects = self.world.objects(self.backend.kind)
        if phase is Phase.FAILED and objects is not None:
            # The give-up was recorded but the gang may not have been stopped (operator restarted).
            delete = tuple(
                str(meta(j).get("name"))
                for j in objects
                if labels(j).get(JOB_LABEL) == self.name
                and self.owns(j)
                and not meta(j).get("deletionTimestamp")
            )
        failed = self.st.condition(phase.value)
        message = failed.message if failed else ""
        return self.plan(
            PlanAction.NOTHING,
            self.settings.crd_retry_seconds,
            delete=delete,
            stop_pods_within_seconds=GIVEN_UP_GANG_GRACE_SECONDS if delete else None,
            done=True,
            phase_reason=failed.reason if failed else phase.value,
            phase_message=message,
        )

    def blocked_spec(self, message: str, *, measuring: bool = False) -> Plan:
        """BLOCKED on an invalid spec or template, with the SpecInvalid condition (and Event, once)."""
        if self.became_true(ConditionType.SPEC_INVALID, message):
            self.event("Warning", "SpecInvalid", message)
        self.condition(ConditionType.SPEC_INVALID, True, "InvalidSpec", message)
        return self.plan(
            PlanAction.BLOCKED,
            self.settings.crd_retry_seconds,
            measuring=measuring,
            phase_reason="SpecInvalid",
            phase_message=message,
        )

    def blocked_crd(self, waiting: Sequence[Backend]) -> Plan:
        """BLOCKED while the cluster serves none of the ``waiting`` backends' CRDs, with the
        BackendCRDMissing condition (and Event, once) naming each and what installs it."""
        crds = " nor ".join(f"a {b.kind} CRD ({b.api_version} {b.plural})" for b in waiting)
        needs = ", or ".join(b.needs for b in waiting)
        message = (
            f"the cluster has {'neither ' if len(waiting) > 1 else ''}{crds}: install {needs}; retrying "
            f"every {self.settings.crd_retry_seconds:g} s"
        )
        reason = f"{waiting[0].kind}CRDMissing" if len(waiting) == 1 else "NoBackendCRD"
        if self.became_true(ConditionType.CRD_MISSING, message):
            self.event("Warning", reason, message)
        self.condition(ConditionType.CRD_MISSING, True, reason, message)
        return self.plan(PlanAction.BLOCKED, self.settings.crd_retry_seconds, phase_message=message)

    def refusals(self, refused: list[str]) -> None:
        """The SpecChangeRefused condition (and Event, once) for changes refused while the job runs."""
        if not refused:
            self.condition(ConditionType.SPEC_CHANGE_REFUSED, False, "SpecMatchesRunningJob")
            return
        message = (
            f"changes to {', '.join(refused)} are refused while the job runs: template, checkpoint and "
            "backend are fixed for the job's life, and every attempt keeps using the original values "
            "(replicas and nprocPerNode may change: from the next gang restart). "
            "Revert the change, or delete and re-create the job."
        )
        if self.became_true(ConditionType.SPEC_CHANGE_REFUSED, message):
            self.event("Warning", "SpecChangeRefused", message)
        self.condition(ConditionType.SPEC_CHANGE_REFUSED, True, "ImmutableFieldChanged", message)


@dataclass(frozen=True)
class StepContext:
    """What the step proper acts on, worked out once by the opening (``_open``) before it runs.

    A step that must act on another spec (a world size adopted or taken at a new attempt) goes on as a
    new ``_Step`` with a new context (``dataclasses.replace``), never by changing this one.
    """

    #: The job with the spec acted on: the current spec with the pinned fields.
    job: GuardedTrainingJob
    #: The job as its spec asks now (a new world size in it takes effect at the next gang restart).
    asked: GuardedTrainingJob
    #: How often the sidecars are polled (``health.probePeriodSeconds``): the step's usual requeue.
    period: float
    attempt: int
    restarts: int
    #: The attempt whose pods run the gang (another than ``attempt`` after a restart in place).
    host: int
    #: What the attempts run as.
    backend: Backend
    #: The host attempt's object, and that object when it exists and this job owns it.
    job_name: str
    current: Mapping[str, Any] | None
    #: Whether this job's other objects are still there, and those of them to delete.
    stale_present: bool
    stale_delete: tuple[str, ...]


def _open(draft: _Draft) -> Plan | StepContext:
    """The opening of a step: the plan for a final job, an invalid spec or a missing CRD; otherwise the
    spec pinned, refused changes said, attempt 1 recorded for a new job, and the step's context."""
    st = draft.st
    if st.phase in TERMINAL_PHASES:
        return draft.terminal()
    try:
        job = parse_job(_manifest(draft.world.body), f"{draft.namespace}/{draft.name}")
    except SpecError as exc:
        return draft.blocked_spec(str(exc))
    draft.condition(ConditionType.SPEC_INVALID, False, "SpecValid")
    if st.pinned is None:
        st.pinned = pin(job.spec)
    try:
        effective, refused = spec_change(st.pinned, job.spec)
    except ValidationError as exc:
        return draft.blocked_spec(f"{draft.namespace}/{draft.name}: {exc}")
    draft.refusals(refused)
    world = draft.world
    backend, waiting = choose(
        effective.backend, st.backend, st.attempt is not None, lambda kind: world.objects(kind) is not None
    )
    objects = world.objects(backend.kind) if backend is not None else None
    if backend is None or objects is None:
        return draft.blocked_crd(waiting)
    draft.backend = backend
    draft.condition(ConditionType.CRD_MISSING, False, "BackendCRDFound")
    if st.attempt is None:
        st.attempt, st.restarts, st.handled_attempt = 1, 0, 0
        st.phase = Phase.PENDING.value
        st.backend = backend.kind
        # Due now; recorded so that the wait for a leftover object is bounded for attempt 1 too.
        st.next_attempt_at = iso_precise(draft.now)
    return _context(draft, job.model_copy(update={"spec": effective}), job, backend, objects)


def _context(
    draft: _Draft,
    job: GuardedTrainingJob,
    asked: GuardedTrainingJob,
    backend: Backend,
    jobs: Sequence[Mapping[str, Any]],
) -> StepContext:
    """The context of a step on ``job`` (the spec acted on), the attempt recorded, and ``jobs`` (the
    objects of ``backend``)."""
    attempt = draft.st.attempt
    assert attempt is not None  # recorded by the opening
    host = draft.st.host_attempt or attempt
    job_name = backend.child_name(draft.name, host)
    labelled = [j for j in jobs if labels(j).get(JOB_LABEL) == draft.name]
    # An object of a deleted namesake (same name, other uid) is on its way out: never adopted.
    current = next((j for j in labelled if meta(j).get("name") == job_name and draft.owns(j)), None)
    stale = [j for j in labelled if j is not current]
    return StepContext(
        job=job,
        asked=asked,
        period=float(job.spec.health.probe_period_seconds),
        attempt=attempt,
        restarts=draft.st.restarts or 0,
        host=host,
        backend=backend,
        job_name=job_name,
        current=current,
        stale_present=bool(stale),
        stale_delete=tuple(str(meta(j).get("name")) for j in stale if not meta(j).get("deletionTimestamp")),
    )


# ----------------------------------------------------------------------------------------- the step ---
class _Step(Trackers, InPlace):
    """One reconcile step proper, on the ``_Draft`` it writes and the ``StepContext`` it acts on; it
    sets no attribute of its own after ``__init__``. ``reconcile`` is the public entry."""

    def __init__(self, draft: _Draft, context: StepContext) -> None:
        self.draft = draft
        self.context = context

    # ------------------------------------------------------------- the draft and the context, read ---
    @property
    def world(self) -> World:
        return self.draft.world

    @property
    def settings(self) -> OperatorSettings:
        return self.draft.settings

    @property
    def now(self) -> datetime:
        return self.draft.now

    @property
    def name(self) -> str:
        return self.draft.name

    @property
    def namespace(self) -> str:
        return self.draft.namespace

    @property
    def uid(self) -> str:
        return self.draft.uid

    @property
    def st(self) -> JobStatus:
        return self.draft.st

    @property
    def old(self) -> JobStatus:
        return self.draft.old

    @property
    def job(self) -> GuardedTrainingJob:
        return self.context.job

    @property
    def asked(self) -> GuardedTrainingJob:
        return self.context.asked

    @property
    def period(self) -> float:
        return self.context.period

    @property
    def attempt(self) -> int:
        return self.context.attempt

    @property
    def restarts(self) -> int:
        return self.context.restarts

    @property
    def host(self) -> int:
        return self.context.host

    @property
    def backend(self) -> Backend:
        return self.context.backend

    @property
    def job_name(self) -> str:
        return self.context.job_name

    @property
    def current(self) -> Mapping[str, Any] | None:
        return self.context.current

    @property
    def stale_present(self) -> bool:
        return self.context.stale_present

    @property
    def stale_delete(self) -> tuple[str, ...]:
        return self.context.stale_delete

    # ------------------------------------------------------------------------------------ helpers ---
    def condition(self, type_: str, status: bool | None, reason: str, message: str = "") -> None:
        """Set a condition of the new status (``_Draft.condition``)."""
        self.draft.condition(type_, status, reason, message)

    def event(self, type_: str, reason: str, message: str) -> None:
        """Add an Event to the plan's."""
        self.draft.event(type_, reason, message)

    def plan(self, action: PlanAction, requeue: float, **extra: Any) -> Plan:
        """The plan of this step, its goodput and pace measured (``_Draft.plan``)."""
        return self.draft.plan(action, requeue, measuring=True, **extra)

    def blocked_spec(self, message: str) -> Plan:
        """BLOCKED on a template that does not render (``_Draft.blocked_spec``), goodput measured."""
        return self.draft.blocked_spec(message, measuring=True)

    def with_job(self, job: GuardedTrainingJob) -> _Step:
        """This step going on with ``job`` as the spec it acts on (the draft shared)."""
        return _Step(self.draft, replace(self.context, job=job))

    def failure_history(self) -> FailureHistory:
        """The job's restarts so far and its run time until now, for the next attempt's workers."""
        started = parse_time(self.st.job_started_at)
        run = (self.now - started).total_seconds() if started is not None else 0.0
        return FailureHistory(self.restarts, max(0.0, run))

    def attempt_started(self, at: datetime) -> None:
        """Record that the current attempt's PyTorchJob exists since ``at``."""
        self.st.attempt_created = self.attempt
        self.st.attempt_started_at = iso_precise(at)
        if self.attempt == 1 and self.st.job_started_at is None:
            self.st.job_started_at = self.st.attempt_started_at
        setattr(self.st, self.backend.status_field, self.job_name)
        self.st.next_attempt_at = None
        self.st.host_attempt = None
        self.st.in_place_restarts = 0

    # ------------------------------------------------------------------------------------ phases ---
    def run(self) -> Plan:
        """Start the attempt the status records when it has no PyTorchJob yet, adopt one that exists
        unrecorded, and observe the gang."""
        if self.st.attempt_created >= self.attempt:
            return self.observe()
        if self.current is None:
            return self.start_attempt()
        # Created before a crash of the operator, or a status write that conflicted, which did not
        # get to record it: adopt it.
        created = parse_time(meta(self.current).get("creationTimestamp"))
        adopted = self.adopt_world(self.current)
        adopted.attempt_started(created or self.now)
        return adopted.observe()

    def start_attempt(self) -> Plan:
        """Wait for the attempt's backoff and for the previous attempt to go; then create its PyTorchJob,
        at the world size asked for now."""
        due = parse_time(self.st.next_attempt_at)
        if due is not None and self.now < due:
            return self.plan(
                PlanAction.WAIT,
                min(self.period, (due - self.now).total_seconds()),
                delete=self.stale_delete,
                phase_reason="BackingOff",
                phase_message=f"attempt {self.attempt} starts at {self.st.next_attempt_at}",
            )
        grace = timedelta(seconds=self.settings.stale_attempt_grace_seconds)
        if self.stale_present and (due is None or self.now < due + grace):
            return self.plan(
                PlanAction.WAIT,
                min(self.period, STALE_POLL_SECONDS),
                delete=self.stale_delete,
                phase_reason="WaitingForPreviousAttempt",
                phase_message=(
                    f"attempt {self.attempt} waits for the previous attempt's {self.backend.kind} to go"
                ),
            )
        return self.take_world_size_change().create_attempt()

    def create_attempt(self) -> Plan:
        """Render the attempt's object and plan its creation (BLOCKED when it does not render)."""
        restarting = self.restarts > 0
        try:
            manifest = self.backend.render(
                RenderRequest(
                    self.job,
                    Owner(self.name, self.namespace, self.uid),
                    self.attempt,
                    self.st.remediation,
                    self.settings,
                    checkpoint_seconds=self.st.checkpoint_seconds,
                    history=self.failure_history(),
                    avoid_node=self.st.avoid_node,
                )
            )
        except RenderError as exc:
            return self.blocked_spec(str(exc))
        self.attempt_started(self.now)
        self.st.phase = (Phase.RESTARTING if restarting else Phase.PENDING).value
        extra = ""
        if self.st.remediation is not None:
            order = self.st.remediation
            extra = (
                f" with remediation {order.id} (lrScale {order.lr_scale:g}, "
                f"maxGradNorm {order.max_grad_norm})"
            )
        self.event(
            "Normal",
            "AttemptCreated",
            f"created {self.backend.kind} {self.job_name} for attempt {self.attempt} "
            f"({self.job.spec.replicas} replica(s)){extra}",
        )
        return self.plan(
            PlanAction.CREATE,
            self.period,
            create=manifest,
            delete=self.stale_delete,
            clock=False,
            # What the next step says too while no pod runs: an unchanged status is not written again.
            phase_reason="WaitingForPods",
            phase_message=self.pods_running_message(0),
        )

    def adopt_world(self, child: Mapping[str, Any]) -> _Step:
        """Pin the world size an adopted object was rendered for, and go on with the spec it makes.
        The step that created it pinned the spec it read, but its status write was lost; the spec read
        since may ask for another world size, which this attempt does not run at (it takes effect at
        the next gang restart)."""
        world = self.backend.rendered_world(child)
        if world is None or self.st.pinned is None:
            return self
        if all(self.st.pinned.get(key) == value for key, value in world.items()):
            return self
        return self.repin({**self.st.pinned, **world})

    def repin(self, pinned: dict[str, Any]) -> _Step:
        """Pin ``pinned`` (a world size accepted since the first pin); this step going on with the spec
        it makes."""
        self.st.pinned = pinned
        return self.with_job(self.asked.model_copy(update={"spec": spec_change(pinned, self.asked.spec)[0]}))

    def take_world_size_change(self) -> _Step:
        """A new attempt is where a change of ``replicas`` or ``nprocPerNode`` takes effect: re-pin the
        spec the attempt runs with, and say so in an Event; this step going on with that spec."""
        if self.st.pinned is None:
            return self
        repinned, resized = repin_world(self.st.pinned, self.asked.spec)
        if not resized:
            return self
        step = self.repin(repinned)
        self.event(
            "Normal",
            "WorldSizeChanged",
            f"attempt {self.attempt} runs with {', '.join(resized)}: it resumes the last clean "
            "checkpoint under the new world size",
        )
        return step

    def pods_running_message(self, running: int) -> str:
        """How many of the attempt's pods run, and its step."""
        step = f", step {self.st.step}" if self.st.step is not None else ""
        return f"attempt {self.attempt}: {running} of {self.job.spec.replicas} pod(s) running{step}"

    def observe(self) -> Plan:
        gang = read_gang(
            self.current,
            self.world.pods,
            self.world.sidecars,
            name=self.name,
            attempt=self.attempt,
            replicas=self.job.spec.replicas,
            job_name=self.job_name,
            backend=self.backend,
            host_attempt=self.st.host_attempt,
        )
        fallback, starting = self.in_place_failure()
        if fallback:
            return self.fall_back(fallback, self.broken_gang_grace(gang))
        recovered = self.track_progress(gang.view)
        straggler = self.track_straggler(gang)
        observation = Observation(
            attempt=self.attempt,
            ranks=gang.ranks,
            restarts=self.restarts,
            handled_attempt=self.st.handled_attempt,
            step=gang.view.last_step,
            # From the status, not from memory: an operator restarted between two failures compares alike.
            previous_failure=failure_signature(self.old.last_failure),
            straggler=straggler,
            now=self.now.timestamp(),  # the clock of a pod's ``ended_at`` (its container's finishedAt)
        )
        decision = decide(self.job.spec.recovery, observation, self.job.spec.health.straggler)
        if decision.action is Action.RESTART:
            grace = self.broken_gang_grace(gang)
            in_place = self.in_place_orders(decision)
            if in_place:
                return self.restart_in_place(decision, recovered, grace, in_place)
            return self.restart(decision, recovered, grace)
        if decision.action is Action.FAIL:
            return self.fail(decision, recovered, self.broken_gang_grace(gang))
        if decision.action is Action.SUCCEED:
            return self.succeed(decision, recovered)
        if gang.running and not starting:
            # (An attempt ordered in place stays Restarting until every launcher runs it: its pods ran
            # all along.)
            self.st.phase = Phase.RUNNING.value
        return self.plan(
            PlanAction.NOTHING,
            self.period,
            delete=self.stale_delete,
            decision=decision,
            recovered_seconds=recovered,
            # No pod running: no sidecar to poll, and every decision left is a change of the objects.
            clock=gang.running > 0,
            phase_reason="GangRunning" if gang.running else "WaitingForPods",
            phase_message=self.pods_running_message(gang.running),
        )

    def succeed(self, decision: Decision, recovered: float | None) -> Plan:
        """The attempt succeeded: the job is done (the recovery in progress, if any, is over)."""
        self.st.phase = Phase.SUCCEEDED.value
        self.st.recovering_since = None
        self.event("Normal", "Succeeded", f"attempt {self.attempt} succeeded: {decision.reason}")
        return self.plan(
            PlanAction.SUCCEED,
            self.period,
            delete=self.stale_delete,
            done=True,
            decision=decision,
            recovered_seconds=recovered,
            phase_reason="JobSucceeded",
            phase_message=f"attempt {self.attempt} succeeded: {decision.reason}",
        )

    def broken_gang_grace(self, gang: GangReading) -> int:
        """The stop grace of the gang's pods after it lost a rank (``contract.stopping``): a second,
        unless a rank still running reported a checkpoint write in flight; at most the pods' own."""
        alive = (r.rank for r in gang.ranks if r.exit_code is None and not r.lost)
        ceiling = stop_grace_seconds(None, self.st.checkpoint_seconds)
        grace = broken_gang_grace_seconds(gang.view.writes_in_flight(alive), self.now.timestamp(), ceiling)
        return math.ceil(grace)

    def record_failure(self, decision: Decision) -> None:
        kind = decision.failure.value if decision.failure else "Failed"
        self.st.last_failure = last_failure(
            kind, decision.reason, decision.rank, decision.exit_code, self.now, decision.signature
        )
        self.st.handled_attempt = self.attempt
        if self.st.recovering_since is None:
            self.st.recovering_since = iso_precise(self.now)
        self.event("Warning", kind, f"attempt {self.attempt}: {decision.reason}")

    def schedule_next(self, decision: Decision, how: str) -> tuple[datetime, str]:
        """Record a restart decision: the failure, the next attempt, when it is due, its remediation and
        the GangRestart event (``how``: how the gang restarts). Returns when it is due, and the event's
        message."""
        self.record_failure(decision)
        st = self.st
        # A straggler's gang is whole: its pods get their own grace to checkpoint, and the next attempt
        # keeps off its node. Any other restart places the next attempt freely.
        straggler = decision.failure is FailureKind.STRAGGLER
        st.avoid_node = (st.straggler.node or None) if straggler and st.straggler is not None else None
        st.straggler = None
        st.restarts = decision.restarts
        st.attempt = self.attempt + 1
        due = self.now + timedelta(seconds=decision.delay_seconds)
        st.next_attempt_at = iso_precise(due)
        if decision.remediation is not None:
            st.remediation = RemediationOrder.introduced_by(st.attempt, decision.remediation)
        st.phase = Phase.RESTARTING.value
        limit = self.job.spec.recovery.max_restarts
        remedy = ""
        if decision.remediation is not None:
            remedy = (
                f" with remediation (lrScale {decision.remediation.lr_scale:g}, "
                f"maxGradNorm {decision.remediation.max_grad_norm})"
            )
        message = (
            f"restarting the whole gang {how} as attempt {st.attempt} in {decision.delay_seconds:g} s "
            f"(restart {st.restarts} of {limit}){remedy}: {decision.reason}"
        )
        self.event("Warning", "GangRestart", message)
        return due, message

    def restart(self, decision: Decision, recovered: float | None, grace: int) -> Plan:
        due, message = self.schedule_next(decision, f"as a new {self.backend.kind}")
        straggler = decision.failure is FailureKind.STRAGGLER
        return self.plan(
            PlanAction.RESTART,
            min(self.period, decision.delay_seconds),
            delete=(*self.stale_delete, self.job_name),
            stop_pods_within_seconds=None if straggler else grace,
            write_status_first=True,
            decision=decision,
            recovered_seconds=recovered,
            phase_reason="GangRestart",
            phase_message=f"{message}; attempt {self.st.attempt} starts at {iso(due)}",
        )

    def fail(self, decision: Decision, recovered: float | None, grace: int) -> Plan:
        self.record_failure(decision)
        self.st.phase = Phase.FAILED.value
        self.st.recovering_since = None
        self.event("Warning", "Failed", f"giving up: {decision.reason}")
        # The gang is stopped like the local runner stops it: ranks still running (hung, or waiting on a
        # dead peer) would otherwise hold their GPUs for ever.
        return self.plan(
            PlanAction.FAIL,
            self.period,
            delete=(*self.stale_delete, self.job_name),
            stop_pods_within_seconds=grace,
            write_status_first=True,
            done=True,
            decision=decision,
            recovered_seconds=recovered,
            phase_reason=(
                "RestartsExhausted"
                if self.restarts >= self.job.spec.recovery.max_restarts
                and decision.failure is not FailureKind.DETERMINISTIC
                else str(self.st.last_failure.reason if self.st.last_failure else "JobFailed")
            ),
            phase_message=decision.reason,
        )


def reconcile(world: World, settings: OperatorSettings) -> Plan:
    """One reconcile step of the GuardedTrainingJob in ``world`` (see the module docstring).

    Never raises for anything an object, a pod or a sidecar can contain: an invalid spec or template is a
    BLOCKED plan with the SpecInvalid condition. The plan's ``requeue_seconds`` is at least
    ``MIN_REQUEUE_SECONDS``, so no input makes the caller loop hot.
    """
    draft = _Draft(world, settings)
    opened = _open(draft)
    if isinstance(opened, Plan):
        return opened
    return _Step(draft, opened).run()

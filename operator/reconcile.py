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
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from functools import cached_property
from typing import Any

from pydantic import ValidationError
from trainguard_operator.goodput import job_goodput, job_pace, record_progress
from trainguard_operator.inplace import OrderTarget
from trainguard_operator.pods import (
    GangReading,
    HostReading,
    as_int,
    labels,
    meta,
    read_gang,
    read_hosts,
)
from trainguard_operator.render import (
    GIVEN_UP_GANG_GRACE_SECONDS,
    JOB_LABEL,
    FailureHistory,
    Owner,
    RenderError,
    order_environment,
    pytorchjob_name,
    render_pytorchjob,
    rendered_world,
    stop_grace_seconds,
)
from trainguard_operator.settings import OperatorSettings
from trainguard_operator.status import (
    TERMINAL_PHASES,
    ConditionType,
    JobStatus,
    Phase,
    StepRecord,
    checkpoint_status,
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

from trainer_sidecar.contract.inplace import RestartOrder, StopMode
from trainer_sidecar.contract.settings import RemediationOrder
from trainer_sidecar.contract.stopping import broken_gang_grace_seconds
from trainguard.core.observation import GangView, SidecarReport
from trainguard.core.policy import Action, Decision, FailureKind, Observation, StragglerObservation, decide
from trainguard.core.spec import GuardedTrainingJobSpec, SpecError, StragglerStatus, parse_job
from trainguard.core.summary import duration_text

#: Spec fields pinned when a job starts (see ``spec_change``); every other field may change at once.
IMMUTABLE_FIELDS = ("replicas", "nprocPerNode", "template", "checkpoint")
#: Pinned fields a change of which is accepted and takes effect at the next gang restart (the world
#: size: checkpoints resume under another one); the others are fixed for the life of the job.
RESIZABLE_FIELDS = ("replicas", "nprocPerNode")
#: How soon to look again while waiting for an old attempt's PyTorchJob to go away.
STALE_POLL_SECONDS = 2.0
#: Ranks scored in the status (and the metric) at most: beyond, the status would grow with the world.
MAX_SCORED_RANKS = 256
#: The shortest requeue: a wait that is nearly over must not become a hot loop.
MIN_REQUEUE_SECONDS = 0.2


class PlanAction(StrEnum):
    """What a reconcile step does."""

    CREATE = "create"  # create the current attempt's PyTorchJob now
    RESTART = "restart"  # delete the current attempt's PyTorchJob; the next attempt starts at nextAttemptAt
    RESTART_IN_PLACE = (
        "restart-in-place"  # order every pod's launcher: stop now, next attempt at nextAttemptAt
    )
    FALL_BACK = "fall-back"  # an attempt ordered in place did not take: delete its PyTorchJob, start anew
    SUCCEED = "succeed"  # the job succeeded: final
    FAIL = "fail"  # the policy gave up: final; the attempt's PyTorchJob is deleted
    WAIT = "wait"  # a restart is pending: wait for nextAttemptAt (and for the old attempt to be gone)
    NOTHING = "nothing"  # keep watching
    BLOCKED = "blocked"  # cannot act: the spec is invalid or the PyTorchJob CRD is missing


@dataclass(frozen=True)
class EventNote:
    """A Kubernetes Event to post on the GuardedTrainingJob."""

    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True)
class World:
    """Everything one reconcile step looks at, as read just before it.

    ``jobs`` are the PyTorchJobs labelled with this GuardedTrainingJob (None: the PyTorchJob CRD is not
    installed); ``pods`` the pods labelled with it (any attempt); ``sidecars`` the ``/status`` answers of
    the current attempt's pods, by pod name.
    """

    body: Mapping[str, Any]
    jobs: Sequence[Mapping[str, Any]] | None
    pods: Sequence[Mapping[str, Any]]
    sidecars: Mapping[str, SidecarReport]
    now: datetime
    #: Pods whose sidecar refused or did not take the current attempt's order, with why (the executor's
    #: memory of its last orders; empty after an operator restart, when the order's timeout decides).
    order_refusals: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """The outcome of a reconcile step; see the module docstring.

    The executor carries it out in this order: the status patch first when ``write_status_first`` (a
    decision is recorded before it is acted on), the deletions, the creation, then the status patch
    (otherwise: a creation is recorded only once it happened), then the events.
    """

    action: PlanAction
    status: JobStatus
    patch: dict[str, Any]
    requeue_seconds: float
    create: dict[str, Any] | None = None
    delete: tuple[str, ...] = ()
    #: When set, the pods of the PyTorchJobs in ``delete`` are deleted first, with this grace. A broken
    #: gang (a hung rank, ranks waiting on a dead or hung peer) cannot reach a step boundary to
    #: checkpoint, so the pods' own long grace, meant for evictions in which every rank can, would only
    #: hold the restart up: a second, or what a checkpoint write in flight needs to finish
    #: (``contract.stopping``).
    stop_pods_within_seconds: int | None = None
    #: RESTART_IN_PLACE: the pods to order (every rank's), and the order, after the status write.
    orders: tuple[OrderTarget, ...] = ()
    order: RestartOrder | None = None
    events: tuple[EventNote, ...] = ()
    write_status_first: bool = False
    done: bool = False
    decision: Decision | None = None
    recovered_seconds: float | None = None
    #: Whether the next look is due by the clock (``requeue_seconds``): while pods run (their sidecars
    #: are polled) or a time is awaited (a backoff, the previous attempt's bounded wait, a retry). False:
    #: nothing can change but the objects themselves, so only a change of the job, its PyTorchJob or its
    #: pods calls for the next look.
    clock: bool = True


def without_nulls(value: Any) -> Any:
    """``value`` without null object members, at any depth (inside lists too), as the API server stores
    it: a JSON merge patch (how the status is written) drops them everywhere."""
    if isinstance(value, Mapping):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def pin(spec: GuardedTrainingJobSpec) -> dict[str, Any]:
    """The immutable part of a spec (``IMMUTABLE_FIELDS``) in its wire form, without nulls (as
    it reads back from the status it is stored in)."""
    wire = spec.model_dump(by_alias=True, mode="json")
    return {key: without_nulls(wire[key]) for key in IMMUTABLE_FIELDS}


def changed_paths(old: Any, new: Any, prefix: str) -> list[str]:
    """Dotted paths where ``new`` differs from ``old``; objects are compared key by key, lists whole."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        paths: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            paths += changed_paths(old.get(key), new.get(key), f"{prefix}.{key}")
        return paths
    return [] if old == new else [prefix]


def spec_change(
    pinned: Mapping[str, Any], spec: GuardedTrainingJobSpec
) -> tuple[GuardedTrainingJobSpec, list[str]]:
    """The spec to act on, and the refused changes: the current spec with the pinned immutable fields.

    Accepted while the job runs: ``recovery`` (the next decisions use it), ``dataQuality`` (at once),
    ``health`` and ``guard`` (the operator's polling at once; the pods at the next attempt, as pods
    cannot change), ``replicas`` and ``nprocPerNode`` (pinned per attempt: the next gang restart re-pins
    them, see ``repin_world``; the checkpoint resumes under the new world size, its shards resharded and
    its data position carried in samples). Refused: ``template`` (a new image or command mid-run would
    resume checkpoints with different code) and ``checkpoint`` (a new claim or path would start over
    from nothing while the old checkpoints are orphaned).
    """
    # Both sides without nulls: a pin stored before nulls were dropped compares equal to its spec too. A
    # field pinned by nothing (a job pinned before the field existed) keeps the spec's value.
    current = pin(spec)
    pinned = {key: pinned.get(key, current[key]) for key in IMMUTABLE_FIELDS}
    resizable = tuple(f"spec.{key}" for key in RESIZABLE_FIELDS)
    refused = [
        path
        for path in changed_paths(without_nulls(pinned), current, "spec")
        if path not in resizable and not path.startswith(tuple(f"{r}." for r in resizable))
    ]
    effective = GuardedTrainingJobSpec.model_validate(
        {**spec.model_dump(by_alias=True, mode="json"), **pinned}
    )
    return effective, refused


def repin_world(pinned: Mapping[str, Any], spec: GuardedTrainingJobSpec) -> tuple[dict[str, Any], list[str]]:
    """The pin for a new attempt: ``pinned`` with the spec's ``replicas`` and ``nprocPerNode`` (the next
    gang runs at the world size asked for now), and the fields that changed, as ``spec.FIELD old -> new``."""
    current = pin(spec)
    changes = [
        f"spec.{key} {pinned.get(key)} -> {current[key]}"
        for key in RESIZABLE_FIELDS
        if key in pinned and pinned[key] != current[key]
    ]
    return {**pinned, **{key: current[key] for key in RESIZABLE_FIELDS}}, changes


def _rounded(value: float | None, digits: int) -> float | None:
    return round(value, digits) if value is not None else None


def _manifest(body: Mapping[str, Any]) -> dict[str, Any]:
    return {key: body.get(key) for key in ("apiVersion", "kind", "metadata", "spec")}


# ----------------------------------------------------------------------------------------- the step ---
class _Step:
    """The state of one reconcile step while it is worked out; ``reconcile`` is the public entry."""

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
        #: Whether this step updates ``status.goodput`` (not for a final or blocked job: it stays put).
        self.measuring = False

    # ------------------------------------------------------------------------------------ helpers ---
    def owns(self, obj: Mapping[str, Any]) -> bool:
        """Whether ``obj`` is owned by this GuardedTrainingJob (by uid; any owner if the uid is unknown)."""
        if not self.uid:
            return True
        refs = meta(obj).get("ownerReferences") or []
        return any(isinstance(r, Mapping) and r.get("uid") == self.uid for r in refs)

    def condition(self, type_: str, status: bool | None, reason: str, message: str = "") -> None:
        self.st.conditions = set_condition(
            self.st.conditions, type_, status, reason, message, self.now, self.generation
        )

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append(EventNote(type_, reason, message))

    def became_true(self, type_: str, message: str) -> bool:
        """Whether the condition is True now but was not (or said something else) before this step."""
        before = self.old.condition(type_)
        return before is None or before.status != "True" or before.message != clip(message)

    def plan(self, action: PlanAction, requeue: float, **extra: Any) -> Plan:
        phase = Phase(self.st.phase) if self.st.phase else Phase.PENDING
        self.st.phase = phase.value
        reason, message = extra.pop("phase_reason", phase.value), extra.pop("phase_message", "")
        self.st.conditions = phase_conditions(
            self.st.conditions, phase, reason, message, self.now, self.generation
        )
        if self.measuring:
            self.measure_goodput()
        patch = merge_patch(self.raw_status, self.st.to_wire())
        return Plan(
            action=action,
            status=self.st,
            patch=patch,
            requeue_seconds=max(MIN_REQUEUE_SECONDS, requeue),
            events=tuple(self.events),
            **extra,
        )

    def measure_goodput(self) -> None:
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
            st.steps_per_second = _rounded(found.steps_per_second, 4)
            st.eta_seconds = round(found.eta_seconds) if found.eta_seconds is not None else None
            st.lost_seconds = _rounded(found.lost_seconds, 3)
            st.eta = duration_text(found.eta_seconds) if found.eta_seconds is not None else None
            st.lost = duration_text(found.lost_seconds) if found.lost_seconds is not None else None

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
        self.st.pytorch_job = self.job_name
        self.st.next_attempt_at = None
        self.st.host_attempt = None
        self.st.in_place_restarts = 0

    # ------------------------------------------------------------------------------------ phases ---
    def run(self) -> Plan:
        if self.st.phase in TERMINAL_PHASES:
            return self.terminal()
        try:
            job = parse_job(_manifest(self.world.body), f"{self.namespace}/{self.name}")
        except SpecError as exc:
            return self.blocked_spec(str(exc))
        self.condition(ConditionType.SPEC_INVALID, False, "SpecValid")
        if self.st.pinned is None:
            self.st.pinned = pin(job.spec)
        try:
            effective, refused = spec_change(self.st.pinned, job.spec)
        except ValidationError as exc:
            return self.blocked_spec(f"{self.namespace}/{self.name}: {exc}")
        self.job = job.model_copy(update={"spec": effective})
        self.asked = job
        self.period = float(effective.health.probe_period_seconds)
        self.refusals(refused)
        if self.world.jobs is None:
            return self.blocked_crd()
        self.condition(ConditionType.CRD_MISSING, False, "PyTorchJobCRDFound")
        if self.st.attempt is None:
            self.st.attempt, self.st.restarts, self.st.handled_attempt = 1, 0, 0
            self.st.phase = Phase.PENDING.value
            # Due now; recorded so that the wait for a leftover PyTorchJob is bounded for attempt 1 too.
            self.st.next_attempt_at = iso_precise(self.now)
        self.attempt = self.st.attempt
        self.restarts = self.st.restarts or 0
        self.measuring = True
        self.host = self.st.host_attempt or self.attempt
        self.job_name = pytorchjob_name(self.name, self.host)
        labelled = [j for j in self.world.jobs if labels(j).get(JOB_LABEL) == self.name]
        # A PyTorchJob of a deleted namesake (same name, other uid) is on its way out: never adopted.
        self.current = next(
            (j for j in labelled if meta(j).get("name") == self.job_name and self.owns(j)), None
        )
        stale = [j for j in labelled if j is not self.current]
        self.stale_present = bool(stale)
        self.stale_delete = tuple(
            str(meta(j).get("name")) for j in stale if not meta(j).get("deletionTimestamp")
        )
        if self.st.attempt_created < self.attempt:
            if self.current is None:
                return self.start_attempt()
            # Created before a crash of the operator, or a status write that conflicted, which did not
            # get to record it: adopt it.
            created = parse_time(meta(self.current).get("creationTimestamp"))
            self.adopt_world(self.current)
            self.attempt_started(created or self.now)
        return self.observe()

    def terminal(self) -> Plan:
        phase = Phase(self.st.phase or Phase.FAILED.value)
        delete: tuple[str, ...] = ()
        if phase is Phase.FAILED and self.world.jobs is not None:
            # The give-up was recorded but the gang may not have been stopped (operator restarted).
            delete = tuple(
                str(meta(j).get("name"))
                for j in self.world.jobs
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

    def blocked_spec(self, message: str) -> Plan:
        if self.became_true(ConditionType.SPEC_INVALID, message):
            self.event("Warning", "SpecInvalid", message)
        self.condition(ConditionType.SPEC_INVALID, True, "InvalidSpec", message)
        return self.plan(
            PlanAction.BLOCKED,
            self.settings.crd_retry_seconds,
            phase_reason="SpecInvalid",
            phase_message=message,
        )

    def blocked_crd(self) -> Plan:
        message = (
            "the cluster has no PyTorchJob CRD (kubeflow.org/v1 pytorchjobs): install the Kubeflow "
            f"training operator; retrying every {self.settings.crd_retry_seconds:g} s"
        )
        if self.became_true(ConditionType.CRD_MISSING, message):
            self.event("Warning", "PyTorchJobCRDMissing", message)
        self.condition(ConditionType.CRD_MISSING, True, "PyTorchJobCRDMissing", message)
        return self.plan(PlanAction.BLOCKED, self.settings.crd_retry_seconds, phase_message=message)

    def refusals(self, refused: list[str]) -> None:
        if not refused:
            self.condition(ConditionType.SPEC_CHANGE_REFUSED, False, "SpecMatchesRunningJob")
            return
        message = (
            f"changes to {', '.join(refused)} are refused while the job runs: template and checkpoint "
            "are fixed for the job's life, and every attempt keeps using the original values "
            "(replicas and nprocPerNode may change: from the next gang restart). "
            "Revert the change, or delete and re-create the job."
        )
        if self.became_true(ConditionType.SPEC_CHANGE_REFUSED, message):
            self.event("Warning", "SpecChangeRefused", message)
        self.condition(ConditionType.SPEC_CHANGE_REFUSED, True, "ImmutableFieldChanged", message)

    def start_attempt(self) -> Plan:
        due = parse_time(self.st.next_attempt_at)
        restarting = self.restarts > 0
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
                phase_message=f"attempt {self.attempt} waits for the previous attempt's PyTorchJob to go",
            )
        self.take_world_size_change()
        try:
            manifest = render_pytorchjob(
                self.job,
                Owner(self.name, self.namespace, self.uid),
                self.attempt,
                self.st.remediation,
                self.settings,
                checkpoint_seconds=self.st.checkpoint_seconds,
                history=self.failure_history(),
                avoid_node=self.st.avoid_node,
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
            f"created PyTorchJob {self.job_name} for attempt {self.attempt} "
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

    def adopt_world(self, pytorchjob: Mapping[str, Any]) -> None:
        """Pin the world size an adopted PyTorchJob was rendered for. The step that created it pinned
        the spec it read, but its status write was lost; the spec read since may ask for another world
        size, which this attempt does not run at (it takes effect at the next gang restart)."""
        world = rendered_world(pytorchjob)
        if world is None or self.st.pinned is None:
            return
        if all(self.st.pinned.get(key) == value for key, value in world.items()):
            return
        self.repin({**self.st.pinned, **world})

    def repin(self, pinned: dict[str, Any]) -> None:
        """Pin ``pinned`` (a world size accepted since the first pin) and act on the spec it makes."""
        self.st.pinned = pinned
        self.job = self.asked.model_copy(update={"spec": spec_change(pinned, self.asked.spec)[0]})

    def take_world_size_change(self) -> None:
        """A new attempt is where a change of ``replicas`` or ``nprocPerNode`` takes effect: re-pin the
        spec the attempt runs with, and say so in an Event."""
        if self.st.pinned is None:
            return
        repinned, resized = repin_world(self.st.pinned, self.asked.spec)
        if not resized:
            return
        self.repin(repinned)
        self.event(
            "Normal",
            "WorldSizeChanged",
            f"attempt {self.attempt} runs with {', '.join(resized)}: it resumes the last clean "
            "checkpoint under the new world size",
        )

    def pods_running_message(self, running: int) -> str:
        step = f", step {self.st.step}" if self.st.step is not None else ""
        return f"attempt {self.attempt}: {running} of {self.job.spec.replicas} pod(s) running{step}"

    def track_progress(self, view: GangView) -> float | None:
        """Take the gang's reported progress into the status; the recovery's duration when this step
        ends one (the new attempt stepped), else None."""
        st = self.st
        if view.rollbacks is not None and view.rollbacks > (self.old.rollbacks or 0):
            new = view.rollbacks - (self.old.rollbacks or 0)
            at = f" at step {view.progress.step}" if view.progress is not None else ""
            self.event(
                "Warning",
                "RollbackSeen",
                f"the guardian rolled back to its last clean snapshot {new} time(s) "
                f"(total {view.rollbacks}){at}",
            )
        st.take_reported(view.reported)
        if view.checkpoint is not None:
            st.last_clean_checkpoint = checkpoint_status(view.checkpoint.as_dict())
        if view.hang_timeout_seconds is not None:
            st.hang_timeout_seconds = round(view.hang_timeout_seconds, 3)
        if view.drop_rate is not None:
            self.track_drop_rate(view.drop_rate)
        if not view.stepped or view.progress is None or view.progress.step < 0:
            return None
        previous = st.step_history[-1] if st.step_history else None
        resumed = view.resumed_step
        st.step_history, st.step_history_folded = record_progress(
            st.step_history or [],
            st.step_history_folded,
            attempt=self.attempt,
            started_at=st.attempt_started_at,
            resumed_step=resumed if resumed is not None and resumed >= 0 else None,
            step=view.progress.step,
            now=self.now,
        )
        return self.track_recovery(view, previous)

    def track_drop_rate(self, rate: float) -> None:
        limit = self.job.spec.data_quality.max_drop_rate
        high = rate > limit
        message = f"dropped-sample ratio {rate:.3g} (limit {limit:g})"
        if high and not self.old.is_true(ConditionType.DROP_RATE_HIGH):
            self.event("Warning", "DropRateHigh", message)
        self.condition(
            ConditionType.DROP_RATE_HIGH, high, "AboveMaxDropRate" if high else "WithinMaxDropRate", message
        )

    def track_recovery(self, view: GangView, previous: StepRecord | None) -> float | None:
        """End the recovery in progress, if any, now that the gang steps again: the Recovered event says
        where the new attempt resumed and what of the failed attempt it redid."""
        since = parse_time(self.st.recovering_since)
        if since is None or view.progress is None:
            return None
        self.st.recovering_since = None
        seconds = max(0.0, (self.now - since).total_seconds())
        resumed = ""
        if view.resumed_step is not None:
            resumed = f", resumed from step {view.resumed_step}"
            if previous is not None and previous.attempt != self.attempt:
                redone = max(0, previous.last_step - view.resumed_step)
                resumed += (
                    f" (attempt {previous.attempt} was last seen at step {previous.last_step}: "
                    f"{redone} step(s) redone)"
                )
        self.event(
            "Normal",
            "Recovered",
            f"attempt {self.attempt} is training again at step {view.progress.step}{resumed}, "
            f"{seconds:.0f} s after the failure",
        )
        return seconds

    def observe(self) -> Plan:
        gang = read_gang(
            self.current,
            self.world.pods,
            self.world.sidecars,
            name=self.name,
            attempt=self.attempt,
            replicas=self.job.spec.replicas,
            job_name=self.job_name,
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

    def track_straggler(self, gang: GangReading) -> StragglerObservation | None:
        """Score the ranks (``GangView.straggler``, as ``trainguard run`` does), keep the scores and the
        straggler in the status, and post an Event when a straggler is named or no longer is."""
        threshold = self.job.spec.health.straggler.threshold
        view = gang.view
        scores = {s.rank: s.score for s in view.straggler_scores(threshold)}
        replicas = self.job.spec.replicas
        self.st.straggler_scores = (
            [_rounded(scores.get(r), 3) for r in range(replicas)]
            if scores and replicas <= MAX_SCORED_RANKS
            else None
        )
        found = view.straggler(threshold, {r.rank: r.place for r in gang.ranks})
        before = self.old.straggler
        if found is None and not scores:
            return None  # a gang not scored now (starting, ending): the last straggler seen stays
        if found is None:
            self.st.straggler = None
            if before is not None:
                self.event("Normal", "StragglerCleared", f"rank {before.rank} is no straggler any more")
            return None
        pod, node = gang.pods.get(found.rank, ("", ""))
        message = f"rank {found.rank} ({found.place or 'not placed'}) is a straggler: {found.reason}"
        self.st.straggler = StragglerStatus(
            rank=found.rank,
            score=round(found.score, 3),
            own_score=_rounded(found.own_score, 3),
            pod=pod,
            node=node,
            step=view.last_step,
            message=clip(message),
        )
        if before is None or before.rank != found.rank or before.node != node:
            action = self.job.spec.health.straggler.action
            self.event("Warning", "StragglerDetected", f"{message} (action: {action})")
        return found

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
        due, message = self.schedule_next(decision, "as a new PyTorchJob")
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

    # --------------------------------------------------------------------------- in place ---
    @cached_property
    def hosts(self) -> HostReading:
        """The pods of the host attempt, read once per step for running the current attempt in them."""
        return read_hosts(
            self.world.pods,
            self.world.sidecars,
            name=self.name,
            host_attempt=self.host,
            attempt=self.attempt,
            replicas=self.job.spec.replicas,
        )

    def in_place_orders(self, decision: Decision) -> tuple[OrderTarget, ...]:
        """The pods to order when this restart can keep the gang's pods (``inplace``), else ()."""
        if not self.settings.restarts_in_place or decision.failure is FailureKind.STRAGGLER:
            return ()  # a straggler's restart wants another node
        if self.st.in_place_restarts >= self.settings.in_place_restarts:
            return ()  # fresh pods, fresh placement, now and then
        if self.st.pinned is not None and repin_world(self.st.pinned, self.asked.spec)[1]:
            return ()  # a new world size: new pods
        return self.hosts.orderable

    def restart_in_place(
        self, decision: Decision, recovered: float | None, grace: int, targets: tuple[OrderTarget, ...]
    ) -> Plan:
        """Restart the gang in its pods: every launcher stops its worker now (a SIGTERM, then SIGKILL after
        ``grace``) and starts the next attempt when the backoff is over."""
        due, message = self.schedule_next(decision, "in place (pods kept)")
        st = self.st
        attempt = self.attempt + 1
        st.attempt_created = attempt
        st.attempt_started_at = iso_precise(due)
        st.host_attempt = self.host
        st.in_place_restarts += 1
        history = FailureHistory(decision.restarts, self.failure_history().run_seconds)
        order = RestartOrder(
            attempt=attempt,
            environment=order_environment(self.job, attempt, st.remediation, history),
            stop=StopMode.GRACEFUL,
            grace_seconds=grace,
            start_delay_seconds=decision.delay_seconds,
        )
        return self.plan(
            PlanAction.RESTART_IN_PLACE,
            min(self.period, decision.delay_seconds),
            delete=self.stale_delete,
            orders=targets,
            order=order,
            write_status_first=True,
            decision=decision,
            recovered_seconds=recovered,
            phase_reason="GangRestart",
            phase_message=f"{message}; attempt {attempt} starts at {iso(due)}",
        )

    def in_place_failure(self) -> tuple[str, str]:
        """For an attempt ordered in place that has not stepped yet: why it will not start in its pods
        (an order refused, a pod that cannot host it, or a launcher that did not take the order within
        ``order_timeout_seconds`` of the attempt's start), and which pod's launcher has not started it
        yet; ("", "") otherwise."""
        if self.st.host_attempt is None or self.st.recovering_since is None:
            return "", ""
        if self.world.order_refusals:
            pod, why = sorted(self.world.order_refusals.items())[0]
            return f"pod {pod} did not take the order: {why}", ""
        broken, pending = self.hosts.broken, self.hosts.pending
        if broken:
            return broken, ""
        due = parse_time(self.st.next_attempt_at) or self.now
        if pending and self.now >= due + timedelta(seconds=self.settings.order_timeout_seconds):
            return f"{pending} {self.settings.order_timeout_seconds:g} s after the attempt was due", ""
        return "", pending

    def fall_back(self, why: str, grace: int) -> Plan:
        """Give up the restart in place of the current attempt: its PyTorchJob goes, and the attempt starts
        as a new one (the restart was counted when it was decided)."""
        st = self.st
        self.event(
            "Warning",
            "InPlaceRestartFailed",
            f"attempt {self.attempt} cannot start in the pods of attempt {self.host} ({why}): "
            "it starts as a new PyTorchJob",
        )
        st.host_attempt = None
        st.in_place_restarts = 0
        st.attempt_created = self.attempt - 1
        st.phase = Phase.RESTARTING.value
        return self.plan(
            PlanAction.FALL_BACK,
            STALE_POLL_SECONDS,
            delete=(*self.stale_delete, self.job_name),
            stop_pods_within_seconds=grace,
            write_status_first=True,
            phase_reason="InPlaceRestartFailed",
            phase_message=f"attempt {self.attempt} starts as a new PyTorchJob: {why}",
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
    return _Step(world, settings).run()

"""An in-memory "API server" for the pure reconcile step: a GuardedTrainingJob, its PyTorchJobs (or
TrainJobs) and its pods as the real one stores them (objects and their status), the pods and sidecar
answers a scenario sets, and one reconcile step carried out on that state in the executor's order
(``Cluster.step``)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import yaml
from trainguard_operator.backends.trainjob import (
    COMPLETION_INDEX,
    JOBSET_NAME_LABEL,
    RANKS_BY_COMPLETION_INDEX,
    TRAINJOB_KIND,
    WORKER_CONTAINER_LABEL,
)
from trainguard_operator.reconcile import Plan, World, reconcile
from trainguard_operator.render import (
    ATTEMPT_LABEL,
    JOB_LABEL,
    RANK_LAYOUT_LABEL,
    RANKS_BY_WORKER_INDEX,
    REPLICA_INDEX_LABEL,
    REPLICA_TYPE_LABEL,
    pytorchjob_name,
)
from trainguard_operator.settings import OperatorSettings
from trainguard_operator.status import JobStatus

from tests.support.manifests import gtj_manifest
from tests.support.paths import REPO_ROOT
from trainer_sidecar.contract.inplace import LauncherPhase, LauncherState
from trainer_sidecar.contract.status import WorkerStatus
from trainguard.core.observation import SidecarReport

T0 = datetime(2030, 1, 1, tzinfo=UTC)
GTJ_CRD = REPO_ROOT / "crds/guardedtrainingjobs.trainguard.dev.yaml"


@cache
def status_validator() -> jsonschema.Draft7Validator:
    """The GuardedTrainingJob CRD's status schema (``nullable`` aside: the operator writes no nulls)."""
    crd = yaml.load(GTJ_CRD.read_text(), Loader=yaml.CSafeLoader)
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    return jsonschema.Draft7Validator(schema)


UID = "6f1c2d3e-0000-4000-8000-000000000001"
SETTINGS = OperatorSettings(stale_attempt_grace_seconds=60, crd_retry_seconds=60)


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies a merge patch."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result


def pod(
    attempt: int,
    rank: int,
    *,
    phase: str = "Running",
    exit_code: int | None = None,
    container_reason: str | None = None,
    finished_at: str | None = None,
    job: str = "tiny-lm",
    backend: str = "PyTorchJob",
    **status: Any,
) -> dict[str, Any]:
    """A pod as the training operator (``backend`` TrainJob: JobSet's Job controller) creates it and the
    kubelet reports it."""
    state: dict[str, Any] = {"running": {"startedAt": "2030-01-01T00:00:00Z"}}
    if exit_code is not None:
        state = {
            "terminated": {
                "exitCode": exit_code,
                "reason": container_reason or ("Completed" if exit_code == 0 else "Error"),
            }
        }
        if finished_at is not None:
            state["terminated"]["finishedAt"] = finished_at
        phase = "Succeeded" if exit_code == 0 else "Failed"
    if backend == TRAINJOB_KIND:
        return _trainjob_pod(attempt, rank, job, phase, state, status)
    return {
        "metadata": {
            "name": f"{pytorchjob_name(job, attempt)}-worker-{rank}",
            "namespace": "research",
            "labels": {
                JOB_LABEL: job,
                ATTEMPT_LABEL: str(attempt),
                REPLICA_TYPE_LABEL: "worker",
                REPLICA_INDEX_LABEL: str(rank),
                RANK_LAYOUT_LABEL: RANKS_BY_WORKER_INDEX,
            },
        },
        "status": {
            "phase": phase,
            "podIP": f"10.0.0.{rank + 1}",
            "containerStatuses": [{"name": "pytorch", "restartCount": 0, "state": state}],
            **status,
        },
    }


def _trainjob_pod(
    attempt: int, rank: int, job: str, phase: str, state: dict[str, Any], status: dict[str, Any]
) -> dict[str, Any]:
    child = pytorchjob_name(job, attempt)
    return {
        "metadata": {
            "name": pod_name(attempt, rank, TRAINJOB_KIND, job),
            "namespace": "research",
            "labels": {
                JOB_LABEL: job,
                ATTEMPT_LABEL: str(attempt),
                RANK_LAYOUT_LABEL: RANKS_BY_COMPLETION_INDEX,
                COMPLETION_INDEX: str(rank),
                JOBSET_NAME_LABEL: child,
                WORKER_CONTAINER_LABEL: "node",
            },
            "annotations": {COMPLETION_INDEX: str(rank), "kubectl.kubernetes.io/default-container": "node"},
        },
        "status": {
            "phase": phase,
            "podIP": f"10.0.0.{rank + 1}",
            "containerStatuses": [{"name": "node", "restartCount": 0, "state": state}],
            **status,
        },
    }


def pod_name(attempt: int, rank: int, backend: str = "PyTorchJob", job: str = "tiny-lm") -> str:
    """The name of rank ``rank``'s pod of ``attempt`` (JobSet's ``<jobset>-node-0-<index>-<suffix>``)."""
    child = pytorchjob_name(job, attempt)
    return f"{child}-node-0-{rank}-x7k2p" if backend == TRAINJOB_KIND else f"{child}-worker-{rank}"


def report(alive: bool = True, reason: str = "running", **status: Any) -> SidecarReport:
    """A sidecar's /status answer."""
    worker = {"phase": "running", "step": 100, "started_at": 1.0, "last_step_time": 2.0, **status}
    return SidecarReport(
        reachable=True, alive=alive, reason=reason, status=WorkerStatus.model_validate(worker)
    )


def worker_report(
    attempt: int,
    phase: LauncherPhase = LauncherPhase.RUNNING,
    *,
    alive: bool = True,
    started: float = T0.timestamp(),
    status_started: float | None = None,
    step: int = 100,
    exit_code: int | None = None,
    output: str = "",
) -> SidecarReport:
    """A sidecar's answer for a pod whose launcher runs ``attempt`` (its worker started at ``started``)."""
    launcher = LauncherState(
        attempt=attempt,
        phase=phase,
        since=started,
        updated_at=started,
        exit_code=exit_code,
        started_at=None if phase is LauncherPhase.STOPPING else started,
        output_tail=output,
    )
    begun = started + 1 if status_started is None else status_started
    status = WorkerStatus(phase="running", step=step, started_at=begun, last_step_time=begun + 1)
    return SidecarReport(reachable=True, alive=alive, reason="ok", status=status, launcher=launcher)


@dataclass
class Cluster:
    """The API server's state for one job: the GuardedTrainingJob, its PyTorchJobs, its pods."""

    body: dict[str, Any]
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    pods: list[dict[str, Any]] = field(default_factory=list)
    crd: bool = True
    history: list[Plan] = field(default_factory=list)
    settings: OperatorSettings = SETTINGS
    #: Whether the TrainJob CRD is served, and the kind of the pods ``run_pods`` makes.
    trainjob_crd: bool = False
    backend: str = "PyTorchJob"

    @classmethod
    def of(cls, manifest: dict[str, Any] | None = None) -> Cluster:
        body = copy.deepcopy(
            manifest or gtj_manifest(recovery={"backoffSeconds": [10, 30, 90], "maxRestarts": 3})
        )
        body["metadata"] |= {"uid": UID, "generation": 1}
        return cls(body)

    @property
    def status(self) -> JobStatus:
        return JobStatus.from_body(self.body)

    def world(
        self,
        now: datetime,
        sidecars: Mapping[str, SidecarReport] | None = None,
        refusals: Mapping[str, str] | None = None,
    ) -> World:
        def of(kind: str, served: bool) -> list[dict[str, Any]] | None:
            found = [copy.deepcopy(j) for j in self.jobs.values() if j.get("kind", "PyTorchJob") == kind]
            return found if served else None

        return World(
            body=copy.deepcopy(self.body),
            jobs=of("PyTorchJob", self.crd),
            children={TRAINJOB_KIND: of(TRAINJOB_KIND, self.trainjob_crd)},
            pods=copy.deepcopy(self.pods),
            sidecars=dict(sidecars or {}),
            now=now,
            order_refusals=dict(refusals or {}),
        )

    def plan(
        self,
        now: datetime,
        sidecars: Mapping[str, SidecarReport] | None = None,
        refusals: Mapping[str, str] | None = None,
    ) -> Plan:
        """A reconcile step from the stored state only (``refusals``: the pods that refused an order)."""
        return reconcile(self.world(now, sidecars, refusals), self.settings)

    def write_status(self, plan: Plan) -> None:
        self.body["status"] = apply_merge_patch(self.body.get("status") or {}, plan.patch)
        # What the API server would refuse (the CRD's status schema) must never be written.
        errors = [e.message for e in status_validator().iter_errors(self.body["status"])]
        assert errors == [], errors

    def effects(self, plan: Plan) -> None:
        for name in plan.delete:
            gone = self.jobs.pop(name, None)
            if gone is not None:
                attempt = gone["metadata"]["labels"][ATTEMPT_LABEL]
                self.pods = [p for p in self.pods if p["metadata"]["labels"][ATTEMPT_LABEL] != attempt]
        if plan.create is not None:
            self.jobs.setdefault(plan.create["metadata"]["name"], copy.deepcopy(plan.create))

    def step(
        self,
        now: datetime,
        sidecars: Mapping[str, SidecarReport] | None = None,
        refusals: Mapping[str, str] | None = None,
    ) -> Plan:
        """Reconcile and carry the plan out completely, in the executor's order."""
        plan = self.plan(now, sidecars, refusals)
        if plan.write_status_first:
            self.write_status(plan)
        self.effects(plan)
        if not plan.write_status_first:
            self.write_status(plan)
        self.history.append(plan)
        return plan

    def current_job(self) -> dict[str, Any]:
        attempt = self.status.attempt
        assert attempt is not None
        return self.jobs[pytorchjob_name("tiny-lm", attempt)]

    def run_pods(self, attempt: int, replicas: int = 2) -> None:
        self.pods += [pod(attempt, rank, backend=self.backend) for rank in range(replicas)]

    def set_pod(self, replacement: dict[str, Any]) -> None:
        name = replacement["metadata"]["name"]
        self.pods = [p for p in self.pods if p["metadata"]["name"] != name] + [replacement]


def reasons(plan: Plan) -> list[str]:
    """The reasons of the Events the plan posts, in order."""
    return [e.reason for e in plan.events]

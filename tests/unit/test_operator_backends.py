"""The TrainJob backend beside the PyTorchJob one: what an attempt renders to, which backend a job runs
as on the cluster at hand, and that a fault reaches the same decision, status and Events through either
(only the objects differ)."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import pytest
from trainguard_operator.backends import ChildPhase, RenderRequest
from trainguard_operator.backends.choice import choose
from trainguard_operator.backends.pytorchjob import PYTORCHJOB
from trainguard_operator.backends.trainjob import (
    COMPLETION_INDEX,
    PATCH_MANAGER,
    RANKS_BY_COMPLETION_INDEX,
    TRAINJOB,
)
from trainguard_operator.pods import pod_rank
from trainguard_operator.reconcile import Plan, PlanAction
from trainguard_operator.render import (
    ATTEMPT_LABEL,
    CHECKPOINT_VOLUME,
    JOB_LABEL,
    RANK_LAYOUT_LABEL,
    SIDECAR_CONTAINER,
    Owner,
    RenderError,
)
from trainguard_operator.settings import OperatorSettings

from tests.support.manifests import gtj_manifest, load, trainer_schema_errors
from tests.support.operator_world import T0, UID, Cluster, pod, pod_name, reasons, report, worker_report
from trainer_sidecar.contract.inplace import LauncherPhase

KEY = "k" * 64
SETTINGS = OperatorSettings(sidecar_image="registry.example/trainguard:test", order_key=KEY)
OWNER = Owner("tiny-lm", "research", UID)
#: Restarts in place on, as in test_operator_inplace.
IN_PLACE = OperatorSettings(
    stale_attempt_grace_seconds=60, crd_retry_seconds=60, order_key=KEY, order_timeout_seconds=30
)


def render_both(manifest: Mapping[str, Any], attempt: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
    """Attempt ``attempt`` of the manifest's job as a PyTorchJob and as a TrainJob."""
    request = RenderRequest(load(manifest), OWNER, attempt, None, SETTINGS)
    return PYTORCHJOB.render(request), TRAINJOB.render(request)


def ptj_pod(job: Mapping[str, Any]) -> dict[str, Any]:
    template: dict[str, Any] = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    return template


def tj_pod(job: Mapping[str, Any]) -> dict[str, Any]:
    (patch,) = job["spec"]["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node"
    template: dict[str, Any] = node["template"]["spec"]["template"]
    return template


def named(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(item for item in items if item["name"] == name)


def values(env: list[dict[str, Any]]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in env}


# ------------------------------------------------------------------------------------- rendering ---
def test_a_trainjob_names_trainguards_runtime_and_is_owned_by_the_job() -> None:
    _, job = render_both(gtj_manifest(replicas=3))
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == (
        "trainer.kubeflow.org/v1alpha1",
        "TrainJob",
        "tiny-lm-1",
    )
    (owner,) = job["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "GuardedTrainingJob",
        "tiny-lm",
        UID,
        True,
    )
    assert job["metadata"]["labels"][JOB_LABEL] == "tiny-lm"
    assert job["spec"]["runtimeRef"] == {
        "name": "trainguard-torch-distributed",
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
    }
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"], trainer["image"]) == (
        3,
        1,
        "registry.example/tiny-lm:1",
    )
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 1}}
    (patch,) = job["spec"]["runtimePatches"]
    assert patch["manager"] == PATCH_MANAGER
    assert TRAINJOB.rendered_world(job) == {"replicas": 3, "nprocPerNode": 1}


def test_a_trainjobs_worker_gets_what_a_pytorchjobs_worker_gets() -> None:
    ptj, tj = render_both(gtj_manifest())
    ptj_worker = named(ptj_pod(ptj)["spec"]["containers"], "pytorch")
    trainer = tj["spec"]["trainer"]
    # The guardian's variables come from the same function, the NCCL defaults and the user's too.
    ours = {k: v for k, v in values(ptj_worker["env"]).items() if not k.startswith(("PET_", "MASTER_"))}
    theirs = values(trainer["env"])
    for name, value in ours.items():
        if name not in ("RANK",):
            assert theirs[name] == value, name
    assert any(name.startswith("TRAINGUARD_") for name in theirs)
    # Trainer refuses the PET_* variables in spec.trainer.env: it sets them itself.
    assert not [name for name in theirs if name.startswith("PET_")]
    assert theirs["MASTER_ADDR"] == "tiny-lm-1-node-0-0.tiny-lm-1"
    assert theirs["RANK"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{COMPLETION_INDEX}']"
    # The launcher wraps the command as it does in a PyTorchJob (an order key is set).
    assert trainer["command"] == ptj_worker["command"]
    assert (
        "trainer_sidecar.launcher" in " ".join(trainer["command"])
        or "trainguard-launch" in trainer["command"]
    )
    assert "args" not in trainer


def test_what_is_per_job_goes_into_trainguards_runtime_patch() -> None:
    ptj, tj = render_both(gtj_manifest())
    pod_patch = tj_pod(tj)
    labels = pod_patch["metadata"]["labels"]
    assert (labels[JOB_LABEL], labels[ATTEMPT_LABEL], labels["team"]) == ("tiny-lm", "1", "nlp")
    assert labels[RANK_LAYOUT_LABEL] == RANKS_BY_COMPLETION_INDEX
    assert pod_patch["metadata"]["annotations"]["kubectl.kubernetes.io/default-container"] == "node"
    assert labels["trainguard.dev/worker-container"] == "node"
    spec = pod_patch["spec"]
    claim = named(spec["volumes"], CHECKPOINT_VOLUME)
    assert claim["persistentVolumeClaim"] == {"claimName": "tiny-lm-ckpt"}
    (node,) = spec["containers"]
    assert node["name"] == "node"
    assert {"name": CHECKPOINT_VOLUME, "mountPath": "/ckpt"} in node["volumeMounts"]
    assert spec["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["terminationGracePeriodSeconds"] == ptj_pod(ptj)["spec"]["terminationGracePeriodSeconds"]
    # The sidecar's environment is the PyTorchJob sidecar's: the job's settings and the order token.
    (sidecar,) = spec["initContainers"]
    ptj_sidecar = named(ptj_pod(ptj)["spec"]["initContainers"], SIDECAR_CONTAINER)
    assert sidecar == {"name": SIDECAR_CONTAINER, "env": ptj_sidecar["env"]}
    # Only what Trainer lets a patch set (runtimePatches' PodSpecPatch and ContainerPatch); its admission
    # refuses env on the node container (the worker's env goes through spec.trainer.env), and a manager
    # that is not a domain-prefixed path.
    assert set(node) <= {"name", "volumeMounts", "securityContext"}
    assert set(spec) <= {
        "volumes",
        "initContainers",
        "containers",
        "serviceAccountName",
        "imagePullSecrets",
        "securityContext",
        "nodeSelector",
        "affinity",
        "tolerations",
        "schedulingGates",
        "terminationGracePeriodSeconds",
    }
    assert re.fullmatch(r"[a-z0-9.-]+\.[a-z]+/[a-z0-9-]+", PATCH_MANAGER)


def test_the_order_token_is_the_trainjobs_own() -> None:
    _, first = render_both(gtj_manifest(), attempt=1)
    _, second = render_both(gtj_manifest(), attempt=2)
    digest = "TRAINGUARD_ORDER_TOKEN_SHA256"

    def token(job: Mapping[str, Any]) -> Any:
        return values(tj_pod(job)["spec"]["initContainers"][0]["env"]).get(digest)

    assert token(first)
    assert token(second)
    assert token(first) != token(second)


def test_a_node_to_avoid_and_torchrun_reach_the_trainjob() -> None:
    manifest = gtj_manifest(nprocPerNode=4)
    request = RenderRequest(load(manifest), OWNER, 2, None, SETTINGS, avoid_node="node-7")
    job = TRAINJOB.render(request)
    assert job["spec"]["trainer"]["numProcPerNode"] == 4
    # torchrun's node arguments are the PET_* variables Trainer's torch plugin sets.
    assert any("$(PET_NPROC_PER_NODE)" in part for part in job["spec"]["trainer"]["command"])
    terms = tj_pod(job)["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["node-7"]


def _trainjobs() -> list[tuple[str, dict[str, Any]]]:
    """Renders of several shapes: plain (the launcher: an order key), no launcher, torchrun with a node
    to avoid in attempt 3, and every pod field the backend carries."""
    everything = gtj_manifest(nprocPerNode=2)
    pod = everything["spec"]["template"]["spec"]
    pod.update(
        serviceAccountName="trainer",
        imagePullSecrets=[{"name": "registry"}],
        securityContext={
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        nodeSelector={"pool": "gpu"},
        schedulingGates=[{"name": "example.com/quota"}],
        volumes=[{"name": "data", "emptyDir": {}}],
    )
    worker = pod["containers"][0]
    worker["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    worker["securityContext"] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    no_key = OperatorSettings(sidecar_image="registry.example/trainguard:test")
    return [
        ("plain", TRAINJOB.render(RenderRequest(load(gtj_manifest()), OWNER, 1, None, SETTINGS))),
        ("no launcher", TRAINJOB.render(RenderRequest(load(gtj_manifest()), OWNER, 1, None, no_key))),
        (
            "torchrun, a node to avoid",
            TRAINJOB.render(
                RenderRequest(load(gtj_manifest(nprocPerNode=4)), OWNER, 3, None, SETTINGS, avoid_node="n7")
            ),
        ),
        ("every pod field", TRAINJOB.render(RenderRequest(load(everything), OWNER, 1, None, SETTINGS))),
    ]


@pytest.mark.parametrize(("shape", "job"), _trainjobs(), ids=[shape for shape, _ in _trainjobs()])
def test_a_rendered_trainjob_meets_trainers_own_crd_schema(shape: str, job: dict[str, Any]) -> None:
    """Trainer v2.3.0's TrainJob CRD (from its module), strict: a field it does not know would be pruned
    by the API server, so it is an error here (``manifests._strict``). tests/e2e/test_trainjob_backend_e2e
    has the API server and Trainer's webhook admit one too."""
    del shape
    assert trainer_schema_errors(job) == []
    # The check can fail: a field a runtime patch may not set.
    broken = copy.deepcopy(job)
    tj_pod(broken)["spec"]["containers"][0]["ports"] = [{"containerPort": 80}]
    (error,) = trainer_schema_errors(broken)
    assert "'ports' was unexpected" in error, error


def _with(path: str, value: Any) -> dict[str, Any]:
    manifest = gtj_manifest()
    target: Any = manifest["spec"]["template"]["spec"]
    *parents, last = path.split(".")
    for key in parents:
        target = target[key] if not key.isdigit() else target[int(key)]
    target[last] = value
    return manifest


@pytest.mark.parametrize(
    ("manifest", "field"),
    [
        (
            _with("initContainers", [{"name": "fetch", "image": "busybox"}]),
            "spec.template.spec.initContainers",
        ),
        (_with("hostNetwork", True), "spec.template.spec.hostNetwork"),
        (_with("containers.0.workingDir", "/work"), "containers[pytorch].workingDir"),
        (_with("containers.0.ports", [{"containerPort": 80}]), "containers[pytorch].ports"),
    ],
)
def test_a_template_field_trainer_cannot_carry_is_refused_by_name(
    manifest: dict[str, Any], field: str
) -> None:
    with pytest.raises(RenderError, match=field.replace("[", r"\[").replace("]", r"\]")):
        render_both(manifest)


def test_a_variable_trainer_sets_itself_is_refused_by_name() -> None:
    manifest = gtj_manifest(env=[{"name": "PET_NNODES", "value": "4"}, {"name": "LR", "value": "0.1"}])
    with pytest.raises(RenderError, match=r"containers\[pytorch\]\.env: PET_NNODES"):
        render_both(manifest)


def test_a_worker_without_a_command_of_its_own_is_refused_by_name() -> None:
    manifest = gtj_manifest()
    del manifest["spec"]["template"]["spec"]["containers"][0]["command"]
    with pytest.raises(RenderError, match=r"containers\[pytorch\]\.command"):
        render_both(manifest)


def test_another_container_and_another_probe_period_are_refused_by_name() -> None:
    manifest = gtj_manifest()
    manifest["spec"]["template"]["spec"]["containers"].append({"name": "logger", "image": "busybox"})
    with pytest.raises(RenderError, match=r"containers\[logger\]"):
        render_both(manifest)
    manifest = gtj_manifest()
    manifest["spec"]["health"]["probePeriodSeconds"] = 5
    with pytest.raises(RenderError, match=r"spec\.health\.probePeriodSeconds"):
        render_both(manifest)


def test_a_trainjobs_phase_comes_from_trainers_conditions() -> None:
    def job(*conditions: tuple[str, str]) -> dict[str, Any]:
        return {"status": {"conditions": [{"type": t, "status": s, "message": "m"} for t, s in conditions]}}

    assert TRAINJOB.state(job()).phase is ChildPhase.RUNNING
    assert TRAINJOB.state(job(("Complete", "True"))).phase is ChildPhase.SUCCEEDED
    assert TRAINJOB.state(job(("Failed", "False"))).phase is ChildPhase.RUNNING
    failed = TRAINJOB.state(job(("Failed", "True")))
    assert (failed.phase, failed.message) == (ChildPhase.FAILED, "m")
    # A PyTorchJob's Succeeded condition means nothing to a TrainJob.
    assert TRAINJOB.state(job(("Succeeded", "True"))).phase is ChildPhase.RUNNING


def test_a_jobset_pods_rank_is_its_completion_index() -> None:
    assert pod_rank(pod(1, 3, backend="TrainJob")) == 3
    annotated_only = pod(1, 2, backend="TrainJob")
    del annotated_only["metadata"]["labels"][COMPLETION_INDEX]
    assert pod_rank(annotated_only) == 2
    del annotated_only["metadata"]["annotations"][COMPLETION_INDEX]
    assert pod_rank(annotated_only) is None


# ------------------------------------------------------------------------------- backend choice ---
def served(*kinds: str) -> Any:
    return lambda kind: kind in kinds


@pytest.mark.parametrize(
    ("asked", "recorded", "started", "cluster", "chosen", "waits_for"),
    [
        ("Auto", None, False, ("PyTorchJob", "TrainJob"), "PyTorchJob", ()),
        ("Auto", None, False, ("TrainJob",), "TrainJob", ()),
        ("Auto", None, False, ("PyTorchJob",), "PyTorchJob", ()),
        ("Auto", None, False, (), None, ("PyTorchJob", "TrainJob")),
        ("TrainJob", None, False, ("PyTorchJob",), None, ("TrainJob",)),
        ("PyTorchJob", None, False, ("TrainJob",), None, ("PyTorchJob",)),
        # Chosen once: the status's choice holds though the other CRD appears or the first goes.
        ("Auto", "TrainJob", True, ("PyTorchJob", "TrainJob"), "TrainJob", ()),
        ("Auto", "TrainJob", True, ("PyTorchJob",), None, ("TrainJob",)),
        # A job started before there were two backends runs as a PyTorchJob.
        ("Auto", None, True, ("PyTorchJob", "TrainJob"), "PyTorchJob", ()),
        ("Auto", None, True, ("TrainJob",), None, ("PyTorchJob",)),
    ],
)
def test_the_backend_is_the_one_asked_or_the_crd_the_cluster_serves(
    asked: str,
    recorded: str | None,
    started: bool,
    cluster: tuple[str, ...],
    chosen: str | None,
    waits_for: tuple[str, ...],
) -> None:
    backend, waiting = choose(asked, recorded, started, served(*cluster))
    assert (backend.kind if backend else None) == chosen
    assert tuple(b.kind for b in waiting) == waits_for


def trainjob_cluster(backend: str = "Auto") -> Cluster:
    """A cluster with Trainer v2 and no training operator, and a job asking for ``backend``."""
    manifest = gtj_manifest(recovery={"backoffSeconds": [10, 30, 90], "maxRestarts": 3}, backend=backend)
    cluster = Cluster.of(manifest)
    cluster.crd, cluster.trainjob_crd, cluster.backend = False, True, "TrainJob"
    return cluster


def test_auto_on_a_cluster_with_trainer_only_runs_the_job_as_a_trainjob() -> None:
    cluster = trainjob_cluster()
    plan = cluster.step(T0)
    assert (plan.action, plan.backend) == (PlanAction.CREATE, "TrainJob")
    assert plan.create is not None
    assert plan.create["kind"] == "TrainJob"
    status = cluster.status
    assert (status.backend, status.train_job, status.pytorch_job) == ("TrainJob", "tiny-lm-1", None)
    assert reasons(plan) == ["AttemptCreated"]
    assert "created TrainJob tiny-lm-1" in plan.events[0].message
    # The PyTorchJob CRD arriving later changes nothing for this job.
    cluster.crd = True
    cluster.run_pods(1)
    plan = cluster.step(T0 + timedelta(seconds=5))
    assert (plan.action, plan.backend, cluster.status.phase) == (PlanAction.NOTHING, "TrainJob", "Running")


def test_a_trainjob_asked_for_on_a_cluster_without_trainer_waits_with_a_condition() -> None:
    cluster = trainjob_cluster("TrainJob")
    cluster.trainjob_crd, cluster.crd = False, True
    plan = cluster.step(T0)
    assert plan.action is PlanAction.BLOCKED
    assert reasons(plan) == ["TrainJobCRDMissing"]
    assert "trainer.kubeflow.org/v1alpha1 trainjobs" in plan.events[0].message
    assert "kubeflow.org/v1 pytorchjobs" not in plan.events[0].message
    cluster.trainjob_crd = True
    assert cluster.step(T0 + timedelta(seconds=60)).action is PlanAction.CREATE


def test_a_change_of_backend_while_the_job_runs_is_refused() -> None:
    cluster = trainjob_cluster()
    cluster.crd = True
    cluster.body["spec"]["backend"] = "TrainJob"
    assert cluster.step(T0).backend == "TrainJob"
    cluster.body["spec"]["backend"] = "PyTorchJob"
    cluster.body["metadata"]["generation"] = 2
    plan = cluster.step(T0 + timedelta(seconds=5))
    assert "SpecChangeRefused" in reasons(plan)
    assert "spec.backend" in plan.events[0].message
    assert plan.backend == "TrainJob"


# ------------------------------------------------------------------- the same faults, either way ---
def started(backend: str) -> Cluster:
    cluster = trainjob_cluster() if backend == "TrainJob" else Cluster.of()
    assert cluster.step(T0).action is PlanAction.CREATE
    cluster.run_pods(1)
    assert cluster.step(T0 + timedelta(seconds=5)).action is PlanAction.NOTHING
    return cluster


def crash(cluster: Cluster) -> Plan:
    cluster.set_pod(pod(1, 1, exit_code=137, backend=cluster.backend))
    return cluster.step(T0 + timedelta(seconds=60))


def hang(cluster: Cluster) -> Plan:
    why = "no step for 312.0 s (hang timeout 300 s), last step 4200"
    sidecars = {pod_name(1, 1, cluster.backend): report(alive=False, reason=why)}
    return cluster.step(T0 + timedelta(seconds=400), sidecars)


def lost_object(cluster: Cluster) -> Plan:
    cluster.jobs.clear()
    return cluster.step(T0 + timedelta(seconds=60))


def succeeded(cluster: Cluster) -> Plan:
    cluster.set_pod(pod(1, 0, exit_code=0, backend=cluster.backend))
    cluster.set_pod(pod(1, 1, exit_code=0, backend=cluster.backend))
    return cluster.step(T0 + timedelta(seconds=60))


def meaning(plan: Plan, cluster: Cluster) -> dict[str, Any]:
    """What a plan decides, without the kind of object it acts on."""
    failure = cluster.status.last_failure
    decision = plan.decision
    return {
        "action": plan.action,
        "delete": plan.delete,
        "stop": plan.stop_pods_within_seconds,
        "events": [(e.type, e.reason, e.message.replace("TrainJob", "PyTorchJob")) for e in plan.events],
        "decision": None if decision is None else (decision.action, decision.failure, decision.rank),
        "failure": None if failure is None else (failure.reason, failure.rank, failure.exit_code),
        "status": (cluster.status.phase, cluster.status.attempt, cluster.status.restarts),
    }


@pytest.mark.parametrize("fault", [crash, hang, lost_object, succeeded])
def test_a_fault_through_a_trainjob_is_decided_as_through_a_pytorchjob(fault: Any) -> None:
    pytorchjob, trainjob = started("PyTorchJob"), started("TrainJob")
    by_ptj, by_tj = fault(pytorchjob), fault(trainjob)
    assert (by_ptj.backend, by_tj.backend) == ("PyTorchJob", "TrainJob")
    assert meaning(by_tj, trainjob) == meaning(by_ptj, pytorchjob)
    assert by_tj.action is not PlanAction.NOTHING


def test_a_trainjob_gang_restarts_as_a_new_trainjob_of_the_next_attempt() -> None:
    cluster = started("TrainJob")
    crash(cluster)
    plan = cluster.step(T0 + timedelta(seconds=75))
    assert (plan.action, plan.backend) == (PlanAction.CREATE, "TrainJob")
    assert plan.create is not None
    assert plan.create["metadata"]["name"] == "tiny-lm-2"
    env = values(plan.create["spec"]["trainer"]["env"])
    assert env["TRAINGUARD_ATTEMPT"] == "2"
    assert cluster.status.train_job == "tiny-lm-2"


def test_a_trainjob_adopted_after_a_lost_status_write_pins_its_world_size() -> None:
    cluster = trainjob_cluster()
    plan = cluster.step(T0)
    assert plan.create is not None
    # The status write of the creation was lost, and the spec asks for 4 replicas since.
    lost = copy.deepcopy(cluster.body)
    del lost["status"]
    lost["spec"]["replicas"] = 4
    cluster.body = lost
    cluster.jobs[plan.create["metadata"]["name"]]["metadata"]["creationTimestamp"] = "2030-01-01T00:00:00Z"
    plan = cluster.step(T0 + timedelta(seconds=5))
    assert plan.create is None
    status = cluster.status
    assert (status.attempt_created, status.train_job, status.backend) == (1, "tiny-lm-1", "TrainJob")
    assert status.pinned is not None
    assert status.pinned["replicas"] == 2


# --------------------------------------------------------------------------- restarts in place ---
def _launchers(cluster: Cluster, attempt: int, host: int = 1, exited: int | None = None) -> dict[str, Any]:
    """Every rank's sidecar answer with its launcher at ``attempt`` (rank ``exited``: its worker ended
    137, held for an order), for the pods of ``host``."""
    answers = {}
    for rank in range(2):
        if rank == exited:
            started = (T0 + timedelta(seconds=59)).timestamp()
            answer = worker_report(attempt, LauncherPhase.EXITED, alive=False, exit_code=137, started=started)
        else:
            answer = worker_report(attempt)
        answers[pod_name(host, rank, cluster.backend)] = answer
    return answers


@pytest.mark.parametrize("backend", ["PyTorchJob", "TrainJob"])
def test_a_crash_restarts_the_gang_in_its_trainjob_pods_as_in_a_pytorchjobs(backend: str) -> None:
    cluster = trainjob_cluster() if backend == "TrainJob" else Cluster.of()
    cluster.settings = IN_PLACE
    assert cluster.step(T0).action is PlanAction.CREATE
    cluster.run_pods(1)
    assert cluster.step(T0 + timedelta(seconds=5), _launchers(cluster, 1)).action is PlanAction.NOTHING
    plan = cluster.step(T0 + timedelta(seconds=60), _launchers(cluster, 1, exited=1))
    assert plan.action is PlanAction.RESTART_IN_PLACE
    assert plan.backend == backend
    assert [t.pod for t in plan.orders] == [pod_name(1, rank, backend) for rank in range(2)]
    assert plan.order is not None
    assert plan.order.attempt == 2
    assert plan.delete == ()
    # The attempt runs in the host attempt's pods, whose object stays: the order's signer is its own.
    assert getattr(cluster.status, "train_job" if backend == "TrainJob" else "pytorch_job") == "tiny-lm-1"
    assert cluster.status.host_attempt == 1
    running = cluster.step(T0 + timedelta(seconds=75), _launchers(cluster, 2))
    assert (running.action, cluster.status.phase, cluster.status.attempt) == (
        PlanAction.NOTHING,
        "Running",
        2,
    )

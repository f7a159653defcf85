"""End to end, the TrainJob backend on the real controllers: a GuardedTrainingJob with ``backend:
TrainJob`` runs the example job as TrainJobs on trainguard's runtime.

Everything is real: the test cluster (``tests/support/cluster.py``: the control plane, the node with
containerd and the kubelet), Kubeflow Trainer v2.3.0's controller manager and JobSet v0.12.0's
controller with their CRDs and webhooks (``tests/support/trainer.py``), and the trainguard operator as
``helm install charts/trainguard`` makes it, with the chart's ClusterTrainingRuntime
``trainguard-torch-distributed`` (``trainJobRuntime.install: true``). The operator renders each attempt
as a TrainJob; Trainer's webhook admits it against the runtime and its manager builds the JobSet of the
runtime with trainguard's patch merged in; JobSet makes the Indexed Job whose pods the kubelet runs in a
namespace that enforces the Pod Security "restricted" profile. The job is ``tests/support/jobs.py``'s
short example (60 steps, a checkpoint every 10) on a shared volume.

Before any pod runs, the objects themselves are checked against Trainer's real schemas and webhooks: the
chart's runtime is applied and a rendered TrainJob is created by a server-side dry run, both with strict
field validation, so a field Trainer's CRDs do not know is an error rather than silently pruned.
"""

from __future__ import annotations

import json
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from trainguard_operator.backends import RenderRequest
from trainguard_operator.backends.trainjob import (
    JOBSET_NAME_LABEL,
    PATCH_MANAGER,
    TRAINJOB,
)
from trainguard_operator.render import JOB_LABEL, Owner
from trainguard_operator.settings import OperatorSettings

from tests.support import controlplane, tools
from tests.support.cluster import Cluster, Operator
from tests.support.jobs import JOB, JobNamespace, condition, example, operator_refusals, timestamp
from tests.support.manifests import load
from tests.support.paths import CHART
from tests.support.trainer import Trainer, apply_runtime

#: trainguard's runtime's liveness probe period, which each job's health.probePeriodSeconds must equal.
PROBE_PERIOD = 1
#: A hang is a few seconds without a step here, as in test_cluster_e2e's in-place scenarios.
HEALTH = {"hangTimeoutSeconds": 4, "startupGraceSeconds": 120, "probePeriodSeconds": PROBE_PERIOD}
RUNTIME = "trainguard-torch-distributed"
#: Rank 1 hangs here in attempt 2, after the crash of attempt 1 at step 30 (each fault fires once).
HANG_STEP = 45


def trainjob_example(**kwargs: Any) -> list[dict[str, Any]]:
    """``jobs.example`` (its claim and its job) with ``backend: TrainJob`` and this module's health."""
    claim, job = example(health=HEALTH, **kwargs)
    job["spec"]["backend"] = "TrainJob"
    return [claim, job]


# ------------------------------------------------------------------------------- the schemas ---
def chart_runtime(name: str, tmp: Path) -> dict[str, Any]:
    """The chart's ClusterTrainingRuntime as ``helm template`` renders it, named ``name``."""
    rendered = tools.helm(
        "template", "trainguard", str(CHART), "--namespace=trainguard-system",
        "--set=trainJobRuntime.install=true", f"--set=trainJobRuntime.name={name}",
        f"--set=trainJobRuntime.probePeriodSeconds={PROBE_PERIOD}",
    ).stdout  # fmt: skip
    (runtime,) = [d for d in yaml.safe_load_all(rendered) if d and d.get("kind") == "ClusterTrainingRuntime"]
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(runtime))
    return dict(runtime)


def rendered_trainjob(namespace: str, runtime: str) -> dict[str, Any]:
    """Attempt 1 of the short example as the operator renders it, on the runtime ``runtime``, restarts
    in place on (the launcher, the order token), owned by a job of a made-up uid."""
    _, job = trainjob_example()
    job["metadata"]["namespace"] = namespace
    job["spec"]["template"]["spec"]["containers"][0]["image"] = "registry.example/tiny-lm:test"
    settings = OperatorSettings(
        sidecar_image="registry.example/trainguard:test",
        order_key="k" * 64,
        trainjob_runtime=runtime,
        trainjob_probe_period_seconds=PROBE_PERIOD,
    )
    owner = Owner(JOB, namespace, str(uuid.uuid4()))
    return TRAINJOB.render(RenderRequest(load(job), owner, 1, None, settings))


def dropped(sent: Any, stored: Any, where: str = "") -> list[str]:
    """The paths of what ``sent`` holds and ``stored`` lacks or holds otherwise (lists by index): what
    the API server pruned or changed. What it added (its defaults) is not a difference."""
    if isinstance(sent, dict):
        if not isinstance(stored, dict):
            return [where or "."]
        return [p for k, v in sent.items() for p in dropped(v, stored.get(k, ...), f"{where}.{k}")]
    if isinstance(sent, list):
        if not isinstance(stored, list) or len(stored) != len(sent):
            return [where]
        return [p for i, v in enumerate(sent) for p in dropped(v, stored[i], f"{where}[{i}]")]
    return [] if sent == stored else [where]


def dry_run_create(plane: controlplane.ControlPlane, document: dict[str, Any]) -> tuple[int, str, str]:
    """``kubectl create --dry-run=server --validate=strict`` of ``document``: exit code, stdout (the
    object as the API server would store it, JSON), stderr."""
    result = plane.kubectl(
        "create", "--dry-run=server", "--validate=strict", "-o", "json", "-f", "-",
        stdin=json.dumps(document), check=False,
    )  # fmt: skip
    return result.returncode, result.stdout, result.stderr


def test_the_charts_runtime_and_a_rendered_trainjob_pass_trainers_crds_and_webhooks(
    control_plane: controlplane.ControlPlane, kubeflow_trainer: Trainer, tmp_path: Path
) -> None:
    """The chart's runtime is admitted by Trainer's CRD (strict: no unknown field) and its runtime
    webhook; a TrainJob the operator renders on it is admitted by Trainer's CRD and its TrainJob webhook
    (which checks the runtime patch against the runtime: the replicated job and the containers exist, no
    env on ``node``), and the API server would store it unpruned. A field Trainer does not know is
    refused by name, so the check can fail."""
    plane = control_plane
    name = f"trainguard-schema-{uuid.uuid4().hex[:6]}"
    namespace = f"schema-{uuid.uuid4().hex[:6]}"
    runtime = chart_runtime(name, tmp_path)
    plane.kubectl("create", "namespace", namespace)
    try:
        apply_runtime(plane, tmp_path / f"{name}.yaml")
        stored = json.loads(plane.kubectl("get", "clustertrainingruntime", name, "-o", "json").stdout)
        assert dropped(runtime["spec"], stored["spec"]) == []

        document = rendered_trainjob(namespace, name)
        code, out, err = dry_run_create(plane, document)
        assert code == 0, err
        admitted = json.loads(out)
        assert dropped(document["spec"], admitted["spec"]) == []
        (patch,) = admitted["spec"]["runtimePatches"]
        assert patch["manager"] == PATCH_MANAGER
        assert patch["time"], patch  # Trainer's defaulting webhook ran

        unknown = json.loads(json.dumps(document))
        node = unknown["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
        node["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["ports"] = [
            {"containerPort": 8080}
        ]
        code, _, err = dry_run_create(plane, unknown)
        assert code != 0
        assert re.search(r'unknown field "spec\.runtimePatches\[0\]\.\S*\.containers\[0\]\.ports"', err), err
    finally:
        plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        plane.kubectl("delete", "clustertrainingruntime", name, "--ignore-not-found", check=False)


# ----------------------------------------------------------------------------- on the node ---
@pytest.fixture(scope="module")
def operator(e2e_cluster: Cluster, kubeflow_trainer: Trainer) -> Iterator[Operator]:
    """The chart, installed once for this module once Trainer runs, with its runtime."""
    installed = e2e_cluster.install_operator(
        ["--set=trainJobRuntime.install=true", f"--set=trainJobRuntime.probePeriodSeconds={PROBE_PERIOD}"]
    )
    try:
        yield installed
    finally:
        e2e_cluster.uninstall_operator()


@pytest.fixture
def namespace(
    e2e_cluster: Cluster, operator: Operator, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[JobNamespace]:
    """A fresh restricted namespace with the example's shared volume; afterwards the operator must not
    have been refused anything by the API server (a verb missing from the chart's RBAC)."""
    name = "tj-" + request.node.name.removeprefix("test_").replace("_", "-")[:40].rstrip("-")
    created = JobNamespace.create(e2e_cluster, name, tmp_path / "checkpoints")
    try:
        yield created
    finally:
        created.delete()
    assert operator_refusals(e2e_cluster) == []


def trainer_objects(cluster: Cluster, namespace: str) -> str:
    """The namespace's TrainJobs and JobSets (for failure messages)."""
    return cluster.kubectl("get", "trainjobs,jobsets,jobs", "-n", namespace, "-o", "wide", check=False)


@pytest.mark.timeout(600)
def test_a_job_run_as_trainjobs_recovers_a_crashed_rank_and_a_hung_one_from_its_checkpoints(
    e2e_cluster: Cluster, kubeflow_trainer: Trainer, namespace: JobNamespace
) -> None:
    """Rank 1 crashes at step 30 of attempt 1, and hangs at step 45 of attempt 2: each time the operator
    restarts the gang (in its pods, or as a new TrainJob, as its policy picks; a hang in place), the next
    attempt resumes from the checkpoint written before the fault, and attempt 3 trains to step 60; the
    job Succeeds, and so does the last TrainJob, by Trainer's own status."""
    cluster = e2e_cluster
    namespace.apply(trainjob_example(faults=f"crash@30:1,hang@{HANG_STEP}:1"))
    first = namespace.wait(
        "attempt 1's TrainJob", lambda: cluster.get("trainjob", f"{JOB}-1", namespace.name), timeout=120
    )
    job = namespace.wait(
        "the job's status to name its TrainJob",
        lambda: (found := namespace.job()) and found.get("status", {}).get("trainJob") and found,
        timeout=60,
    )
    assert first["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert first["spec"]["runtimeRef"]["name"] == RUNTIME
    assert job["status"]["trainJob"] == f"{JOB}-1", job["status"]

    try:
        crashed = namespace.wait(
            "the restart after the crash",
            lambda: (found := namespace.job()) and found.get("status", {}).get("restarts") == 1 and found,
            timeout=300,
        )["status"]["lastFailure"]
        status, diagnostics = namespace.succeeded(timeout=420, restarts=2)
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}\n{trainer_objects(cluster, namespace.name)}\n{kubeflow_trainer.log_tails()}"
        ) from exc
    diagnostics += trainer_objects(cluster, namespace.name)
    assert (crashed["reason"], crashed["rank"]) == ("Crashed", 1), crashed
    assert status["lastFailure"]["reason"] == "Hung", status["lastFailure"]
    history = {h["attempt"]: h for h in status["stepHistory"]}
    assert 20 <= history[2]["resumedStep"] <= 30, history
    assert 40 <= history[3]["resumedStep"] <= HANG_STEP, history
    assert history[3]["lastStep"] == 60, history
    restarts = [e["message"] for e in namespace.events() if e["reason"] == "GangRestart"]
    assert len(restarts) == 2, restarts
    assert "in place (pods kept)" in restarts[1], restarts
    in_place = "in place (pods kept)" in restarts[0]
    assert in_place or "as a new TrainJob" in restarts[0], restarts
    last = f"{JOB}-1" if in_place else f"{JOB}-2"
    assert status["trainJob"] == last, status

    # Trainer marks the TrainJob Complete once JobSet has marked its JobSet Completed.
    trainjob = namespace.wait(
        f"TrainJob {last} to complete",
        lambda: (
            (found := cluster.get("trainjob", last, namespace.name))
            and condition(found, "Complete")
            and found
        ),
        timeout=60,
    )
    assert not condition(trainjob, "Failed"), diagnostics
    jobset = cluster.get("jobset", last, namespace.name)
    assert jobset is not None
    assert condition(jobset, "Completed"), diagnostics

    # The pods JobSet made carry trainguard's labels (the runtime patch) and run trainguard's sidecar
    # beside Trainer's "node" container, as the restricted profile admits them.
    pods = cluster.items("pods", namespace.name, f"{JOB_LABEL}={JOB}")
    gang = [p for p in pods if p["metadata"]["labels"].get(JOBSET_NAME_LABEL) == last]
    assert len(gang) == 2, diagnostics
    for pod in gang:
        labels = pod["metadata"]["labels"]
        assert labels["trainguard.dev/ranks"] == "job-completion-index", labels
        assert [c["name"] for c in pod["spec"]["containers"]] == ["node"]
        assert [c["name"] for c in pod["spec"]["initContainers"]] == ["trainguard-sidecar"]
        assert pod["status"]["phase"] == "Succeeded", diagnostics
    logs = cluster.pod_logs(namespace.name)
    assert "[rank 0] tiny_lm: done in" in logs, logs

    # The gang's checkpoints are on the shared volume, both ranks' files in the last one.
    steps = sorted(p.name for p in namespace.volume.glob("step-*"))
    assert steps, list(namespace.volume.iterdir())
    assert {p.name for p in (namespace.volume / steps[-1]).glob("rank-*.json")} == {
        "rank-0.json",
        "rank-1.json",
    }
    crash = timestamp(history[2]["firstStepAt"]) - timestamp(history[1]["lastStepAt"])
    hang = timestamp(history[3]["firstStepAt"]) - timestamp(history[2]["lastStepAt"])
    how = "in place" if in_place else "as a new TrainJob"
    print(
        f"TrainJob backend: crash of rank 1 recovered {how} in {crash:.1f} s, its hang in place in "
        f"{hang:.1f} s (last step before the fault to the first after)",
        file=sys.stderr,
    )

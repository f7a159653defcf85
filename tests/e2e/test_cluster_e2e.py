"""End to end on a real control plane: ``kubectl apply`` a GuardedTrainingJob and watch it train and recover.

Everything here is real: etcd, kube-apiserver, kube-controller-manager (garbage collection, service
accounts, volume binding, endpoint slices), kube-scheduler and the Kubeflow training operator v1.9 built
from the Go module proxy; a node (``tests/support/node.py``: containerd, the kubelet, kube-proxy, CoreDNS)
that runs the pods from the images of ``scripts/images.sh``; and the trainguard operator as a local
process. The workers train the example model (``examples/tiny_lm``, its image) with real torch and gloo,
and their checkpoints go to a ReadWriteMany PersistentVolume (a host directory) shared by the gang. Each
test's namespace enforces the Pod Security "restricted" profile, so every pod of the gang also passes the
real PodSecurity admission.

The scenarios are those of ``examples/k8s/job.yaml``, made short: 60 steps instead of 20 000, and a
hang timeout of seconds rather than minutes.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.cluster import Cluster, wait_for
from tests.support.paths import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "k8s" / "job.yaml"
JOB = "tiny-lm"
# A hang is a few seconds without a step here (the example's 120 s would make slow tests).
FAST_HANG_DETECTION = {"hangTimeoutSeconds": 4, "startupGraceSeconds": 120, "probePeriodSeconds": 1}
TWO_RESTARTS = {"maxRestarts": 2, "backoffSeconds": [2]}


def example(
    *,
    steps: int = 60,
    faults: str = "",
    health: dict[str, Any] | None = None,
    recovery: dict[str, Any] | None = None,
    guard: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """examples/k8s/job.yaml (its claim and its job), shortened for a test, with ``faults`` injected."""
    claim, job = (copy.deepcopy(d) for d in yaml.safe_load_all(EXAMPLE.read_text()))
    container = job["spec"]["template"]["spec"]["containers"][0]
    # The example asks for a node of its own (2 CPUs per rank); the test node has 2 CPUs for the gang.
    container["resources"] = {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"memory": "4Gi"}}
    command = container["command"]
    command[command.index("--max-steps") + 1] = str(steps)
    command[command.index("--log-every") + 1] = "10"
    # Two ranks share the machine's two cores: one thread each, or they fight for them.
    container["env"] = [{"name": "OMP_NUM_THREADS", "value": "1"}]
    if faults:
        container["env"].append({"name": "TRAINGUARD_FAULTS", "value": faults})
    job["spec"]["checkpoint"].update(everySteps=10, snapshotEverySteps=5)
    job["spec"]["health"] = health or {
        "hangTimeoutSeconds": 30,
        "startupGraceSeconds": 120,
        "probePeriodSeconds": 2,
    }
    job["spec"]["recovery"] = recovery or TWO_RESTARTS
    if guard:
        job["spec"]["guard"] = guard
    return [claim, job]


@pytest.fixture(scope="module", autouse=True)
def trainguard_operator(e2e_cluster: Cluster) -> Iterator[None]:
    """The trainguard operator, cluster-wide, for this module's tests only."""
    e2e_cluster.start_operator()
    try:
        yield
    finally:
        e2e_cluster.stop_operator()


@pytest.fixture
def namespace(e2e_cluster: Cluster, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh namespace enforcing Pod Security "restricted", with a ReadWriteMany PersistentVolume (a
    host directory) pre-bound to the claim."""
    name = "e2e-" + request.node.name.removeprefix("test_").replace("_", "-")[:40].rstrip("-")
    cluster = e2e_cluster
    cluster.kubectl("create", "namespace", name)
    # Every pod of the gang (trainguard's sidecar, the training operator's init container, the user's
    # worker) must pass the real PodSecurity admission of the strictest profile.
    cluster.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted")
    volume = tmp_path / "checkpoints"
    volume.mkdir()
    volume.chmod(0o777)  # the workers run as user 1000; a hostPath volume gets no fsGroup
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"{name}-ckpt"},
        "spec": {
            "capacity": {"storage": "10Gi"},
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": str(volume), "type": "Directory"},
            # Pre-bound to this namespace's claim: the tests' claims share a name.
            "claimRef": {"namespace": name, "name": "tiny-lm-ckpt"},
        },
    }
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(pv))
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=true", "--timeout=120s", check=False)
        cluster.kubectl("delete", "pv", f"{name}-ckpt", "--wait=false", check=False)


def apply(cluster: Cluster, namespace: str, documents: list[dict[str, Any]], tmp_path: Path) -> None:
    """``kubectl apply -f`` the documents, as a user would apply the example file with its image (the
    node's ``tiny-lm``) in place of the placeholder."""
    for document in documents:
        if document["kind"] == "GuardedTrainingJob":
            document["spec"]["template"]["spec"]["containers"][0]["image"] = cluster.node.images["tiny-lm"]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    cluster.kubectl("apply", "-n", namespace, "-f", str(path))


def condition(job: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    """The condition of ``kind`` in a job's status, if True."""
    for entry in (job or {}).get("status", {}).get("conditions", []):
        if entry["type"] == kind and entry["status"] == "True":
            return dict(entry)
    return None


def finished(cluster: Cluster, namespace: str, timeout: float) -> dict[str, Any]:
    """The job once it has Succeeded or Failed; the cluster's diagnostics if it does neither in time."""

    def done() -> dict[str, Any] | None:
        job = cluster.get("gtj", JOB, namespace)
        return job if condition(job, "Succeeded") or condition(job, "Failed") else None

    try:
        return wait_for(f"{namespace}/{JOB} to finish", done, timeout=timeout, interval=1.0)
    except Exception as exc:
        raise AssertionError(f"{exc}\n{cluster.diagnostics(namespace)}") from exc


def events(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    """The Events about object ``name``, oldest first."""
    listing = json.loads(
        cluster.kubectl(
            "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}", "-o", "json"
        )
    )
    return sorted(listing["items"], key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")


def _time(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_the_example_job_trains_to_success(e2e_cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    cluster = e2e_cluster
    started = time.monotonic()
    apply(cluster, namespace, example(), tmp_path)
    job = finished(cluster, namespace, timeout=300)
    elapsed = time.monotonic() - started
    assert condition(job, "Succeeded"), cluster.diagnostics(namespace)
    status = job["status"]
    assert status["restarts"] == 0
    # The final step and checkpoint, though the sidecars were gone: from the termination messages.
    assert status["step"] == 60, status
    assert status["lastCleanCheckpoint"]["step"] == 60

    # The training operator made the gang: pods and headless Services named after the replicas, the
    # worker's init container found the master by its Service name through the node's DNS.
    pytorchjob = cluster.get("pytorchjob", f"{JOB}-1", namespace)
    assert pytorchjob is not None
    assert pytorchjob["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert condition(pytorchjob, "Succeeded")
    master = cluster.get("pod", f"{JOB}-1-master-0", namespace)
    worker = cluster.get("pod", f"{JOB}-1-worker-0", namespace)
    assert master is not None
    assert worker is not None
    assert master["status"]["phase"] == worker["status"]["phase"] == "Succeeded"
    assert cluster.get("service", f"{JOB}-1-master-0", namespace) is not None
    init = {s["name"]: s for s in worker["status"]["initContainerStatuses"]}
    assert init["init-pytorch"]["state"]["terminated"]["exitCode"] == 0
    assert init["trainguard-sidecar"]["state"]["terminated"]  # stopped after the worker finished
    assert master["status"]["podIP"] != worker["status"]["podIP"]

    # The gang's checkpoints are on the shared volume, both ranks' files in each.
    volume = tmp_path / "checkpoints"
    steps = sorted(p.name for p in volume.glob("step-*"))
    assert steps, list(volume.iterdir())
    assert {p.name for p in (volume / steps[-1]).glob("rank-*.json")} == {"rank-0.json", "rank-1.json"}

    # kubectl logs reaches the kubelet's API through the API server.
    logs = cluster.kubectl("logs", f"{JOB}-1-master-0", "-n", namespace, "-c", "pytorch", "--tail=5")
    assert "[rank 0] tiny_lm: done in" in logs, logs
    assert json.loads(logs.strip().splitlines()[-1])["final_step"] == 60, logs
    table = cluster.kubectl("get", "gtj", "-n", namespace)
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "STATE", "STEP", "RESTARTS", "ROLLBACKS", "AGE"]
    assert row.split()[:5] == [JOB, "Succeeded", str(status["step"]), "0", "0"]
    described = cluster.kubectl("describe", "gtj", JOB, "-n", namespace)
    assert "AttemptCreated" in described
    assert "every rank exited 0" in described
    print(f"example job: Succeeded in {elapsed:.0f} s from kubectl apply")


def test_a_nan_burst_rolls_back_and_a_hang_restarts_the_gang_past_it(
    e2e_cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    cluster = e2e_cluster
    documents = example(
        faults="nan_loss@15x4,hang@35:1",
        health=FAST_HANG_DETECTION,
        recovery=TWO_RESTARTS,
    )
    apply(cluster, namespace, documents, tmp_path)
    job = finished(cluster, namespace, timeout=420)
    diagnostics = cluster.diagnostics(namespace)
    assert condition(job, "Succeeded"), diagnostics
    status = job["status"]
    # The NaN burst was handled inside the workers: a rollback, visible in the job's status.
    assert status["rollbacks"] >= 1, diagnostics
    assert status["skippedSteps"] >= 1
    # The hang of rank 1 restarted the whole gang once, after the backoff.
    assert status["restarts"] == 1, diagnostics
    reasons = [e["reason"] for e in events(cluster, namespace, JOB)]
    assert "RollbackSeen" in reasons
    assert "GangRestart" in reasons or "Hung" in reasons, reasons
    # Attempt 2 resumed from a checkpoint the gang wrote before the hang, on the shared volume, and
    # trained past the hang step.
    history = {h["attempt"]: h for h in status["stepHistory"]}
    first, second = history[1], history[2]
    assert 20 <= second["resumedStep"] <= 35, history
    assert first["lastStep"] >= 34
    assert second["lastStep"] > 35
    assert cluster.get("pytorchjob", f"{JOB}-2", namespace) is not None
    time_to_recover = _time(second["firstStepAt"]) - _time(first["lastStepAt"])
    print(
        f"hang at step 35 on rank 1: gang restarted, resumed from step {second['resumedStep']}, "
        f"time to recover {time_to_recover:.1f} s (last step before the hang to the first step after; "
        f"hang timeout 4 s, backoff 2 s)"
    )


def test_repeated_divergence_fails_the_job_with_the_reason(
    e2e_cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    cluster = e2e_cluster
    documents = example(
        faults="nan_loss@10x1000",
        guard={"maxRollbacks": 1, "maxConsecutiveBadSteps": 2},
        recovery={"maxRestarts": 1, "backoffSeconds": [1]},
    )
    apply(cluster, namespace, documents, tmp_path)
    job = finished(cluster, namespace, timeout=300)
    diagnostics = cluster.diagnostics(namespace)
    failed = condition(job, "Failed")
    assert failed is not None, diagnostics
    assert "diverged" in failed["message"], failed
    assert "restarts exhausted" in failed["message"], failed
    assert job["status"]["restarts"] == 1
    # The restart after the first divergence carried the remediation to the workers (the failed
    # attempt's PyTorchJob is deleted when the job gives up, so its Event is the record).
    created = [e["message"] for e in events(cluster, namespace, JOB) if e["reason"] == "AttemptCreated"]
    assert len(created) == 2, created
    assert "remediation" in created[1]
    assert "lrScale 0.5" in created[1]
    assert cluster.get("pytorchjob", f"{JOB}-2", namespace) is None  # nothing left running


def test_a_hang_while_the_operator_is_down_is_killed_by_the_liveness_probe(
    e2e_cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """The kubelet's path: the operator (which polls the sidecars and would see the hang first) is paused
    across the hang, as when it is down; the hung ranks' sidecars fail their liveness probes, the kubelet
    kills the workers, and the operator, back, restarts the gang from the shared checkpoint."""
    cluster = e2e_cluster
    documents = example(
        faults="hang@35:1",
        health=FAST_HANG_DETECTION,
        recovery=TWO_RESTARTS,
    )
    apply(cluster, namespace, documents, tmp_path)

    def stepping_past(step: int) -> bool:
        job = cluster.get("gtj", JOB, namespace)
        return int((job or {}).get("status", {}).get("step") or 0) >= step

    wait_for("the gang to train past step 25", lambda: stepping_past(25), timeout=240, interval=0.5)
    operator_pid = cluster.operator.pid
    os.kill(operator_pid, signal.SIGSTOP)
    try:

        def worker_killed() -> dict[str, Any] | None:
            pod = cluster.get("pod", f"{JOB}-1-worker-0", namespace)
            statuses = {s["name"]: s for s in (pod or {}).get("status", {}).get("containerStatuses", [])}
            terminated = statuses.get("pytorch", {}).get("state", {}).get("terminated")
            return dict(terminated) if terminated else None

        try:
            terminated = wait_for("the kubelet to kill the hung worker", worker_killed, timeout=120)
        except Exception as exc:
            raise AssertionError(f"{exc}\n{cluster.diagnostics(namespace)}") from exc
    finally:
        os.kill(operator_pid, signal.SIGCONT)
    assert terminated["exitCode"] in (137, 143), terminated  # SIGTERM, or SIGKILL after the grace
    unhealthy = [e for e in events(cluster, namespace, f"{JOB}-1-worker-0") if e["reason"] == "Unhealthy"]
    assert any("Liveness probe failed" in e["message"] and "503" in e["message"] for e in unhealthy), (
        unhealthy
    )
    killing = [e for e in events(cluster, namespace, f"{JOB}-1-worker-0") if e["reason"] == "Killing"]
    assert any("failed liveness probe" in e["message"] for e in killing), killing

    job = finished(cluster, namespace, timeout=300)
    diagnostics = cluster.diagnostics(namespace)
    assert condition(job, "Succeeded"), diagnostics
    status = job["status"]
    assert status["restarts"] == 1, diagnostics
    history = {h["attempt"]: h for h in status["stepHistory"]}
    assert 20 <= history[2]["resumedStep"] <= 35, history
    assert history[2]["lastStep"] > 35

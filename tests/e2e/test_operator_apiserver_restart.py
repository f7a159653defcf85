"""The operator against a real kube-apiserver that goes away and comes back (etcd keeps the state).

A control plane node's upgrade, or a crash-looping API server, ends every watch and refuses every request
for a while. The operator (its own process, as in a cluster, with its default retry settings) must ride
that out: not exit, not lose a job, and afterwards see both new jobs (its kopf watch) and pod changes (its
own watches, which resume or list again) as fast as before. The API server gets a private control plane:
stopping the session's would break every other test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.support import controlplane
from tests.support.kubeflow import pytorchjob_crd
from tests.support.manifests import gtj_manifest
from tests.support.paths import GTJ_CRD, REPO_ROOT
from tests.support.ports import free_port

NAMESPACE = "restarts"
#: How long the API server stays down after its process ended (it lingers a few seconds on SIGTERM).
DOWN_SECONDS = 8.0
#: How soon after the API server is ready again the operator must act on a change: its retries run every
#: 2 s (``TRAINGUARD_OPERATOR_API_RETRY_SECONDS``), plus a list of each watched kind.
ACT_AFTER_RESTART_SECONDS = 15.0

T = TypeVar("T")


@pytest.fixture
def plane(control_plane: controlplane.ControlPlane, tmp_path: Path) -> Iterator[controlplane.ControlPlane]:
    """A private etcd + kube-apiserver with both CRDs and the test's namespace."""
    private = controlplane.start(control_plane.bin_dir, tmp_path / "control-plane")
    try:
        for path in (GTJ_CRD, pytorchjob_crd()):
            private.kubectl("apply", "--server-side", f"--filename={path}")
        for crd in ("guardedtrainingjobs.trainguard.dev", "pytorchjobs.kubeflow.org"):
            private.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
        private.kubectl("create", "namespace", NAMESPACE)
        # No controller manager runs here to make the namespace's default service account for the pods.
        private.kubectl("create", "serviceaccount", "default", f"--namespace={NAMESPACE}")
        yield private
    finally:
        private.stop()


@pytest.fixture
def operator(plane: controlplane.ControlPlane, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m trainguard_operator`` for the test's namespace, standalone, with its default settings."""
    log = tmp_path / "operator.log"
    env = {
        **os.environ,
        "KUBECONFIG": str(plane.kubeconfig),
        "TRAINGUARD_OPERATOR_METRICS_HOST": "127.0.0.1",
        "TRAINGUARD_OPERATOR_METRICS_PORT": str(free_port()),
    }
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "trainguard_operator", "--namespace", NAMESPACE, "--liveness", ""],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait(what: str, found: Callable[[], T | None], timeout: float, log: Path) -> T:
    """Poll ``found`` every 0.2 s until it returns something; fail with the operator's log otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        time.sleep(0.2)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    raise AssertionError(f"{what} not seen in {timeout:g} s; the operator's log ends:\n{tail}")


def get(plane: controlplane.ControlPlane, kind: str, name: str) -> dict[str, Any] | None:
    """One object of the namespace, or None when it does not exist (or the API server does not answer)."""
    done = plane.kubectl("get", kind, name, f"--namespace={NAMESPACE}", "--output=json", check=False)
    return json.loads(done.stdout) if done.returncode == 0 else None


def deleted(plane: controlplane.ControlPlane, kind: str, name: str) -> bool:
    """Whether the object is gone or being deleted (no garbage collector runs here to finish a
    foreground deletion)."""
    found = get(plane, kind, name)
    return found is None or bool(found["metadata"].get("deletionTimestamp"))


def names(plane: controlplane.ControlPlane, kind: str) -> list[str]:
    """The names of the namespace's objects of ``kind``."""
    done = plane.kubectl("get", kind, f"--namespace={NAMESPACE}", "--output=json")
    return sorted(item["metadata"]["name"] for item in json.loads(done.stdout)["items"])


def apply(plane: controlplane.ControlPlane, manifest: dict[str, Any]) -> None:
    plane.kubectl("apply", "--filename=-", stdin=json.dumps(manifest))


def rank_pod(job: str, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s pod of attempt 1 of ``job``, labelled as the training operator labels it; it has
    no IP, so there is no sidecar to poll (no kubelet runs here: the test writes its status)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job}-1-worker-{rank}",
            "namespace": NAMESPACE,
            "labels": {
                "trainguard.dev/job": job,
                "trainguard.dev/attempt": "1",
                "trainguard.dev/ranks": "worker-index",
                "training.kubeflow.org/replica-type": "worker",
                "training.kubeflow.org/replica-index": str(rank),
                "training.kubeflow.org/job-name": f"{job}-1",
            },
        },
        "spec": {"containers": [{"name": "pytorch", "image": "registry.example/tiny-lm:1"}]},
    }


def set_state(plane: controlplane.ControlPlane, pod: str, phase: str, state: dict[str, Any]) -> None:
    """Write a pod's status as a kubelet would: its phase and the ``pytorch`` container's state."""
    status = {
        "phase": phase,
        "containerStatuses": [
            {
                "name": "pytorch",
                "ready": phase == "Running",
                "restartCount": 0,
                "image": "registry.example/tiny-lm:1",
                "imageID": "",
                "state": state,
            }
        ],
    }
    plane.kubectl(
        "patch",
        "pod",
        pod,
        f"--namespace={NAMESPACE}",
        "--subresource=status",
        "--type=merge",
        f"--patch={json.dumps({'status': status})}",
    )


def phase_of(plane: controlplane.ControlPlane, job: str) -> str | None:
    return ((get(plane, "guardedtrainingjob", job) or {}).get("status") or {}).get("phase")


@pytest.mark.timeout(300)
def test_the_operator_rides_out_an_api_server_restart_and_acts_on_changes_right_after_it(
    plane: controlplane.ControlPlane, operator: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    log = tmp_path / "operator.log"
    apply(plane, gtj_manifest("before", NAMESPACE, health={"probePeriodSeconds": 30}))
    wait("before's PyTorchJob", lambda: get(plane, "pytorchjob", "before-1"), 60, log)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for rank in (0, 1):
        pod = rank_pod("before", rank)
        plane.kubectl("create", "--filename=-", stdin=json.dumps(pod))
        set_state(plane, pod["metadata"]["name"], "Running", {"running": {"startedAt": now}})
    wait("before Running", lambda: phase_of(plane, "before") == "Running", 30, log)

    ready_seconds = plane.restart_apiserver(DOWN_SECONDS)
    back = time.monotonic()
    assert operator.poll() is None, "the operator exited during the outage"

    # A job created right after: kopf's watch of the jobs is back.
    apply(plane, gtj_manifest("after", NAMESPACE, health={"probePeriodSeconds": 30}))
    wait("after's PyTorchJob", lambda: get(plane, "pytorchjob", "after-1"), ACT_AFTER_RESTART_SECONDS, log)
    created = time.monotonic() - back

    # A pod that fails right after: the operator's own pod watch is back (resumed, or listed again),
    # and its failure is acted on at once, not at the next probe period (30 s).
    ended = {"terminated": {"exitCode": 137, "reason": "Error", "startedAt": now, "finishedAt": now}}
    set_state(plane, "before-1-worker-1", "Failed", ended)
    failed = time.monotonic()
    wait("before's failure acted on", lambda: deleted(plane, "pytorchjob", "before-1"), 10, log)
    acted = time.monotonic() - failed
    status = (get(plane, "guardedtrainingjob", "before") or {})["status"]
    assert (status["attempt"], status["restarts"]) == (2, 1), status
    assert status["lastFailure"]["rank"] == 1, status["lastFailure"]
    # Nothing was done twice, or lost: one PyTorchJob per live attempt, and the operator still runs.
    assert "after-1" in names(plane, "pytorchjob")
    assert operator.poll() is None
    # The restarted API server's watch cache starts after the versions the operator had seen, so its
    # watches were answered 410 Gone and listed again: the relist path, on a real API server.
    lines = log.read_text(errors="replace")
    assert f"the watch of pods in {NAMESPACE} lost its place: listing again" in lines
    print(
        f"API server ready {ready_seconds:.1f} s after its start; after it, a new job's PyTorchJob in "
        f"{created:.1f} s, a pod failure acted on in {acted:.2f} s"
    )

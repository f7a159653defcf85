"""GuardedTrainingJobs on the test cluster (``cluster``): the example job made short, a namespace for it
with a shared volume, and what the end-to-end tests and the recovery benchmark read back.

The job is ``examples/k8s/job.yaml`` (its claim and its GuardedTrainingJob) with the node's ``tiny-lm``
image, 60 steps instead of 20 000, a checkpoint every 10 steps, resources that fit the 2-core test node,
and the faults a scenario injects. Its namespace enforces the Pod Security "restricted" profile and has
a ReadWriteMany PersistentVolume (a host directory) pre-bound to the example's claim.
"""

from __future__ import annotations

import copy
import json
import re
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from tests.support.cluster import Cluster, ClusterError, wait_for
from tests.support.paths import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "k8s" / "job.yaml"
FSDP_EXAMPLE = REPO_ROOT / "examples" / "04_fsdp" / "job.yaml"
JOB = "tiny-lm"
CLAIM = "tiny-lm-ckpt"
#: A hang is a few seconds without a step here (the example's 120 s would make slow tests).
FAST_HANG_DETECTION = {"hangTimeoutSeconds": 4, "startupGraceSeconds": 120, "probePeriodSeconds": 1}
TWO_RESTARTS = {"maxRestarts": 2, "backoffSeconds": [2]}
#: Spike detection only once the loss window is full: tiny_lm's first steps have volatile gradient
#: norms, which a detector that starts after 10 steps takes for spikes (the image's standard library, the
#: corpus, differs from the host's).
QUIET_START = {"spikeMinHistory": 100}


def example(
    *,
    steps: int = 60,
    faults: str = "",
    health: dict[str, Any] | None = None,
    recovery: dict[str, Any] | None = None,
    guard: dict[str, Any] | None = None,
    memory_limit: str = "4Gi",
    command: list[str] | None = None,
    log_every: int = 10,
) -> list[dict[str, Any]]:
    """examples/k8s/job.yaml (its claim and its job), shortened for a test, with ``faults`` injected, rank
    0 logging every ``log_every`` steps and, given ``command``, the container's command replaced (its
    ``--max-steps``/``--log-every`` kept)."""
    claim, job = (copy.deepcopy(d) for d in yaml.safe_load_all(EXAMPLE.read_text()))
    container = job["spec"]["template"]["spec"]["containers"][0]
    # Less than the example asks: the test node's 2 CPUs and its memory hold the gang and the operator.
    # Still most of a core each: the kubelet gives a pod's processes CPU shares by its request, and on a
    # machine that also runs other work a pod that asked for little gets little.
    container["resources"] = {
        "requests": {"cpu": "800m", "memory": "512Mi"},
        "limits": {"memory": memory_limit},
    }
    arguments = container["command"][2:]
    arguments[arguments.index("--max-steps") + 1] = str(steps)
    arguments[arguments.index("--log-every") + 1] = str(log_every)
    container["command"] = [*(command or container["command"][:2]), *arguments]
    # Two ranks share the machine's two cores: one thread each, or they fight for them.
    container["env"] = [{"name": "OMP_NUM_THREADS", "value": "1"}]
    if faults:
        container["env"].append({"name": "TRAINGUARD_FAULTS", "value": faults})
    # The example's pod runs as its image's user 1000; its group too (containerd 1.6 would make it 0).
    job["spec"]["template"]["spec"]["securityContext"]["runAsGroup"] = 1000
    job["spec"]["checkpoint"].update(everySteps=10, snapshotEverySteps=5)
    job["spec"]["health"] = health or {
        "hangTimeoutSeconds": 30,
        "startupGraceSeconds": 120,
        "probePeriodSeconds": 2,
    }
    job["spec"]["recovery"] = recovery or TWO_RESTARTS
    job["spec"]["guard"] = {**QUIET_START, **(guard or {})}
    return [claim, job]


def fsdp_example() -> list[dict[str, Any]]:
    """The FSDP example as a cluster user runs it: examples/04_fsdp/job.yaml's command, faults, checkpoint
    cadence, health and recovery, in the job and claim of ``example()`` (the test node's resources, the
    restricted profile's security context, the shared volume's claim)."""
    claim, job = example()
    fsdp = yaml.safe_load(FSDP_EXAMPLE.read_text())["spec"]
    theirs = fsdp["template"]["spec"]["containers"][0]
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["command"] = theirs["command"]
    container["env"] = [*container["env"], *theirs["env"]]
    job["spec"]["checkpoint"].update({k: v for k, v in fsdp["checkpoint"].items() if k != "claimName"})
    job["spec"].update(replicas=fsdp["replicas"], health=fsdp["health"], recovery=fsdp["recovery"])
    return [claim, job]


def condition(job: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    """The condition of ``kind`` in a job's status, if True."""
    for entry in (job or {}).get("status", {}).get("conditions", []):
        if entry["type"] == kind and entry["status"] == "True":
            return dict(entry)
    return None


def timestamp(stamp: str) -> float:
    """A Kubernetes RFC 3339 time as Unix seconds."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


class JobNamespace:
    """A restricted namespace of the test cluster with a shared volume for the example's claim."""

    def __init__(self, cluster: Cluster, name: str, volume: Path) -> None:
        self.cluster = cluster
        self.name = name
        self.volume = volume

    @classmethod
    def create(cls, cluster: Cluster, name: str, volume: Path) -> JobNamespace:
        """Create the namespace (enforcing "restricted") and a ReadWriteMany PersistentVolume on the host
        directory ``volume``, pre-bound to the example's claim in it."""
        cluster.kubectl("create", "namespace", name)
        cluster.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted")
        volume.mkdir(parents=True, exist_ok=True)
        volume.chmod(0o777)  # the workers run as user 1000; a hostPath volume gets no fsGroup
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(persistent_volume(f"{name}-ckpt", name, volume)))
        return cls(cluster, name, volume)

    def delete(self) -> None:
        """Delete the namespace (waiting for its pods) and the volume object (the directory stays)."""
        self.cluster.kubectl("delete", "namespace", self.name, "--wait=true", "--timeout=120s", check=False)
        self.cluster.kubectl("delete", "pv", f"{self.name}-ckpt", "--wait=false", check=False)

    def apply(self, documents: list[dict[str, Any]]) -> None:
        """``kubectl apply -f`` the documents, as a user applies the example file with its image (the node's
        ``tiny-lm``) in place of the placeholder."""
        for document in documents:
            if document["kind"] == "GuardedTrainingJob":
                containers = document["spec"]["template"]["spec"]["containers"]
                containers[0]["image"] = self.cluster.node.images["tiny-lm"]
        self.cluster.kubectl("apply", "-n", self.name, "-f", "-", stdin=yaml.safe_dump_all(documents))

    def job(self) -> dict[str, Any] | None:
        """The GuardedTrainingJob as stored now."""
        return self.cluster.get("gtj", JOB, self.name)

    def wait(self, what: str, probe: Any, timeout: float) -> Any:
        """``wait_for`` with the namespace's diagnostics when it times out."""
        try:
            return wait_for(what, probe, timeout=timeout, interval=0.5)
        except ClusterError as exc:
            raise AssertionError(f"{exc}\n{self.cluster.diagnostics(self.name)}") from exc

    def finished(self, timeout: float) -> dict[str, Any]:
        """The job once it has Succeeded or Failed."""

        def done() -> dict[str, Any] | None:
            job = self.job()
            return job if condition(job, "Succeeded") or condition(job, "Failed") else None

        result: dict[str, Any] = self.wait(f"{self.name}/{JOB} to finish", done, timeout)
        return result

    def succeeded(self, timeout: float, restarts: int) -> tuple[dict[str, Any], str]:
        """The job's status once it finished, asserted Succeeded after ``restarts`` gang restarts, and the
        namespace's diagnostics (for the caller's further assertions)."""
        job = self.finished(timeout)
        diagnostics = self.cluster.diagnostics(self.name)
        assert condition(job, "Succeeded"), diagnostics
        status: dict[str, Any] = job["status"]
        assert status["restarts"] == restarts, diagnostics
        return status, diagnostics

    def stepping_past(self, step: int, timeout: float) -> dict[str, Any]:
        """The job once its status shows a step of at least ``step``."""

        def past() -> dict[str, Any] | None:
            job = self.job()
            return job if int((job or {}).get("status", {}).get("step") or 0) >= step else None

        result: dict[str, Any] = self.wait(f"{self.name}/{JOB} to train past step {step}", past, timeout)
        return result

    def events(self, name: str = JOB) -> list[dict[str, Any]]:
        """The Events about object ``name``, oldest first."""
        listing = json.loads(
            self.cluster.kubectl(
                "get",
                "events",
                "-n",
                self.name,
                "--field-selector",
                f"involvedObject.name={name}",
                "-o",
                "json",
            )
        )
        return sorted(listing["items"], key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")

    def reasons(self, name: str = JOB) -> list[str]:
        """The reasons of the Events about ``name``, oldest first."""
        return [e["reason"] for e in self.events(name)]

    def container_terminated(self, pod: str, container: str = "pytorch") -> dict[str, Any] | None:
        """The ``terminated`` state of a container of a pod, if the pod exists and the container ended."""
        found = self.cluster.get("pod", pod, self.name)
        for status in (found or {}).get("status", {}).get("containerStatuses") or []:
            if status["name"] == container:
                terminated: dict[str, Any] | None = status.get("state", {}).get("terminated")
                return terminated
        return None


def persistent_volume(name: str, namespace: str, directory: Path) -> dict[str, Any]:
    """A ReadWriteMany hostPath PersistentVolume pre-bound to the example's claim in ``namespace``."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": "10Gi"},
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": str(directory), "type": "Directory"},
            # Pre-bound: the tests' claims share a name.
            "claimRef": {"namespace": namespace, "name": CLAIM},
        },
    }


def operator_refusals(cluster: Cluster) -> list[str]:
    """The lines of the installed operator's logs (every container the kubelet kept) in which RBAC
    refused it: a verb or resource the chart's roles do not grant. (Other 403s, such as an Event posted
    into a namespace being deleted, are the API server's admission, not RBAC.)"""
    assert cluster.operator is not None, "no operator installed"
    refused = re.compile(r'forbidden: User \\?"system:serviceaccount:[^"\\]+\\?" cannot ')
    lines = []
    for log in sorted(cluster.node.pod_logs_dir.glob(f"{cluster.operator.namespace}_*/operator/*.log")):
        lines += [line for line in log.read_text(errors="replace").splitlines() if refused.search(line)]
    return lines


def scrape(url: str, timeout: float = 10) -> dict[str, float]:
    """A Prometheus text exposition as ``{'name{labels}': value}`` (comments and blank lines dropped)."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            samples[series] = float(value)
    return samples

"""The real operator (kopf's test runner, the kubernetes client, real sidecar servers) against kmock's
Kubernetes API emulator, with the test playing the training operator and the kubelet: it creates the
pods of each attempt and writes their states, and the workers' status files behind real sidecars."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import pytest_asyncio
import yaml
from kopf.testing import KopfRunner
from prometheus_client.parser import text_string_to_metric_families
from test_operator_render import REFERENCE, gtj_manifest
from trainguard_operator.__main__ import main
from trainguard_operator.render import (
    ATTEMPT_LABEL,
    REPLICA_INDEX_LABEL,
    REPLICA_TYPE_LABEL,
    SIDECAR_CONTAINER,
)

from trainer_sidecar.sidecar import SidecarServer
from trainer_sidecar.status import Phase, WorkerStatus, write_status

ROOT = Path(__file__).resolve().parents[1]
GTJ_CRD = ROOT / "crds/guardedtrainingjobs.trainguard.dev.yaml"
NS = "default"
GTJ = "trainguard.dev/v1alpha1/guardedtrainingjobs"
PTJ = "kubeflow.org/v1/pytorchjobs"
PODS = "v1/pods"
EVENTS = "v1/events"
GTJ_PATH = f"/apis/trainguard.dev/v1alpha1/namespaces/{NS}/guardedtrainingjobs"
PTJ_PATH = f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs"
POD_PATH = f"/api/v1/namespaces/{NS}/pods"
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
VERBS = {"list", "watch", "get", "create", "update", "patch", "delete"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the API server behaviour the operator and kopf rely on: on creation a uid,
    a creationTimestamp and a name from ``generateName`` (kopf names Events so); a resourceVersion that
    changes with every write; and optimistic concurrency on it (a merge patch carrying a stale
    resourceVersion gets 409, a JSON patch whose ``test`` of it fails gets 422)."""

    _serial = 0

    def _next_version(self) -> str:
        Emulator._serial += 1
        return str(Emulator._serial)

    def _current_version(self, request: kmock.Request) -> str | None:
        if request.resource is None or request.name is None:
            return None
        try:
            found = self.objects[request.resource, request.namespace, request.name]
        except KeyError:
            return None
        return None if found.deleted else found.raw.get("metadata", {}).get("resourceVersion")

    async def _handle(self, request: kmock.Request) -> Any:
        data = request.data
        if request.resource is not None and request.action == kmock.action.CREATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            version = self._next_version()
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{version}"
            meta.setdefault("uid", f"uid-{version}")
            meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            meta["resourceVersion"] = version
        elif request.resource is not None and request.action == kmock.action.UPDATE and request.name:
            current = self._current_version(request)
            if isinstance(data, list):
                for op in data:
                    test = op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion"
                    if test and op.get("value") != current:
                        raise kmock.KubernetesError(status=422, reason="Invalid", message="stale test")
                data.append({"op": "add", "path": "/metadata/resourceVersion", "value": self._next_version()})
            elif isinstance(data, dict):
                wanted = (data.get("metadata") or {}).get("resourceVersion")
                if wanted is not None and current is not None and wanted != current:
                    raise kmock.KubernetesError(
                        status=409, reason="Conflict", message="the object has been modified"
                    )
                data.setdefault("metadata", {})["resourceVersion"] = self._next_version()
        return await super()._handle(request)


async def install_crd(emulator: kmock.KubernetesEmulator, path: Path) -> None:
    """Install a CRD: its resource as the API server would serve it, and the CRD object itself (whose
    watch event is what tells kopf to look at the resources again)."""
    crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
    spec = crd["spec"]
    names = spec["names"]
    for version in spec["versions"]:
        emulator.resources[f"{spec['group']}/{version['name']}/{names['plural']}"] = kmock.ResourceInfo(
            kind=names["kind"],
            singular=names.get("singular"),
            namespaced=spec["scope"] == "Namespaced",
            shortnames=names.get("shortNames", []),
            verbs=VERBS,
            subresources=set(version.get("subresources", {})),
        )
    await post(emulator, CRD_PATH, crd)


pytestmark = pytest.mark.kmock(cls=Emulator)


@pytest_asyncio.fixture
async def bare_cluster(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> kmock.KubernetesEmulator:
    """kmock with the GuardedTrainingJob CRD (no PyTorchJob CRD), pods and events, and a kubeconfig."""
    # kopf watches CRDs to notice new resources (the PyTorchJob CRD arriving late, for one), and needs
    # namespaces discovered before it starts (it lists them only when not cluster-wide).
    kmock.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=VERBS
    )
    kmock.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs=VERBS)
    kmock.resources[PODS] = kmock.ResourceInfo(
        kind="Pod", namespaced=True, verbs=VERBS, subresources={"status"}
    )
    kmock.resources[EVENTS] = kmock.ResourceInfo(kind="Event", namespaced=True, verbs=VERBS)
    await install_crd(kmock, GTJ_CRD)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
        "users": [{"name": "operator", "user": {"token": "test-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "operator", "namespace": NS}}],
        "current-context": "kmock",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("KUBECONFIG", str(path))
    return kmock


@pytest_asyncio.fixture
async def cluster(bare_cluster: kmock.KubernetesEmulator) -> kmock.KubernetesEmulator:
    """``bare_cluster`` with the Kubeflow PyTorchJob CRD installed."""
    await install_crd(bare_cluster, REFERENCE)
    return bare_cluster


class Sidecars:
    """Real sidecar servers, one per rank, on 127.0.0.R+1 and one shared port (as in a pod network)."""

    def __init__(self, root: Path, ranks: int) -> None:
        self.files = [root / f"rank-{r}" / "status.json" for r in range(ranks)]
        self.servers: list[SidecarServer] = []
        port = 0
        for rank, path in enumerate(self.files):
            path.parent.mkdir(parents=True)
            server = SidecarServer(
                path,
                host=f"127.0.0.{rank + 1}",
                port=port,
                hang_timeout_seconds=30,
                startup_grace_seconds=30,
                job="tiny-lm",
                namespace=NS,
            )
            port = server.port
            server.start()
            self.servers.append(server)
        self.port = port

    def write(self, rank: int, **fields: Any) -> None:
        now = time.time()
        values: dict[str, Any] = {
            "started_at": now - 5,
            "phase": Phase.RUNNING,
            "last_step_time": now,
            "rank": rank,
        }
        values |= fields
        write_status(self.files[rank], WorkerStatus(**values))

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture
def sidecars(tmp_path: Path) -> Iterator[Sidecars]:
    found = Sidecars(tmp_path / "sidecars", 2)
    yield found
    found.stop()


@pytest.fixture
def operator_env(monkeypatch: pytest.MonkeyPatch, sidecars: Sidecars) -> int:
    """The operator's settings for the tests; returns the metrics port."""
    port = free_port()
    for key, value in {
        "METRICS_HOST": "127.0.0.1",
        "METRICS_PORT": str(port),
        "SIDECAR_PORT": str(sidecars.port),
        "SIDECAR_IMAGE": "registry.example/trainguard:test",
        "CRD_RETRY_SECONDS": "1",
        "API_RETRY_SECONDS": "0.5",
        "STALE_ATTEMPT_GRACE_SECONDS": "5",
        "POLL_TIMEOUT_SECONDS": "2",
    }.items():
        monkeypatch.setenv(f"TRAINGUARD_OPERATOR_{key}", value)
    return port


@contextlib.asynccontextmanager
async def operator() -> AsyncIterator[KopfRunner]:
    """The operator as ``kopf run`` runs it, in a thread; the emulator keeps serving on this loop."""
    # Cluster-wide: kmock 0.8 cannot list /api/v1/namespaces, which kopf does to serve --namespace.
    args = ["run", "--standalone", "--all-namespaces", "-m", "trainguard_operator.handlers"]
    runner = KopfRunner(args, timeout=30)
    await asyncio.to_thread(runner.__enter__)
    try:
        yield runner
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)
    # No handler may have failed with an unexpected exception (kopf would log and retry it).
    assert "Traceback" not in runner.output, runner.output[-4000:]


async def eventually(check: Callable[[], Any], timeout: float = 15.0, what: str = "") -> Any:
    """Poll ``check`` until it returns something truthy (and return it), or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
        except (KeyError, ValueError, AssertionError):
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what or check}")
        await asyncio.sleep(0.05)


def stored(emulator: kmock.KubernetesEmulator, resource: str, name: str) -> kmock.Object | None:
    """The emulator's record of an object (with its history), if it ever existed."""
    try:
        return emulator.objects[resource, NS, name]
    except KeyError:
        return None


def alive(emulator: kmock.KubernetesEmulator, resource: str, name: str) -> dict[str, Any] | None:
    found = stored(emulator, resource, name)
    if found is None or found.deleted:
        return None
    raw: dict[str, Any] = found.raw
    return raw


def status(emulator: kmock.KubernetesEmulator, name: str = "tiny-lm") -> dict[str, Any]:
    body = alive(emulator, GTJ, name)
    assert body is not None
    found: dict[str, Any] = body.get("status") or {}
    return found


def conditions(emulator: kmock.KubernetesEmulator, name: str = "tiny-lm") -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status(emulator, name).get("conditions", [])}


def events(emulator: kmock.KubernetesEmulator, name: str = "tiny-lm") -> list[dict[str, Any]]:
    found = []
    for (resource, _, _), obj in emulator.objects.items():
        if resource == EVENTS and not obj.deleted and obj.raw.get("involvedObject", {}).get("name") == name:
            found.append(obj.raw)
    return found


def event_reasons(emulator: kmock.KubernetesEmulator, name: str = "tiny-lm") -> list[str]:
    return [e["reason"] for e in events(emulator, name)]


def creations(emulator: kmock.KubernetesEmulator, resource: str, name: str) -> int:
    """How many times an object was created (its history starts anew after each deletion)."""
    found = stored(emulator, resource, name)
    if found is None:
        return 0
    history = list(found.history)
    return sum(1 for i, v in enumerate(history) if v is not None and (i == 0 or history[i - 1] is None))


async def post(emulator: kmock.KubernetesEmulator, path: str, body: dict[str, Any]) -> None:
    async with emulator.post(path, json=body) as response:
        assert response.status < 300, await response.text()


async def patch(emulator: kmock.KubernetesEmulator, path: str, body: dict[str, Any]) -> None:
    async with emulator.patch(
        path, json=body, headers={"Content-Type": "application/merge-patch+json"}
    ) as response:
        assert response.status < 300, await response.text()


def gtj(name: str = "tiny-lm", **spec: Any) -> dict[str, Any]:
    """A GuardedTrainingJob with 1 s health checks and a 1 s backoff, unless ``spec`` says otherwise."""
    fast: dict[str, Any] = {
        "health": {"hangTimeoutSeconds": 30, "startupGraceSeconds": 30, "probePeriodSeconds": 1},
        "recovery": {"maxRestarts": 3, "backoffSeconds": [1]},
    }
    manifest = gtj_manifest(name=name, namespace=NS, **(fast | spec))
    manifest["metadata"]["uid"] = f"uid-{name}"
    return manifest


async def start_pods(emulator: kmock.KubernetesEmulator, job: dict[str, Any], ips: list[str]) -> list[str]:
    """Create the pods of a PyTorchJob as the training operator would, Running at the given IPs."""
    names = []
    name = job["metadata"]["name"]
    for rank, ip in enumerate(ips):
        kind, index = ("Master", 0) if rank == 0 else ("Worker", rank - 1)
        template = job["spec"]["pytorchReplicaSpecs"][kind]["template"]
        pod_name = f"{name}-{kind.lower()}-{index}"
        labels = {
            **template["metadata"]["labels"],
            REPLICA_TYPE_LABEL: kind.lower(),
            REPLICA_INDEX_LABEL: str(index),
            "training.kubeflow.org/job-name": name,
        }
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod_name, "namespace": NS, "labels": labels},
            "spec": copy.deepcopy(template["spec"]),
            "status": {
                "phase": "Running",
                "podIP": ip,
                "containerStatuses": [
                    {
                        "name": "pytorch",
                        "restartCount": 0,
                        "state": {"running": {"startedAt": "2030-01-01T00:00:00Z"}},
                    }
                ],
            },
        }
        await post(emulator, POD_PATH, pod)
        names.append(pod_name)
    return names


async def terminate(emulator: kmock.KubernetesEmulator, pod: str, exit_code: int) -> None:
    """The kubelet reports the pytorch container terminated (restartPolicy Never: the pod fails)."""
    state = {"terminated": {"exitCode": exit_code, "reason": "Error"}}
    await patch(
        emulator,
        f"{POD_PATH}/{pod}/status",
        {
            "status": {
                "phase": "Failed",
                "containerStatuses": [{"name": "pytorch", "restartCount": 0, "state": state}],
            }
        },
    )


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metrics(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def scrape(port: int) -> Samples:
    return await asyncio.to_thread(metrics, port)


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample of the tiny-lm job (labels job and namespace implied)."""
    key = tuple(sorted({"job": "tiny-lm", "namespace": NS, **labels}.items()))
    return samples[name, key]


def env_of(job: dict[str, Any]) -> dict[str, str]:
    worker = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", "") for e in worker["env"]}


# ------------------------------------------------------------------------------------------ tests ---
@pytest.mark.slow
@pytest.mark.asyncio
async def test_render_poll_crash_restart_divergence_remediation_success(
    cluster: kmock.KubernetesEmulator, sidecars: Sidecars, operator_env: int
) -> None:
    async with operator():
        await post(cluster, GTJ_PATH, gtj())
        job1 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-1"), what="attempt 1's PyTorchJob")
        owner = job1["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "GuardedTrainingJob",
            "tiny-lm",
            "uid-tiny-lm",
            True,
        )
        init = job1["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["initContainers"]
        assert [c["name"] for c in init] == [SIDECAR_CONTAINER]
        assert init[0]["image"] == "registry.example/trainguard:test"
        assert job1["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] == "Never"

        # The kubelet runs the pods; the workers step, and the operator reads them through the sidecars.
        sidecars.write(0, step=50, rollbacks=1, skipped_steps=4, samples_seen=1000, samples_dropped=0)
        sidecars.write(1, step=50, rollbacks=1, skipped_steps=4, samples_seen=1000, samples_dropped=1)
        pods = await start_pods(cluster, job1, ["127.0.0.1", "127.0.0.2"])
        await eventually(
            # Both ranks' sidecars polled: the dropped samples are summed over them.
            lambda: status(cluster).get("phase") == "Running" and status(cluster).get("samplesSeen") == 2000,
            what="both ranks' progress",
        )
        assert status(cluster)["step"] == 50
        assert (status(cluster)["rollbacks"], status(cluster)["skippedSteps"]) == (1, 4)
        assert status(cluster)["dropRate"] == 0.0005
        assert conditions(cluster)["Ready"]["status"] == "True"
        await eventually(lambda: "RollbackSeen" in event_reasons(cluster), what="the rollback event")
        seen = await scrape(operator_env)
        assert value(seen, "trainguard_job_step") == 50
        assert value(seen, "trainguard_job_rollbacks") == 1
        assert value(seen, "trainguard_job_skipped_steps") == 4
        assert value(seen, "trainguard_job_dropped_samples") == 1
        assert value(seen, "trainguard_job_drop_ratio") == 0.0005
        assert value(seen, "trainguard_job_phase", phase="Running") == 1

        # Rank 1 is killed: after the 1 s backoff, attempt 1 is deleted and attempt 2 created.
        failed_at = time.monotonic()
        await terminate(cluster, pods[1], 137)
        job2 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-2"), what="attempt 2's PyTorchJob")
        assert time.monotonic() - failed_at >= 0.9  # the backoff was waited
        assert alive(cluster, PTJ, "tiny-lm-1") is None
        st = status(cluster)
        assert (st["attempt"], st["restarts"], st["handledAttempt"]) == (2, 1, 1)
        assert st["lastFailure"]["reason"] == "Crashed"
        assert (st["lastFailure"]["rank"], st["lastFailure"]["exitCode"]) == (1, 137)
        assert st["phase"] == "Restarting"  # until attempt 2's pods run
        assert conditions(cluster)["Restarting"]["status"] == "True"
        assert conditions(cluster)["Ready"]["status"] == "False"
        assert env_of(job2)["TRAINGUARD_ATTEMPT"] == "2"
        assert "TRAINGUARD_REMEDIATION" not in env_of(job2)
        assert (
            job2["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["labels"][ATTEMPT_LABEL]
            == "2"
        )
        await eventually(
            lambda: {"AttemptCreated", "Crashed", "GangRestart"} <= set(event_reasons(cluster)), what="events"
        )
        warnings = [e for e in events(cluster) if e["reason"] == "GangRestart"]
        assert warnings[0]["type"] == "Warning"
        assert "restart 1 of 3" in warnings[0]["message"]
        seen = await scrape(operator_env)
        assert value(seen, "trainguard_job_restarts_total") == 1
        assert value(seen, "trainguard_job_failures_total", kind="Crashed") == 1
        assert value(seen, "trainguard_job_attempt") == 2
        assert value(seen, "trainguard_job_last_restart_timestamp_seconds") > 0

        # Attempt 2 steps again (recovery is timed), then rank 0's guardian reports "diverged": the
        # gang restarts with the divergence remediation.
        sidecars.write(0, step=60, rollbacks=2)
        sidecars.write(1, step=60, rollbacks=2)
        await start_pods(cluster, job2, ["127.0.0.1", "127.0.0.2"])
        await eventually(lambda: "Recovered" in event_reasons(cluster), what="the recovery")
        seen = await scrape(operator_env)
        assert value(seen, "trainguard_job_time_to_recover_seconds_count") == 1
        sidecars.write(0, step=61, rollbacks=5, phase=Phase.DIVERGED, message="5 rollbacks within 2000 steps")
        job3 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-3"), what="attempt 3's PyTorchJob")
        st = status(cluster)
        assert st["lastFailure"]["reason"] == "Diverged"
        assert st["restarts"] == 2
        assert json.loads(env_of(job3)["TRAINGUARD_REMEDIATION"]) == {
            "id": "attempt-3",
            "lrScale": 0.5,
            "maxGradNorm": 0.5,
        }
        assert "Diverged" in event_reasons(cluster)

        # The training operator marks attempt 3 Succeeded: the job is done, and stays done.
        await patch(
            cluster,
            f"{PTJ_PATH}/tiny-lm-3/status",
            {
                "status": {
                    "conditions": [{"type": "Succeeded", "status": "True", "reason": "PyTorchJobSucceeded"}]
                }
            },
        )
        await eventually(lambda: status(cluster).get("phase") == "Succeeded", what="success")
        assert conditions(cluster)["Succeeded"]["status"] == "True"
        await eventually(lambda: "Succeeded" in event_reasons(cluster), what="the success event")
        await asyncio.sleep(1.5)
        assert status(cluster)["phase"] == "Succeeded"
        assert alive(cluster, PTJ, "tiny-lm-3") is not None
        assert creations(cluster, PTJ, "tiny-lm-4") == 0
        seen = await scrape(operator_env)
        assert value(seen, "trainguard_job_phase", phase="Succeeded") == 1
        assert value(seen, "trainguard_job_restarts_total") == 2


@pytest.mark.slow
@pytest.mark.asyncio
async def test_operator_restart_mid_recovery_restarts_the_gang_once(
    cluster: kmock.KubernetesEmulator, sidecars: Sidecars, operator_env: int
) -> None:
    # A backoff longer than kopf's shutdown (it lets in-flight handlers finish for up to 5 s), so the
    # handover surely happens while the restart is pending.
    manifest = gtj(recovery={"maxRestarts": 3, "backoffSeconds": [8]})
    async with operator():
        await post(cluster, GTJ_PATH, manifest)
        job1 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-1"))
        pods = await start_pods(cluster, job1, ["127.0.0.1", "127.0.0.2"])
        await terminate(cluster, pods[0], 137)
        await eventually(lambda: status(cluster).get("restarts") == 1, what="the restart decision")
        # Events are posted in the background: let this one out before the operator goes.
        await eventually(lambda: "GangRestart" in event_reasons(cluster), what="the restart event")
    # The operator is gone in the middle of the backoff; a new one takes over from the status alone.
    assert alive(cluster, PTJ, "tiny-lm-2") is None
    async with operator():
        await eventually(lambda: alive(cluster, PTJ, "tiny-lm-2"), what="attempt 2")
        await asyncio.sleep(1.5)
    st = status(cluster)
    assert (st["attempt"], st["restarts"]) == (2, 1)
    assert creations(cluster, PTJ, "tiny-lm-2") == 1
    assert creations(cluster, PTJ, "tiny-lm-3") == 0
    assert alive(cluster, PTJ, "tiny-lm-1") is None
    assert event_reasons(cluster).count("GangRestart") == 1


@pytest.mark.slow
@pytest.mark.asyncio
async def test_missing_crd_invalid_spec_and_refused_change_do_not_stop_the_operator(
    bare_cluster: kmock.KubernetesEmulator, operator_env: int
) -> None:
    cluster = bare_cluster
    invalid = gtj("broken")
    invalid["spec"]["checkpoint"] = {"mountPath": "relative/path"}
    async with operator():
        await post(cluster, GTJ_PATH, gtj())
        await post(cluster, GTJ_PATH, invalid)
        missing = await eventually(
            lambda: conditions(cluster).get("PyTorchJobCRDMissing"), what="CRD condition"
        )
        assert missing["status"] == "True"
        assert "kubeflow.org/v1 pytorchjobs" in missing["message"]
        assert conditions(cluster)["Ready"]["status"] == "False"
        spec_invalid = await eventually(lambda: conditions(cluster, "broken").get("SpecInvalid"))
        assert spec_invalid["status"] == "True"
        assert "spec.checkpoint.claimName" in spec_invalid["message"]
        assert "spec.checkpoint.mountPath" in spec_invalid["message"]
        await eventually(lambda: "SpecInvalid" in event_reasons(cluster, "broken"), what="SpecInvalid event")
        await eventually(lambda: "PyTorchJobCRDMissing" in event_reasons(cluster), what="CRD event")
        # Retried with a delay, not in a hot loop: ~1 s apart (crdRetrySeconds) for a few seconds.
        before = len(cluster)
        await asyncio.sleep(2.0)
        assert len(cluster) - before < 60

        # The Kubeflow training operator gets installed: the job starts, the broken one still does not.
        await install_crd(cluster, REFERENCE)
        await eventually(lambda: alive(cluster, PTJ, "tiny-lm-1"), what="the PyTorchJob once the CRD exists")
        await eventually(lambda: conditions(cluster)["PyTorchJobCRDMissing"]["status"] == "False")
        assert alive(cluster, PTJ, "broken-1") is None

        # A change of replicas is refused with a condition; a change of recovery is accepted.
        await patch(
            cluster,
            f"{GTJ_PATH}/tiny-lm",
            {"spec": {"replicas": 4, "recovery": {"maxRestarts": 9, "backoffSeconds": [1]}}},
        )
        refused = await eventually(
            lambda: conditions(cluster).get("SpecChangeRefused", {}).get("status") == "True"
        )
        assert refused
        message = conditions(cluster)["SpecChangeRefused"]["message"]
        assert "spec.replicas" in message
        assert "recovery" not in message
        await eventually(lambda: "SpecChangeRefused" in event_reasons(cluster), what="refusal event")
        await eventually(lambda: "SpecChangeAccepted" in event_reasons(cluster), what="acceptance event")
        accepted = [e for e in events(cluster) if e["reason"] == "SpecChangeAccepted"]
        assert "spec.recovery.maxRestarts" in accepted[0]["message"]
        assert "spec.replicas" not in accepted[0]["message"]


def test_the_operator_entry_point_refuses_bad_settings(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINGUARD_OPERATOR_POLL_CONCURRENCY", "zero")
    assert main(["--namespace", NS]) == 2
    assert "TRAINGUARD_OPERATOR_POLL_CONCURRENCY" in capsys.readouterr().err

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
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import kmock
import pytest
import pytest_asyncio
import yaml
from kopf.testing import KopfRunner
from prometheus_client.parser import text_string_to_metric_families
from test_operator_emulator import Emulator
from test_operator_render import REFERENCE, gtj_manifest
from trainguard_operator.__main__ import main
from trainguard_operator.metrics import OperatorMetrics
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


async def prepare_cluster(
    emulator: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> kmock.KubernetesEmulator:
    """kmock with the GuardedTrainingJob CRD (no PyTorchJob CRD), pods and events, and a kubeconfig
    (``$KUBECONFIG``) that points the operator at it."""
    # kopf watches CRDs to notice new resources (the PyTorchJob CRD arriving late, for one), and needs
    # namespaces discovered before it starts (it lists them only when not cluster-wide).
    emulator.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=VERBS
    )
    emulator.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs=VERBS)
    emulator.resources[PODS] = kmock.ResourceInfo(
        kind="Pod", namespaced=True, verbs=VERBS, subresources={"status"}
    )
    emulator.resources[EVENTS] = kmock.ResourceInfo(kind="Event", namespaced=True, verbs=VERBS)
    await install_crd(emulator, GTJ_CRD)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": str(emulator.url).rstrip("/")}}],
        "users": [{"name": "operator", "user": {"token": "test-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "operator", "namespace": NS}}],
        "current-context": "kmock",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("KUBECONFIG", str(path))
    return emulator


@pytest_asyncio.fixture
async def bare_cluster(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> kmock.KubernetesEmulator:
    """kmock with the GuardedTrainingJob CRD (no PyTorchJob CRD), pods and events, and a kubeconfig."""
    return await prepare_cluster(kmock, tmp_path, monkeypatch)


@pytest_asyncio.fixture
async def cluster(bare_cluster: kmock.KubernetesEmulator) -> kmock.KubernetesEmulator:
    """``bare_cluster`` with the Kubeflow PyTorchJob CRD installed."""
    await install_crd(bare_cluster, REFERENCE)
    return bare_cluster


class Sidecars:
    """Real sidecar servers, one per rank, on 127.0.0.R+1 and one shared port (as in a pod network)."""

    def __init__(self, root: Path, ranks: int, hang_timeout_seconds: float = 30) -> None:
        self.files = [root / f"rank-{r}" / "status.json" for r in range(ranks)]
        self.servers: list[SidecarServer] = []
        port = 0
        for rank, path in enumerate(self.files):
            path.parent.mkdir(parents=True)
            server = SidecarServer(
                path,
                host=f"127.0.0.{rank + 1}",
                port=port,
                hang_timeout_seconds=hang_timeout_seconds,
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

    def healthz(self, rank: int) -> int:
        """The HTTP status of rank ``rank``'s ``/healthz``, as the kubelet's liveness probe sees it."""
        url = f"http://127.0.0.{rank + 1}:{self.port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                code: int = response.status
        except urllib.error.HTTPError as exc:
            code = exc.code
        return code

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


class Workers:
    """The workers of one attempt as their status files show them: every rank steps every 0.1 s (from
    ``resumed`` on) until the test hangs it. Used as ``async with Workers(...) as workers``."""

    def __init__(self, sidecars: Sidecars, resumed: int = 0, ranks: int = 2) -> None:
        self.sidecars = sidecars
        self.resumed = resumed
        self.steps = dict.fromkeys(range(ranks), resumed)
        self.hung: set[int] = set()
        self.started = time.time()
        self._task: asyncio.Task[None] | None = None

    def hang(self, rank: int) -> None:
        """Rank ``rank`` stops stepping (its status file keeps its last step time)."""
        self.hung.add(rank)

    def write(self, rank: int) -> None:
        self.sidecars.write(rank, step=self.steps[rank], resumed_step=self.resumed, started_at=self.started)

    async def _run(self) -> None:
        while True:
            for rank in self.steps:
                if rank not in self.hung:
                    self.steps[rank] += 1
                    self.write(rank)
            await asyncio.sleep(0.1)

    async def __aenter__(self) -> Workers:
        for rank in self.steps:
            self.write(rank)
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


@pytest.fixture
def sidecars(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Sidecars]:
    """Two ranks' sidecars; an indirect parameter sets their hang timeout (default 30 s)."""
    found = Sidecars(tmp_path / "sidecars", 2, hang_timeout_seconds=float(getattr(request, "param", 30)))
    yield found
    found.stop()


def configure_operator(monkeypatch: pytest.MonkeyPatch, sidecar_port: int, **overrides: str) -> int:
    """The operator's settings for the tests (``overrides`` by field name); returns the metrics port."""
    port = free_port()
    values = {
        "METRICS_HOST": "127.0.0.1",
        "METRICS_PORT": str(port),
        "SIDECAR_PORT": str(sidecar_port),
        "SIDECAR_IMAGE": "registry.example/trainguard:test",
        "CRD_RETRY_SECONDS": "1",
        "API_RETRY_SECONDS": "0.5",
        "STALE_ATTEMPT_GRACE_SECONDS": "5",
        "POLL_TIMEOUT_SECONDS": "2",
    }
    for key, value in (values | {k.upper(): v for k, v in overrides.items()}).items():
        monkeypatch.setenv(f"TRAINGUARD_OPERATOR_{key}", value)
    return port


@pytest.fixture
def operator_env(monkeypatch: pytest.MonkeyPatch, sidecars: Sidecars) -> int:
    """The operator's settings for the tests; returns the metrics port."""
    return configure_operator(monkeypatch, sidecars.port)


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
    # No handler may have failed with an unexpected exception (kopf would log and retry it), nor given up.
    for sign in ("Traceback", "failed with an exception", "failed permanently"):
        assert sign not in runner.output, runner.output[-4000:]


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


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("sidecars", [2.0], indirect=True)  # the sidecars' hang timeout: 2 s
async def test_a_hang_on_one_rank_restarts_the_gang_once_after_the_backoff_and_is_measured(
    cluster: kmock.KubernetesEmulator, sidecars: Sidecars, operator_env: int
) -> None:
    async with operator():
        await post(cluster, GTJ_PATH, gtj(recovery={"maxRestarts": 3, "backoffSeconds": [2]}))
        job1 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-1"), what="attempt 1")
        async with Workers(sidecars) as workers:
            pods = await start_pods(cluster, job1, ["127.0.0.1", "127.0.0.2"])
            await eventually(
                lambda: status(cluster).get("phase") == "Running" and status(cluster).get("step", 0) >= 5,
                what="attempt 1 training",
            )
            assert sidecars.healthz(1) == 200
            # Rank 1 stops stepping: 2 s later its sidecar says it is not alive, in /status for the
            # operator and on /healthz for the kubelet's liveness probe.
            workers.hang(1)
            await eventually(lambda: status(cluster).get("restarts") == 1, what="the restart decision")
            decided = time.monotonic()
            assert sidecars.healthz(1) == 503
            # The kubelet's liveness probe fails too, and it kills the container (restartPolicy Never:
            # exit 137, the pod fails). The failure is already being handled: no second restart.
            await terminate(cluster, pods[1], 137)
            job2 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-2"), what="attempt 2")
            assert time.monotonic() - decided >= 1.5  # the 2 s backoff was waited (decision seen late)
        st = status(cluster)
        assert (st["attempt"], st["restarts"], st["handledAttempt"]) == (2, 1, 1)
        failure = st["lastFailure"]
        assert (failure["reason"], failure["rank"]) == ("Hung", 1)
        assert "rank 1 hung: no step for" in failure["message"]
        assert "hang timeout 2 s" in failure["message"]
        assert alive(cluster, PTJ, "tiny-lm-1") is None
        await eventually(
            lambda: {"Hung", "GangRestart"} <= set(event_reasons(cluster)), what="the hang's events"
        )
        hung = next(e for e in events(cluster) if e["reason"] == "Hung")
        assert hung["type"] == "Warning"
        assert "rank 1 hung" in hung["message"]

        # Attempt 2 starts from scratch (no checkpoint yet): attempt 1's work is lost to goodput.
        async with Workers(sidecars, resumed=0):
            await start_pods(cluster, job2, ["127.0.0.1", "127.0.0.2"])
            await eventually(lambda: "Recovered" in event_reasons(cluster), what="the recovery")
            await asyncio.sleep(1.5)  # attempt 2 keeps training; nothing else happens
            st = status(cluster)
            assert (st["attempt"], st["restarts"], st["phase"]) == (2, 1, "Running")
            assert creations(cluster, PTJ, "tiny-lm-2") == 1
            assert creations(cluster, PTJ, "tiny-lm-3") == 0
            assert event_reasons(cluster).count("GangRestart") == 1

            # The metrics over HTTP: one restart for a hang, one recovery timed (failure to the first
            # step of attempt 2: at least the backoff), the phase, and the goodput of the status.
            async def metrics_match_status() -> tuple[Samples, dict[str, Any]]:
                seen = await scrape(operator_env)
                return seen, status(cluster)

            seen, st = await metrics_match_status()
            for _ in range(40):
                if value(seen, "trainguard_job_goodput_ratio") == st.get("goodput"):
                    break
                await asyncio.sleep(0.05)
                seen, st = await metrics_match_status()
            assert value(seen, "trainguard_job_restarts_total") == 1
            assert value(seen, "trainguard_job_failures_total", kind="Hung") == 1
            assert value(seen, "trainguard_job_time_to_recover_seconds_count") == 1
            assert value(seen, "trainguard_job_time_to_recover_seconds_sum") >= 2
            assert value(seen, "trainguard_job_phase", phase="Running") == 1
            assert value(seen, "trainguard_job_phase", phase="Restarting") == 0
            goodput = value(seen, "trainguard_job_goodput_ratio")
            assert goodput == st["goodput"]
            # Only attempt 2's time is kept: at most its share of the wall time since attempt 1 started.
            history = st["stepHistory"]
            assert [(r["attempt"], r["resumedStep"]) for r in history] == [(1, 0), (2, 0)]
            started, second = (datetime.fromisoformat(st[k]) for k in ("jobStartedAt", "attemptStartedAt"))
            seen_at = datetime.fromisoformat(history[-1]["lastStepAt"])
            assert 0 < goodput <= (seen_at - second) / (seen_at - started) + 0.01


@pytest.mark.slow
@pytest.mark.asyncio
async def test_repeated_divergence_applies_remediation_each_time_and_fails_at_the_limit(
    cluster: kmock.KubernetesEmulator, sidecars: Sidecars, operator_env: int
) -> None:
    async with operator():
        await post(cluster, GTJ_PATH, gtj(recovery={"maxRestarts": 2, "backoffSeconds": [1]}))
        job1 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-1"), what="attempt 1")
        sidecars.write(0, step=40)
        sidecars.write(1, step=40)
        await start_pods(cluster, job1, ["127.0.0.1", "127.0.0.2"])
        await eventually(lambda: status(cluster).get("step") == 40, what="attempt 1 training")
        # Attempt 1: rank 0's guardian runs out of rollbacks and says so in its status.
        sidecars.write(0, step=41, phase=Phase.DIVERGED, message="5 rollbacks within 2000 steps")
        job2 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-2"), what="attempt 2")
        st = status(cluster)
        assert (st["restarts"], st["lastFailure"]["reason"], st["lastFailure"]["rank"]) == (1, "Diverged", 0)
        order2 = json.loads(env_of(job2)["TRAINGUARD_REMEDIATION"])
        assert order2 == {"id": "attempt-2", "lrScale": 0.5, "maxGradNorm": 0.5}

        # Attempt 2: rank 1's guardian exits with the diverged exit code.
        sidecars.write(0, step=30, resumed_step=20)
        sidecars.write(1, step=30, resumed_step=20)
        pods2 = await start_pods(cluster, job2, ["127.0.0.1", "127.0.0.2"])
        await eventually(lambda: status(cluster).get("phase") == "Running", what="attempt 2 running")
        await terminate(cluster, pods2[1], 200)
        job3 = await eventually(lambda: alive(cluster, PTJ, "tiny-lm-3"), what="attempt 3")
        st = status(cluster)
        assert (st["restarts"], st["lastFailure"]["reason"]) == (2, "Diverged")
        assert (st["lastFailure"]["rank"], st["lastFailure"]["exitCode"]) == (1, 200)
        # A new order with its own id: a guardian that applied attempt-2's applies this one on top.
        order3 = json.loads(env_of(job3)["TRAINGUARD_REMEDIATION"])
        assert order3 == {"id": "attempt-3", "lrScale": 0.5, "maxGradNorm": 0.5}

        # Attempt 3 diverges too: the two restarts allowed are used up, the job fails for good.
        sidecars.write(0, step=25, resumed_step=20)
        sidecars.write(1, step=25, resumed_step=20)
        await start_pods(cluster, job3, ["127.0.0.1", "127.0.0.2"])
        await eventually(
            lambda: status(cluster).get("phase") == "Running" and status(cluster)["attempt"] == 3,
            what="attempt 3 running",
        )
        sidecars.write(1, step=26, phase=Phase.DIVERGED, message="loss explosion pattern persists")
        await eventually(lambda: status(cluster).get("phase") == "Failed", what="the give-up")
        failed = conditions(cluster)["Failed"]
        assert (failed["status"], failed["reason"]) == ("True", "RestartsExhausted")
        assert "restarts exhausted (2 of 2)" in failed["message"]
        assert "rank 1 diverged: loss explosion pattern persists" in failed["message"]
        assert conditions(cluster)["Ready"]["status"] == "False"
        await eventually(lambda: "Failed" in event_reasons(cluster), what="the give-up event")
        gave_up = next(e for e in events(cluster) if e["reason"] == "Failed")
        assert gave_up["type"] == "Warning"
        assert "giving up: restarts exhausted" in gave_up["message"]
        await eventually(lambda: alive(cluster, PTJ, "tiny-lm-3") is None, what="attempt 3 stopped")
        await asyncio.sleep(1.5)
        assert status(cluster)["phase"] == "Failed"
        assert creations(cluster, PTJ, "tiny-lm-4") == 0
        assert event_reasons(cluster).count("Diverged") == 3
        assert event_reasons(cluster).count("GangRestart") == 2
        seen = await scrape(operator_env)
        assert value(seen, "trainguard_job_phase", phase="Failed") == 1
        assert value(seen, "trainguard_job_restarts_total") == 2
        assert value(seen, "trainguard_job_failures_total", kind="Diverged") == 3
        assert value(seen, "trainguard_job_goodput_ratio") == status(cluster)["goodput"]


def test_every_operator_metric_is_documented() -> None:
    readme = (ROOT / "examples/k8s/README.md").read_text()
    registry = OperatorMetrics().registry
    names = {family.name + ("_total" if family.type == "counter" else "") for family in registry.collect()}
    assert len(names) >= 15
    assert sorted(n for n in names if f"`{n}`" not in readme and f"`{n}{{" not in readme) == []


def test_the_operator_entry_point_refuses_bad_settings(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINGUARD_OPERATOR_POLL_CONCURRENCY", "zero")
    assert main(["--namespace", NS]) == 2
    assert "TRAINGUARD_OPERATOR_POLL_CONCURRENCY" in capsys.readouterr().err

"""The operator under test against the kmock API emulator: installing CRDs, real sidecar servers for the
ranks, workers that step in their status files, the operator as ``kopf run`` runs it, and ways to read
back objects, events and metrics. Shared by ``tests/integration`` and ``bench/operator_scale.py``."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from kopf.testing import KopfRunner
from prometheus_client.parser import text_string_to_metric_families
from trainguard_operator.render import (
    REPLICA_INDEX_LABEL,
    REPLICA_TYPE_LABEL,
)

from tests.support.kube_emulator import VERBS
from tests.support.manifests import gtj_manifest
from tests.support.paths import GTJ_CRD
from tests.support.ports import free_port
from trainer_sidecar.contract.status import Phase, WorkerStatus, write_status
from trainer_sidecar.sidecar.server import SidecarServer

NS = "default"
GTJ = "trainguard.dev/v1alpha1/guardedtrainingjobs"
PTJ = "kubeflow.org/v1/pytorchjobs"
PODS = "v1/pods"
EVENTS = "v1/events"
GTJ_PATH = f"/apis/trainguard.dev/v1alpha1/namespaces/{NS}/guardedtrainingjobs"
PTJ_PATH = f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs"
POD_PATH = f"/api/v1/namespaces/{NS}/pods"
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


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


class Sidecars:
    """Real sidecar servers, one per rank, on 127.0.0.R+1 and one shared port (as in a pod network)."""

    def __init__(
        self,
        root: Path,
        ranks: int,
        hang_timeout_seconds: float = 30,
        order_digests: Sequence[str] = (),
        signing_key: str = "",
        pytorchjob: str = "",
    ) -> None:
        """``order_digests``: each rank's sidecar takes restart orders whose token has that digest, signed
        with ``signing_key`` for its pod (rank R's: ``<pytorchjob>-worker-R``, as ``start_pods`` names
        it)."""
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
                order_token_sha256=order_digests[rank] if order_digests else "",
                order_signing_key=signing_key if order_digests else "",
                pod_name=f"{pytorchjob}-worker-{rank}" if order_digests else "",
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
            "world_size": len(self.files),
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


KUBELET = "trainguard.test/kubelet"


def graceful_pod_deletions(emulator: kmock.KubernetesEmulator) -> list[tuple[str, str | None]]:
    """(pod name, gracePeriodSeconds) of every DELETE of a pod the emulator served."""
    return [
        (str(request.name), request.params.get("gracePeriodSeconds"))
        for request in emulator
        if request.action == kmock.action.DELETE and request.name and "/pods/" in request.url.path
    ]


async def start_pods(emulator: kmock.KubernetesEmulator, job: dict[str, Any], ips: list[str]) -> list[str]:
    """Create the pods of a PyTorchJob as the training operator would, Running at the given IPs."""
    names = []
    name = job["metadata"]["name"]
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    for rank, ip in enumerate(ips):
        pod_name = f"{name}-worker-{rank}"
        labels = {
            **template["metadata"]["labels"],
            REPLICA_TYPE_LABEL: "worker",
            REPLICA_INDEX_LABEL: str(rank),
            "training.kubeflow.org/job-name": name,
        }
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            # A pod on a node goes only once its kubelet stopped it: the finalizer stands for that, so a
            # deletion marks it (deletionTimestamp) and the pod stays, as on a real cluster.
            "metadata": {"name": pod_name, "namespace": NS, "labels": labels, "finalizers": [KUBELET]},
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


async def terminate(
    emulator: kmock.KubernetesEmulator, pod: str, exit_code: int, message: str | None = None
) -> None:
    """The kubelet reports the pytorch container terminated (restartPolicy Never: the pod fails), with
    its termination ``message`` when given."""
    state: dict[str, Any] = {"terminated": {"exitCode": exit_code, "reason": "Error"}}
    if message is not None:
        state["terminated"]["message"] = message
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
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", "") for e in worker["env"]}

"""How the operator scales with the number of jobs: N GuardedTrainingJobs created at once, the real
operator running as its own process (``python -m trainguard_operator``, kopf and the kubernetes client, as
in a cluster), against one of two API servers:

* by default kmock's Kubernetes API emulator, served by this script on loopback (200 jobs);
* with ``--real`` a real kube-apiserver v1.33 with etcd (500 jobs), started by ``tests.support.controlplane``
  from the binaries ``bash scripts/control-plane.sh`` builds, or an already-running cluster given by
  ``--kubeconfig``. The GuardedTrainingJob CRD (``crds/``) and Kubeflow's PyTorchJob CRD (which
  ``bash scripts/control-plane.sh`` fetches, ``tests.support.kubeflow``) are applied server-side first,
  and the jobs go to a fresh namespace that is deleted afterwards (when the cluster outlives the run).

Everything else is one code path (``measure``):

* ``latency_p50_s``, ``latency_p99_s``, ``latency_max_s``: per job, from the moment the API server answered
  the GuardedTrainingJob's creation to the moment its PyTorchJob was created: the emulator notes when the
  creation request arrived; against a real API server a watch on the PyTorchJobs (opened before the first
  job) notes when the ADDED event arrived, which adds the watch's delivery (milliseconds) to the same
  interval. The N jobs are created back to back (``--concurrency`` POSTs in flight), so this is the
  latency of a burst: queueing included, as after ``kubectl apply`` of many jobs or an operator taking over
  a full cluster.
* ``reconcile_mean_s`` and ``reconcile_p50_s`` / ``reconcile_p99_s``: the operator's own
  ``trainguard_operator_reconcile_duration_seconds`` histogram (one reconcile step: the API reads,
  the sidecar polls, the writes), the quantiles interpolated within its buckets as Prometheus'
  ``histogram_quantile`` does.
* ``steady_requests_per_s``: API requests per second at rest, over a probe period (each job's daemon
  looks every ``probePeriodSeconds``, 10 s here; no pods exist, so no sidecar is polled). The window
  starts ``--settle-seconds`` after kopf has recorded every creation as handled (its annotation, the
  creation's last write). The emulator counts every request it serves; a real API server's
  ``apiserver_request_total`` is read for the operator's resources (GuardedTrainingJobs, PyTorchJobs,
  pods, events), watches excluded.
* ``failure_seen_p50_s``, ``failure_seen_p99_s``, ``failure_seen_max_s``: after the steady window,
  ``--failures`` jobs (20) get two running pods each (created and written by this script, as the training
  operator and a kubelet would); once the operator shows them Running, rank 1 of each fails (exit 137),
  and each figure runs from the API server's answer to that status write to the operator's deletion of
  the failed attempt's PyTorchJob (the restart it decides: the emulator notes the DELETE, a real API
  server's PyTorchJob watch the deletion), which comes after the restart is written to the job's status.
* ``failure_in_burst_p50_s``, ``failure_in_burst_max_s``: with ``--failures-in-burst K``, the same for K
  further jobs whose pods run before the burst and fail one after the other while it is being created
  (the i-th once i/(K+1) of the burst was posted): a failure to act on behind a queue of admissions.
* ``operator_peak_rss_mb``: the operator process's peak resident set size (``VmHWM`` in
  ``/proc/<pid>/status`` of the child process and of any child of its own, read just before it is
  stopped); the API server and this script run in other processes and are not counted.

Also in the JSON line: ``backend`` (which API server), ``burst_requests_per_job`` (the operator's and this
script's API requests from the first creation until every PyTorchJob existed, per job; the real API server
also prints them by verb and resource), ``all_handled_seconds`` (until kopf recorded every creation as
handled: the last follow-up write), ``warning_events`` (Warning events in the namespace: a clean run has
none), the CPU seconds of the operator and (when this script started it) of the API server and etcd
during the burst, and ``goals``/``goals_met``: a p99 latency under 1 s, a peak RSS under 200 MB, at most
0.01 API requests per second per job at rest, and a pod failure acted on within 1 s (p99).
``--rate R`` creates R jobs per second instead of back to back.

No pods run: without a kubelet none are created, and on a cluster that has a node the jobs' pods select a
node label nobody has, so every job stays at its first attempt: this measures admission, rendering and
the steady watch, not recovery. The cluster must not run another trainguard operator.

``python -m bench.operator_scale`` (200 jobs; ``--jobs N``; ``--quick``: 20 jobs, a smoke test);
``python -m bench.operator_scale --real`` (500 jobs; ``--kubeconfig PATH`` for a running cluster).
Human-readable lines, then one JSON line, last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support import controlplane
from tests.support.kube_emulator import Emulator as BaseEmulator
from tests.support.kubeflow import pytorchjob_crd
from tests.support.paths import GTJ_CRD, REPO_ROOT
from tests.support.ports import free_port

NS = "default"
GTJ_API = "/apis/trainguard.dev/v1alpha1"
GTJ_PLURAL = "guardedtrainingjobs"
PTJ_API = "/apis/kubeflow.org/v1"
PTJ_PLURAL = "pytorchjobs"
PTJ_RESOURCE = "kubeflow.org/v1/pytorchjobs"
JOB_LABEL = "trainguard.dev/job"
VERBS = {"list", "watch", "get", "create", "update", "patch", "delete"}
RECONCILE_HISTOGRAM = "trainguard_operator_reconcile_duration_seconds"
#: The resources the operator reads and writes, as ``apiserver_request_total`` labels them (group, resource).
OPERATOR_RESOURCES = {
    ("trainguard.dev", GTJ_PLURAL),
    ("kubeflow.org", PTJ_PLURAL),
    ("", "pods"),
    ("", "events"),
    ("events.k8s.io", "events"),
}
#: The issue's goals (for ``--real``; reported in both modes).
GOAL_LATENCY_P99_S = 1.0
GOAL_PEAK_RSS_MB = 200.0
#: Issue 22's goals: API requests per second per idle job at rest, and a pod failure acted on within.
GOAL_STEADY_PER_JOB = 0.01
GOAL_FAILURE_SEEN_S = 1.0
FIELD_MANAGER = "trainguard-bench"
#: The jobs' ``probePeriodSeconds``: each job's daemon looks at it this often.
PROBE_PERIOD_SECONDS = 10
#: What kopf writes (under the operator's prefix) once a job's creation is handled: its last write.
HANDLED_ANNOTATION = "trainguard.dev/last-handled-configuration"


class Emulator(BaseEmulator):
    """The operator tests' API server emulator (``tests/support/kube_emulator.py``: uids, creation
    timestamps, resourceVersions, label selectors, a flat cost per request) that also records when each
    job's PyTorchJob creation arrived, and counts the requests it serves."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.served = 0
        self.pytorchjob_created: dict[str, float] = {}
        self.pytorchjob_deleted: dict[str, float] = {}

    async def _handle(self, request: kmock.Request) -> Any:
        self.served += 1
        data = request.data
        if (
            request.action == kmock.action.CREATE
            and isinstance(data, dict)
            and request.url.path.endswith("/pytorchjobs")
        ):
            job = (data.get("metadata", {}).get("labels") or {}).get(JOB_LABEL)
            if job is not None:
                self.pytorchjob_created.setdefault(str(job), time.monotonic())
        if request.action == kmock.action.DELETE and "/pytorchjobs/" in request.url.path and request.name:
            # The attempt's PyTorchJob is named <job>-<attempt>.
            self.pytorchjob_deleted.setdefault(str(request.name).rsplit("-", 1)[0], time.monotonic())
        return await super()._handle(request)


def job_manifest(name: str, namespace: str = NS) -> dict[str, Any]:
    """A two-replica GuardedTrainingJob with the health settings of examples/k8s/job.yaml. Its pods
    select a node label no node has: on a cluster that does run the training operator and a node, they
    would stay Pending rather than start 2 x N trainings."""
    return {
        "apiVersion": "trainguard.dev/v1alpha1",
        "kind": "GuardedTrainingJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": 2,
            "template": {
                "spec": {
                    "nodeSelector": {"trainguard.dev/benchmark": "no-such-node"},
                    "containers": [
                        {
                            "name": "pytorch",
                            "image": "registry.example/tiny-lm:1",
                            "command": ["python", "-m", "examples.tiny_lm.train"],
                            "resources": {"limits": {"nvidia.com/gpu": 1}},
                        }
                    ],
                }
            },
            "checkpoint": {"claimName": f"{name}-ckpt", "mountPath": "/ckpt"},
            "health": {
                "hangTimeoutSeconds": 300,
                "startupGraceSeconds": 600,
                "probePeriodSeconds": PROBE_PERIOD_SECONDS,
            },
        },
    }


def pod_manifest(job: str, rank: int, namespace: str) -> dict[str, Any]:
    """Rank ``rank``'s pod of attempt 1 of ``job``, labelled as the training operator labels it (no IP:
    no sidecar to poll)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job}-1-worker-{rank}",
            "namespace": namespace,
            "labels": {
                JOB_LABEL: job,
                "trainguard.dev/attempt": "1",
                "trainguard.dev/ranks": "worker-index",
                "training.kubeflow.org/replica-type": "worker",
                "training.kubeflow.org/replica-index": str(rank),
                "training.kubeflow.org/job-name": f"{job}-1",
            },
        },
        "spec": {
            "nodeSelector": {"trainguard.dev/benchmark": "no-such-node"},
            "containers": [{"name": "pytorch", "image": "registry.example/tiny-lm:1"}],
        },
    }


def worker_status(state: dict[str, Any], phase: str) -> dict[str, Any]:
    """A pod status with the ``pytorch`` container in ``state``, as a kubelet writes it."""
    return {
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


async def start_failure_jobs(cluster: Cluster, jobs: Sequence[str], timeout: float) -> None:
    """Give each of ``jobs`` two running pods (as the training operator and a kubelet would), and wait
    until the operator shows every one Running."""
    pending = asyncio.Semaphore(8)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    async def start(job: str) -> None:
        async with pending:
            for rank in (0, 1):
                manifest = pod_manifest(job, rank, cluster.namespace)
                await cluster.create_pod(manifest)
                running = worker_status({"running": {"startedAt": now}}, "Running")
                await cluster.patch_pod_status(manifest["metadata"]["name"], running)

    await asyncio.gather(*(start(job) for job in jobs))
    deadline = time.monotonic() + timeout
    while True:
        stored = {j["metadata"]["name"]: j for j in await cluster.list_jobs()}
        if all((stored.get(job, {}).get("status") or {}).get("phase") == "Running" for job in jobs):
            break
        if time.monotonic() > deadline:
            raise TimeoutError("the operator did not show every job with pods as Running")
        await asyncio.sleep(0.5)
    await asyncio.sleep(1.0)


async def fail_one(cluster: Cluster, job: str, timeout: float) -> float:
    """Fail rank 1 of ``job`` (exit 137); seconds from the API server's answer to that status write to
    the operator acting on it (the deletion of the failed attempt's PyTorchJob seen)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ended = {"terminated": {"exitCode": 137, "reason": "Error", "startedAt": now, "finishedAt": now}}
    pod = pod_manifest(job, 1, cluster.namespace)["metadata"]["name"]
    await cluster.patch_pod_status(pod, worker_status(ended, "Failed"))
    failed = time.monotonic()
    await wait_for(lambda: job in cluster.pytorchjob_deleted, timeout, f"{job}'s failure acted on")
    return max(0.0, cluster.pytorchjob_deleted[job] - failed)


async def measure_failures(cluster: Cluster, jobs: Sequence[str], timeout: float) -> list[float]:
    """``fail_one`` for each of ``jobs`` once they run (``start_failure_jobs``), one job after the other:
    the reaction to one failure, not a queue of them."""
    await start_failure_jobs(cluster, jobs, timeout)
    seen = []
    for job in jobs:
        seen.append(await fail_one(cluster, job, timeout))
        await asyncio.sleep(0.2)
    return seen


def _reasons(events: Sequence[Mapping[str, Any]], failed: Collection[str]) -> list[str]:
    """The reasons of ``events``, but of those about a job in ``failed``."""
    return [
        str(e.get("reason", "")) for e in events if (e.get("involvedObject") or {}).get("name") not in failed
    ]


# --- the two API servers ----------------------------------------------------------------------------


class Cluster:
    """What ``measure`` needs of an API server: a kubeconfig for the operator, the namespace the jobs go
    to, a way to create a job, when each job's PyTorchJob appeared, and a request counter."""

    #: Which API server this is, for the JSON line ("kmock emulator", "kube-apiserver v1.33.13").
    backend: str
    namespace: str
    kubeconfig: Path
    #: The operator's scope flags.
    operator_scope: tuple[str, ...]
    #: Job name -> ``time.monotonic()`` when its PyTorchJob was seen created.
    pytorchjob_created: dict[str, float]
    #: Job name -> ``time.monotonic()`` when the deletion of one of its PyTorchJobs was first seen (the
    #: operator acting on a failure: its restart deletes the failed attempt's PyTorchJob).
    pytorchjob_deleted: dict[str, float]

    async def create_pod(self, manifest: Mapping[str, Any]) -> None:
        """POST one pod (as the training operator would)."""
        raise NotImplementedError

    async def patch_pod_status(self, name: str, status: Mapping[str, Any]) -> None:
        """Merge-patch a pod's status (as its kubelet would); returns once the API server answered."""
        raise NotImplementedError

    async def create_job(self, manifest: Mapping[str, Any]) -> None:
        """POST one GuardedTrainingJob; returns once the API server answered (raises on an error)."""
        raise NotImplementedError

    async def request_counts(self) -> dict[str, float]:
        """Counters of the API requests served so far, by kind where known (only differences are used)."""
        raise NotImplementedError

    async def watch_counts(self) -> dict[str, float]:
        """The watches open on the API server now, by resource of the operator's (empty: not known)."""
        return {}

    async def warning_events(self, failed: Collection[str] = ()) -> list[str]:
        """The reasons of the Warning events in the namespace (a healthy run has none), but those about
        the jobs in ``failed``, whose pods this script failed."""
        raise NotImplementedError

    async def list_jobs(self) -> list[dict[str, Any]]:
        """The GuardedTrainingJobs in the namespace, as stored."""
        raise NotImplementedError

    def server_pids(self) -> list[int]:
        """The API server's own processes, when this script started them (for their CPU time)."""
        return []


class EmulatorCluster(Cluster):
    """kmock's emulator in this process; the operator runs cluster-wide (kmock cannot list namespaces)."""

    def __init__(self, emulator: Emulator, kubeconfig: Path) -> None:
        self.emulator = emulator
        self.backend = f"kmock {getattr(kmock, '__version__', '?')} emulator"
        self.namespace = NS
        self.kubeconfig = kubeconfig
        self.operator_scope = ("--all-namespaces",)
        self.pytorchjob_created = emulator.pytorchjob_created
        self.pytorchjob_deleted = emulator.pytorchjob_deleted

    async def create_job(self, manifest: Mapping[str, Any]) -> None:
        await post(self.emulator, f"{GTJ_API}/namespaces/{self.namespace}/{GTJ_PLURAL}", dict(manifest))

    async def create_pod(self, manifest: Mapping[str, Any]) -> None:
        await post(self.emulator, f"/api/v1/namespaces/{self.namespace}/pods", dict(manifest))

    async def patch_pod_status(self, name: str, status: Mapping[str, Any]) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods/{name}/status"
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self.emulator.patch(path, json={"status": dict(status)}, headers=headers) as response:
            if response.status >= 300:
                raise RuntimeError(f"PATCH {path}: {response.status} {await response.text()}")

    async def request_counts(self) -> dict[str, float]:
        return {"requests": float(self.emulator.served)}

    async def warning_events(self, failed: Collection[str] = ()) -> list[str]:
        async with self.emulator.get(f"/api/v1/namespaces/{self.namespace}/events") as response:
            listed = await response.json()
        warnings = [e for e in listed.get("items") or [] if e.get("type") == "Warning"]
        return _reasons(warnings, failed)

    async def list_jobs(self) -> list[dict[str, Any]]:
        async with self.emulator.get(f"{GTJ_API}/namespaces/{self.namespace}/{GTJ_PLURAL}") as response:
            listed = await response.json()
        return list(listed.get("items") or [])


async def prepare(emulator: Emulator, directory: Path) -> Path:
    """Register the resources the operator and kopf use, install the GuardedTrainingJob CRD, and write a
    kubeconfig for the emulator; returns its path."""
    emulator.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=VERBS
    )
    emulator.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs=VERBS)
    emulator.resources["v1/pods"] = kmock.ResourceInfo(
        kind="Pod", namespaced=True, verbs=VERBS, subresources={"status"}
    )
    emulator.resources["v1/events"] = kmock.ResourceInfo(kind="Event", namespaced=True, verbs=VERBS)
    # The training operator's resource (its CRD object is not needed: the operator lists it by path).
    emulator.resources[PTJ_RESOURCE] = kmock.ResourceInfo(
        kind="PyTorchJob", namespaced=True, verbs=VERBS, subresources={"status"}
    )
    crd = yaml.safe_load(GTJ_CRD.read_text())
    spec = crd["spec"]
    for version in spec["versions"]:
        emulator.resources[f"{spec['group']}/{version['name']}/{spec['names']['plural']}"] = (
            kmock.ResourceInfo(
                kind=spec["names"]["kind"],
                singular=spec["names"].get("singular"),
                namespaced=True,
                shortnames=spec["names"].get("shortNames", []),
                verbs=VERBS,
                subresources=set(version.get("subresources", {})),
            )
        )
    await post(emulator, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": str(emulator.url).rstrip("/")}}],
        "users": [{"name": "operator", "user": {"token": "bench"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "operator", "namespace": NS}}],
        "current-context": "kmock",
    }
    path = directory / "kubeconfig"
    path.write_text(json.dumps(config))
    return path


async def post(emulator: Emulator, path: str, body: dict[str, Any]) -> None:
    """POST to the emulator; raises on an error status."""
    async with emulator.post(path, json=body) as response:
        if response.status >= 300:
            raise RuntimeError(f"POST {path}: {response.status} {await response.text()}")


@contextlib.asynccontextmanager
async def emulator_cluster(directory: Path) -> AsyncIterator[EmulatorCluster]:
    """The emulator, served on loopback with the CRD installed, for as long as the context lasts."""
    async with Emulator() as emulator, kmock.Server(emulator):
        yield EmulatorCluster(emulator, await prepare(emulator, directory))


class ApiError(RuntimeError):
    """An unexpected answer from the real API server."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        super().__init__(f"{method} {path}: {status} {body[:500]}")
        self.status = status


class RealCluster(Cluster):
    """A real kube-apiserver reached with a kubeconfig's server and credentials (aiohttp, async).

    The jobs go to a namespace of their own; the operator serves only that namespace (``--namespace``),
    so a shared cluster's other GuardedTrainingJobs are left alone. A watch on the namespace's
    PyTorchJobs, opened before the first job, notes when each appears.
    """

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=str(kubeconfig), client_configuration=configuration
        )
        self.server = str(configuration.host).rstrip("/")
        context: ssl.SSLContext | bool
        if configuration.verify_ssl:
            context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
        else:
            context = False
        if configuration.cert_file and isinstance(context, ssl.SSLContext):
            context.load_cert_chain(configuration.cert_file, configuration.key_file)
        headers = {}
        token = configuration.get_api_key_with_prefix(
            "authorization"
        ) or configuration.get_api_key_with_prefix("BearerToken")
        if token:
            headers["Authorization"] = token if " " in token else f"Bearer {token}"
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=context), headers=headers, raise_for_status=False
        )
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.operator_scope = ("--namespace", namespace)
        self.pytorchjob_created = {}
        self.pytorchjob_deleted = {}
        self.backend = "kube-apiserver"
        self.pids: list[int] = []
        self._watch: asyncio.Task[None] | None = None
        self._listed = asyncio.Event()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        ok: Sequence[int] = (),
    ) -> Any:
        """One API call; the answer as JSON (or text); raises ApiError unless 2xx or in ``ok``."""
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else {}
        async with self.session.request(
            method, self.server + path, data=data, params=params, headers=headers
        ) as response:
            text = await response.text()
            if response.status >= 300 and response.status not in ok:
                raise ApiError(method, path, response.status, text)
            if response.content_type == "application/json":
                return json.loads(text)
            return text

    async def create_job(self, manifest: Mapping[str, Any]) -> None:
        await self.request("POST", f"{GTJ_API}/namespaces/{self.namespace}/{GTJ_PLURAL}", dict(manifest))

    async def create_pod(self, manifest: Mapping[str, Any]) -> None:
        # A control plane without a controller manager makes no default service account; pods need one.
        await self.request(
            "POST",
            f"/api/v1/namespaces/{self.namespace}/serviceaccounts",
            {"metadata": {"name": "default"}},
            ok=(409,),
        )
        await self.request("POST", f"/api/v1/namespaces/{self.namespace}/pods", dict(manifest))

    async def patch_pod_status(self, name: str, status: Mapping[str, Any]) -> None:
        await self.request(
            "PATCH",
            f"/api/v1/namespaces/{self.namespace}/pods/{name}/status",
            {"status": dict(status)},
            content_type="application/merge-patch+json",
        )

    async def request_counts(self) -> dict[str, float]:
        """The API server's ``apiserver_request_total`` over the operator's resources, watches excluded, by
        verb and resource (``"PATCH guardedtrainingjobs/status"``)."""
        text = await self.request("GET", "/metrics")
        lines = "\n".join(
            line for line in str(text).splitlines() if line.startswith("apiserver_request_total{")
        )
        counts: dict[str, float] = {}
        for family in text_string_to_metric_families(lines):
            for sample in family.samples:
                labels = sample.labels
                group, resource = labels.get("group", ""), labels.get("resource", "")
                if labels.get("verb") in ("WATCH", "CONNECT") or (group, resource) not in OPERATOR_RESOURCES:
                    continue
                sub = labels.get("subresource", "")
                key = f"{labels.get('verb')} {resource}{'/' + sub if sub else ''}"
                counts[key] = counts.get(key, 0.0) + sample.value
        return counts

    async def watch_counts(self) -> dict[str, float]:
        """``apiserver_longrunning_requests`` of verb WATCH over the operator's resources, by resource
        (every client's: the operator's own, kopf's, and the API server's controllers')."""
        text = await self.request("GET", "/metrics")
        lines = "\n".join(
            line for line in str(text).splitlines() if line.startswith("apiserver_longrunning_requests{")
        )
        counts: dict[str, float] = {}
        for family in text_string_to_metric_families(lines):
            for sample in family.samples:
                labels = sample.labels
                group, resource = labels.get("group", ""), labels.get("resource", "")
                if labels.get("verb") == "WATCH" and (group, resource) in OPERATOR_RESOURCES:
                    counts[resource] = counts.get(resource, 0.0) + sample.value
        return counts

    async def warning_events(self, failed: Collection[str] = ()) -> list[str]:
        listed = await self.request(
            "GET", f"/api/v1/namespaces/{self.namespace}/events", params={"fieldSelector": "type=Warning"}
        )
        return _reasons(listed.get("items") or [], failed)

    async def list_jobs(self) -> list[dict[str, Any]]:
        listed = await self.request("GET", f"{GTJ_API}/namespaces/{self.namespace}/{GTJ_PLURAL}")
        return list(listed.get("items") or [])

    def server_pids(self) -> list[int]:
        return list(self.pids)

    async def apply(self, document: Mapping[str, Any]) -> None:
        """Server-side apply of a cluster-scoped CRD, as ``kubectl apply --server-side`` (idempotent)."""
        name = document["metadata"]["name"]
        await self.request(
            "PATCH",
            f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}",
            dict(document),
            params={"fieldManager": FIELD_MANAGER},
            content_type="application/apply-patch+yaml",  # JSON is YAML
        )

    async def wait_served(self, document: Mapping[str, Any], timeout: float = 60) -> None:
        """Wait for a CRD's Established condition, then for its resource to answer a list."""
        name = document["metadata"]["name"]
        spec = document["spec"]
        version = next(v["name"] for v in spec["versions"] if v.get("served", True))
        path = f"/apis/{spec['group']}/{version}/namespaces/{self.namespace}/{spec['names']['plural']}"
        deadline = time.monotonic() + timeout
        while True:
            crd = await self.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            conditions = {c["type"]: c["status"] for c in (crd.get("status") or {}).get("conditions") or []}
            if conditions.get("Established") == "True":
                listed = await self.request("GET", path, params={"limit": "1"}, ok=(404,))
                if isinstance(listed, dict) and listed.get("kind", "").endswith("List"):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {name} not served after {timeout:g} s: {conditions}")
            await asyncio.sleep(0.2)

    def _saw(self, item: Mapping[str, Any]) -> None:
        job = ((item.get("metadata") or {}).get("labels") or {}).get(JOB_LABEL)
        if job is not None:
            self.pytorchjob_created.setdefault(str(job), time.monotonic())

    async def _watch_pytorchjobs(self) -> None:
        """List, then watch from the list's resourceVersion (re-listing after a 410), noting ADDED times."""
        path = f"{PTJ_API}/namespaces/{self.namespace}/{PTJ_PLURAL}"
        version = ""
        while True:
            if not version:
                listed = await self.request("GET", path, params={"labelSelector": JOB_LABEL})
                for item in listed.get("items") or []:
                    self._saw(item)
                version = listed["metadata"]["resourceVersion"]
                self._listed.set()
            params = {
                "watch": "1",
                "labelSelector": JOB_LABEL,
                "resourceVersion": version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": "600",
            }
            timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
            try:
                async with self.session.get(self.server + path, params=params, timeout=timeout) as response:
                    if response.status != 200:
                        raise ApiError("WATCH", path, response.status, await response.text())
                    async for line in response.content:
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        item = event.get("object") or {}
                        if event.get("type") == "ERROR":  # 410 Gone: the version is too old; list again
                            version = ""
                            break
                        version = (item.get("metadata") or {}).get("resourceVersion") or version
                        if event.get("type") == "ADDED":
                            self._saw(item)
                        meta = item.get("metadata") or {}
                        if event.get("type") == "DELETED" or meta.get("deletionTimestamp"):
                            job = (meta.get("labels") or {}).get(JOB_LABEL)
                            if job is not None:
                                self.pytorchjob_deleted.setdefault(str(job), time.monotonic())
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
                await asyncio.sleep(0.1)  # the stream broke: watch again from the last version seen

    async def start_watch(self) -> None:
        """Start the PyTorchJob watch; returns after its first list, from whose resourceVersion it watches
        (so every PyTorchJob created after this returns is seen)."""
        self._watch = asyncio.create_task(self._watch_pytorchjobs())
        listed = asyncio.create_task(self._listed.wait())
        await asyncio.wait({self._watch, listed}, return_when=asyncio.FIRST_COMPLETED)
        listed.cancel()
        if self._watch.done():
            self._watch.result()  # raises what stopped it
            raise RuntimeError("the PyTorchJob watch ended before it started")

    async def close(self) -> None:
        """Stop the watch and close the HTTP session."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch
        await self.session.close()

    async def delete_namespace(self) -> None:
        """Delete the namespace and what the run left in it. Meant for after the operator stopped: the
        finalizers are taken off the jobs (the operator's) and the PyTorchJobs (the garbage collector's
        ``foregroundDeletion``, left by a restart's deletion) first, since nobody would remove them, and
        the jobs, PyTorchJobs and events are deleted explicitly (a control plane without a controller
        manager collects nothing)."""
        jobs = f"{GTJ_API}/namespaces/{self.namespace}/{GTJ_PLURAL}"
        pytorchjobs = f"{PTJ_API}/namespaces/{self.namespace}/{PTJ_PLURAL}"
        pending = asyncio.Semaphore(8)

        async def release(collection: str, name: str) -> None:
            async with pending:
                await self.request(
                    "PATCH",
                    f"{collection}/{name}",
                    {"metadata": {"finalizers": None}},
                    content_type="application/merge-patch+json",
                    ok=(404,),
                )

        for collection in (jobs, pytorchjobs):
            listed = await self.request("GET", collection, ok=(404,))
            held = [
                item["metadata"]["name"]
                for item in (listed.get("items") or [] if isinstance(listed, dict) else [])
                if item["metadata"].get("finalizers")
            ]
            await asyncio.gather(*(release(collection, n) for n in held))
        for collection in (jobs, pytorchjobs):
            await self.request("DELETE", collection, ok=(404,))
        await self.request("DELETE", f"/api/v1/namespaces/{self.namespace}/events", ok=(404,))
        await self.request("DELETE", f"/api/v1/namespaces/{self.namespace}", ok=(404, 409))


@contextlib.asynccontextmanager
async def real_cluster(
    directory: Path, *, kubeconfig: Path | None, bin_dir: Path | None
) -> AsyncIterator[RealCluster]:
    """A real API server with both CRDs applied and a fresh namespace, for as long as the context lasts.

    Without ``kubeconfig`` an etcd + kube-apiserver pair is started from ``bin_dir``
    (``tests.support.controlplane``), and stopped at the end; with it, that cluster is used, and the namespace
    and everything the run created in it are deleted at the end.
    """
    plane: controlplane.ControlPlane | None = None
    if kubeconfig is None:
        assert bin_dir is not None
        started = time.monotonic()
        plane = await asyncio.to_thread(controlplane.start, bin_dir, directory / "control-plane")
        kubeconfig = plane.kubeconfig
        print(f"control plane up in {time.monotonic() - started:.1f} s: {plane.server}")
    cluster = RealCluster(kubeconfig, f"trainguard-scale-{secrets.token_hex(3)}")
    namespace_created = False
    try:
        version = await cluster.request("GET", "/version")
        cluster.backend = f"kube-apiserver {version.get('gitVersion', '?')}"
        if plane is not None:
            cluster.pids = [plane.apiserver.pid, plane.etcd.pid]
        crds = [yaml.safe_load(path.read_text()) for path in (GTJ_CRD, pytorchjob_crd())]
        for crd in crds:
            await cluster.apply(crd)
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": cluster.namespace}}
        await cluster.request("POST", "/api/v1/namespaces", body)
        namespace_created = True
        for crd in crds:
            await cluster.wait_served(crd)
        await cluster.start_watch()
        yield cluster
    finally:
        try:
            if namespace_created and plane is None:
                await cluster.delete_namespace()
        finally:
            await cluster.close()
            if plane is not None:
                await asyncio.to_thread(plane.stop)
                # The store goes; the logs stay beside the operator's.
                shutil.rmtree(plane.state_dir / "etcd", ignore_errors=True)


# --- the operator process -------------------------------------------------------------------------


def start_operator(
    kubeconfig: Path, scope: Sequence[str], metrics_port: int, log: Path
) -> subprocess.Popen[bytes]:
    """The operator as its own process (``scope``: ``--all-namespaces`` or ``--namespace NS``), standalone,
    its metrics on loopback, its liveness endpoint off."""
    env = os.environ | {
        "KUBECONFIG": str(kubeconfig),
        "TRAINGUARD_OPERATOR_METRICS_HOST": "127.0.0.1",
        "TRAINGUARD_OPERATOR_METRICS_PORT": str(metrics_port),
        "TRAINGUARD_OPERATOR_CRD_RETRY_SECONDS": "10",
    }
    with log.open("wb") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "trainguard_operator", *scope, "--liveness", ""],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
        )


def stop_operator(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (kopf stops its handlers and daemons), then SIGKILL after 20 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process used so far (``/proc/<pid>/stat``, Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_kib(pid: int) -> dict[str, int]:
    """VmHWM (peak RSS) and VmRSS of a process, in KiB, from /proc (Linux)."""
    found: dict[str, int] = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                found[key] = int(rest.split()[0])
    return found


def descendants(pid: int) -> list[int]:
    """The live child processes of ``pid``, recursively (``/proc/<pid>/task/*/children``, Linux)."""
    found: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            for child in children.read_text().split():
                found += [int(child), *descendants(int(child))]
    return found


def process_tree_memory_kib(pid: int) -> tuple[dict[str, int], int]:
    """VmHWM and VmRSS of ``pid`` plus those of its descendants (a sum of peaks: an upper bound of the
    tree's peak when there are any), and how many descendants there were."""
    total = memory_kib(pid)
    children = descendants(pid)
    for child in children:
        for key, value in memory_kib(child).items():
            total[key] = total.get(key, 0) + value
    return total, len(children)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The operator's metrics, sample by sample."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def histogram(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> dict[str, Any]:
    """count, sum, and the cumulative buckets (upper bound, count) of an unlabelled histogram."""
    buckets = sorted(
        (float(dict(labels)["le"]), value)
        for (key, labels), value in samples.items()
        if key == f"{name}_bucket"
    )
    return {
        "count": samples.get((f"{name}_count", ()), 0.0),
        "sum": samples.get((f"{name}_sum", ()), 0.0),
        "buckets": buckets,
    }


def bucket_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: linear interpolation within the bucket holding the quantile."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # beyond the last finite bucket: its bound is all that is known
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between closest ranks."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def wait_for(
    check: Any, timeout: float, what: Any, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Poll ``check`` every 20 ms; TimeoutError (``what()`` if callable) after ``timeout`` seconds, or
    RuntimeError at once if ``process`` exited."""
    deadline = time.monotonic() + timeout
    while not check():
        describe = what() if callable(what) else what
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the operator exited ({process.returncode}) while waiting for {describe}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {describe}")
        await asyncio.sleep(0.02)


def difference(now: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    """Counter increments between two ``request_counts``."""
    return {key: value - before.get(key, 0.0) for key, value in now.items()}


def breakdown(counts: Mapping[str, float], per: float) -> str:
    """`` (GET x 1.00, ...)``: the counts divided by ``per``, largest first; empty for a single counter."""
    if len(counts) < 2:
        return ""
    shown = sorted(((v, k) for k, v in counts.items() if v > 0), reverse=True)
    return " (" + ", ".join(f"{key} {value / per:.2f}" for value, key in shown) + ")"


# --- the measurement --------------------------------------------------------------------------------


async def measure(cluster: Cluster, args: argparse.Namespace, jobs: int, directory: Path) -> dict[str, Any]:
    """Run the operator against ``cluster``: a warm-up job, then ``jobs`` jobs in a burst, then a steady
    window; return the figures (the JSON line's)."""
    log = directory / "operator.log"
    metrics_port = free_port()
    load_before = os.getloadavg()[0]
    server_pids = cluster.server_pids()
    server_rss_before = sum(memory_kib(pid).get("VmRSS", 0) for pid in server_pids) / 1024
    process = start_operator(cluster.kubeconfig, cluster.operator_scope, metrics_port, log)
    try:
        # Warm-up: one job through, so kopf's watch and the operator's clients are up.
        started = time.monotonic()
        await cluster.create_job(job_manifest("warm-up", cluster.namespace))
        await wait_for(lambda: "warm-up" in cluster.pytorchjob_created, 60, "the warm-up job", process)
        print(f"operator pid {process.pid} up; warm-up job admitted in {time.monotonic() - started:.2f} s")

        names = [f"job-{i:04d}" for i in range(jobs)]
        created: dict[str, float] = {}
        pending = asyncio.Semaphore(args.concurrency)
        # Jobs whose pods fail while the burst runs: created, and running, before it.
        in_burst = [f"burst-fail-{i:02d}" for i in range(args.failures_in_burst)]
        for name in in_burst:
            await cluster.create_job(job_manifest(name, cluster.namespace))
        if in_burst:
            await start_failure_jobs(cluster, in_burst, args.timeout)

        async def fail_during_burst() -> list[float]:
            # The i-th failure once i/(n+1) of the burst's jobs were posted: spread over the burst.
            seen = []
            for index, name in enumerate(in_burst, start=1):
                share = jobs * index / (len(in_burst) + 1)
                while len(created) < share:
                    await asyncio.sleep(0.05)
                seen.append(await fail_one(cluster, name, args.timeout))
            return seen

        async def create(index: int, name: str) -> None:
            if args.rate:  # the index-th job is due index / rate seconds after the first
                await asyncio.sleep(max(0.0, burst + index / args.rate - time.monotonic()))
            async with pending:
                await cluster.create_job(job_manifest(name, cluster.namespace))
                created[name] = time.monotonic()

        operator_cpu_mark = cpu_seconds(process.pid)
        server_cpu_mark = sum(cpu_seconds(pid) for pid in server_pids)
        requests_mark = await cluster.request_counts()
        burst = time.monotonic()
        failing = asyncio.create_task(fail_during_burst())
        await asyncio.gather(*(create(i, n) for i, n in enumerate(names)))
        posted = time.monotonic() - burst
        pace = f"{args.rate:g}/s" if args.rate else f"back to back, {args.concurrency} in flight"
        print(f"created {jobs} GuardedTrainingJobs in {posted:.2f} s ({pace})")

        def missing() -> str:
            done = sum(n in cluster.pytorchjob_created for n in names)
            return f"the PyTorchJobs of {jobs} jobs ({done} seen)"

        await wait_for(
            lambda: all(n in cluster.pytorchjob_created for n in names), args.timeout, missing, process
        )
        failures_in_burst = await failing
        burst_cpu = cpu_seconds(process.pid) - operator_cpu_mark
        burst_requests = {
            key: value - requests_mark.get(key, 0.0)
            for key, value in (await cluster.request_counts()).items()
        }
        server_burst_cpu = sum(cpu_seconds(pid) for pid in server_pids) - server_cpu_mark
        all_ready = max(cluster.pytorchjob_created[n] for n in names) - burst
        latencies = [cluster.pytorchjob_created[n] - created[n] for n in names]
        print(f"every job's PyTorchJob exists {all_ready:.2f} s after the first creation")

        busy = cpu_seconds(process.pid)
        # The creations' follow-up writes (status, kopf's annotations) and events trail the PyTorchJobs:
        # wait until kopf recorded every creation as handled, then a little more, before the steady window.
        while True:
            stored = await cluster.list_jobs()
            handled = sum(HANDLED_ANNOTATION in (j["metadata"].get("annotations") or {}) for j in stored)
            if handled >= jobs + 1 + len(in_burst):
                break
            if time.monotonic() - burst > args.timeout:
                raise TimeoutError(
                    f"only {handled} of {jobs + 1 + len(in_burst)} creations handled after {args.timeout:g} s"
                )
            await asyncio.sleep(1.0)
        all_handled = time.monotonic() - burst
        print(f"every creation handled (kopf's annotation written) {all_handled:.2f} s after the first")
        await asyncio.sleep(args.settle_seconds)
        mark, cpu_mark = await cluster.request_counts(), cpu_seconds(process.pid)
        await asyncio.sleep(args.steady_seconds)
        steady_requests = difference(await cluster.request_counts(), mark)
        steady = sum(steady_requests.values()) / args.steady_seconds
        steady_cpu = (cpu_seconds(process.pid) - cpu_mark) / args.steady_seconds
        watches = await cluster.watch_counts()
        server_rss_steady = sum(memory_kib(pid).get("VmRSS", 0) for pid in server_pids) / 1024
        # Before the failures, whose events are warnings; those of the failures in the burst are expected.
        warnings = await cluster.warning_events(failed=in_burst)
        failures = (
            await measure_failures(cluster, names[: args.failures], args.timeout) if args.failures else []
        )
        samples = await asyncio.to_thread(scrape, metrics_port)
        memory, children = process_tree_memory_kib(process.pid)
    finally:
        stop_operator(process)
    load_after = os.getloadavg()[0]

    reconcile = histogram(samples, RECONCILE_HISTOGRAM)
    p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
    reconcile_mean = reconcile["sum"] / reconcile["count"] if reconcile["count"] else None
    reconcile_p50 = bucket_quantile(0.5, reconcile["buckets"])
    reconcile_p99 = bucket_quantile(0.99, reconcile["buckets"])
    peak = memory.get("VmHWM", 0) / 1024
    print(
        f"creation -> PyTorchJob: p50 {p50:.3f} s, p99 {p99:.3f} s, max {max(latencies):.3f} s, "
        f"mean {statistics.fmean(latencies):.3f} s"
    )
    if reconcile_mean is not None:
        print(
            f"reconcile steps: {int(reconcile['count'])}, mean {reconcile_mean * 1000:.1f} ms, "
            f"p50 ~{(reconcile_p50 or 0) * 1000:.0f} ms, p99 ~{(reconcile_p99 or 0) * 1000:.0f} ms "
            "(from the histogram's buckets)"
        )
    print(
        f"operator CPU: {busy:.1f} s until every PyTorchJob existed (start-up included; the burst "
        f"{burst_cpu:.1f} s); steady state {steady:.1f} API requests/s and {steady_cpu * 100:.0f}% of a core "
        f"for {jobs + 1} jobs (probe period 10 s)"
    )
    per_job = sum(burst_requests.values()) / jobs
    print(
        "API requests from the first creation until every PyTorchJob existed: "
        f"{per_job:.1f} per job{breakdown(burst_requests, jobs)}"
    )
    per_period = steady * 10 / (jobs + 1)
    print(
        f"API requests in the steady window: {steady:.1f}/s, {per_period:.2f} per job per probe period"
        + breakdown(steady_requests, args.steady_seconds)
    )
    if failures:
        print(
            f"pod failure -> acted on (the failed attempt's PyTorchJob deleted) for {len(failures)} jobs: "
            f"p50 {percentile(failures, 0.5):.3f} s, p99 {percentile(failures, 0.99):.3f} s, "
            f"max {max(failures):.3f} s (probe period {PROBE_PERIOD_SECONDS} s)"
        )
    if failures_in_burst:
        print(
            f"pod failure during the burst -> acted on, for {len(failures_in_burst)} jobs: "
            f"p50 {percentile(failures_in_burst, 0.5):.3f} s, max {max(failures_in_burst):.3f} s"
        )
    if warnings:
        print(f"warning: {len(warnings)} Warning events: {sorted(set(warnings))}")
    if server_pids:
        print(f"API server + etcd CPU during the burst: {server_burst_cpu:.1f} s")
        print(
            f"API server + etcd RSS: {server_rss_before:.0f} MB before the jobs, {server_rss_steady:.0f} MB "
            f"in the steady window (the {jobs + 1} jobs, their PyTorchJobs and pods, stored and cached)"
        )
    if watches:
        listed = ", ".join(f"{resource} {count:g}" for resource, count in sorted(watches.items()))
        print(f"watches open on the API server over the operator's resources (every client's): {listed}")
    print(f"operator process: peak RSS {peak:.1f} MB (VmHWM), RSS {memory.get('VmRSS', 0) / 1024:.1f} MB now")
    load = max(load_before, load_after)
    if load > (os.cpu_count() or 1):
        print(f"warning: load average {load:.2f} on {os.cpu_count()} cores: latencies read high")
    print(f"operator log: {log}")
    rss_source = "VmHWM of the operator child process" + (
        f" plus its {children} children's" if children else " (it has no children)"
    )
    return {
        "backend": cluster.backend,
        "namespace": cluster.namespace,
        "jobs": jobs,
        "reconciled_jobs": len(latencies),
        "warning_events": len(warnings),
        "latency_p50_s": round(p50, 4),
        "latency_p99_s": round(p99, 4),
        "latency_max_s": round(max(latencies), 4),
        "pace": pace,
        "create_seconds": round(posted, 3),
        "all_ready_seconds": round(all_ready, 3),
        "all_handled_seconds": round(all_handled, 1),
        "reconcile_steps": int(reconcile["count"]),
        "reconcile_mean_s": None if reconcile_mean is None else round(reconcile_mean, 4),
        "reconcile_p50_s": None if reconcile_p50 is None else round(reconcile_p50, 4),
        "reconcile_p99_s": None if reconcile_p99 is None else round(reconcile_p99, 4),
        "burst_requests_per_job": round(per_job, 2),
        "steady_requests_per_s": round(steady, 2),
        "steady_cpu_cores": round(steady_cpu, 3),
        "failure_jobs": len(failures),
        "failure_seen_p50_s": round(percentile(failures, 0.5), 4) if failures else None,
        "failure_seen_p99_s": round(percentile(failures, 0.99), 4) if failures else None,
        "failure_seen_max_s": round(max(failures), 4) if failures else None,
        "failures_in_burst": len(failures_in_burst),
        "failure_in_burst_p50_s": round(percentile(failures_in_burst, 0.5), 4) if failures_in_burst else None,
        "failure_in_burst_max_s": round(max(failures_in_burst), 4) if failures_in_burst else None,
        "operator_cpu_seconds_to_ready": round(busy, 2),
        "operator_cpu_seconds_burst": round(burst_cpu, 2),
        "server_cpu_seconds_burst": round(server_burst_cpu, 2) if server_pids else None,
        "server_rss_mb_before": round(server_rss_before, 1) if server_pids else None,
        "server_rss_mb_steady": round(server_rss_steady, 1) if server_pids else None,
        "watches": watches,
        "operator_peak_rss_mb": round(peak, 1),
        "rss_source": rss_source,
        "goals": {
            "latency_p99_s": GOAL_LATENCY_P99_S,
            "operator_peak_rss_mb": GOAL_PEAK_RSS_MB,
            "steady_requests_per_job_s": GOAL_STEADY_PER_JOB,
            "failure_seen_p99_s": GOAL_FAILURE_SEEN_S,
        },
        "goals_met": {
            "steady_requests_per_job_s": steady / (jobs + 1) <= GOAL_STEADY_PER_JOB,
            "failure_seen_p99_s": bool(failures) and percentile(failures, 0.99) < GOAL_FAILURE_SEEN_S,
            "latency_p99_s": p99 < GOAL_LATENCY_P99_S,
            "operator_peak_rss_mb": peak < GOAL_PEAK_RSS_MB,
        },
        "load_average": round(load, 2),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark against the emulator, or with ``args.real`` against a real API server."""
    jobs = 20 if args.quick else args.jobs
    if args.quick:  # the steady window stays a probe period: a shorter one may see no probe at all
        args.settle_seconds = min(args.settle_seconds, 0.5)
    directory = Path(tempfile.mkdtemp(prefix="trainguard-operator-scale-"))
    cluster: contextlib.AbstractAsyncContextManager[Cluster] = (
        real_cluster(directory, kubeconfig=args.kubeconfig, bin_dir=args.bin_dir)
        if args.real
        else emulator_cluster(directory)
    )
    async with cluster as api:
        return await measure(api, args, jobs, directory)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--real",
        action="store_true",
        help="against a real kube-apiserver (started from scripts/control-plane.sh's binaries, or "
        "--kubeconfig's) instead of kmock's emulator",
    )
    parser.add_argument(
        "--kubeconfig", type=Path, default=None, help="with --real: use this running cluster (implies --real)"
    )
    parser.add_argument(
        "--bin-dir",
        type=Path,
        default=None,
        help="with --real: where etcd and kube-apiserver are (default $TRAINGUARD_CONTROL_PLANE_BIN, else "
        "the directory bash scripts/control-plane.sh links them into)",
    )
    parser.add_argument(
        "--jobs", type=int, default=None, help="GuardedTrainingJobs to create (default 200; 500 with --real)"
    )
    parser.add_argument("--quick", action="store_true", help="20 jobs, 0.5 s settle: a smoke test")
    parser.add_argument("--concurrency", type=int, default=8, help="creations in flight (default 8)")
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="create this many jobs per second instead of back to back (at most --concurrency in flight)",
    )
    parser.add_argument(
        "--settle-seconds",
        type=float,
        default=5.0,
        help="wait before the steady window, once every creation is handled (default 5)",
    )
    parser.add_argument(
        "--steady-seconds", type=float, default=10.0, help="steady-state window (default 10: a probe period)"
    )
    parser.add_argument(
        "--failures",
        type=int,
        default=20,
        help="after the steady window, fail a pod of this many jobs and time the operator's reaction "
        "(default 20; 0: skip)",
    )
    parser.add_argument(
        "--failures-in-burst",
        type=int,
        default=0,
        help="fail a pod of this many further jobs (running before the burst) one after the other while "
        "the burst is being created, and time the operator's reaction (default 0)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="give up after this long (default 600)")
    args = parser.parse_args(argv)
    args.real = args.real or args.kubeconfig is not None
    if args.jobs is None:
        args.jobs = 500 if args.real else 200
    if args.jobs < 1 or args.concurrency < 1 or args.steady_seconds <= 0 or args.settle_seconds < 0:
        parser.error("--jobs and --concurrency must be at least 1, --steady-seconds positive")
    if args.rate is not None and args.rate <= 0:
        parser.error("--rate must be positive")
    if args.real and args.kubeconfig is None:
        configured = os.environ.get("TRAINGUARD_CONTROL_PLANE_BIN")
        if args.bin_dir is None:
            args.bin_dir = Path(configured) if configured else controlplane.bin_dir_from_script()
        missing = controlplane.missing_binaries(args.bin_dir)
        if missing:
            parser.exit(
                2,
                f"{parser.prog}: --real needs the control plane binaries; missing in {args.bin_dir}: "
                f"{', '.join(missing)}.\nBuild them with:  bash scripts/control-plane.sh   (from the "
                "repository root; cold: several minutes)\nor pass --kubeconfig PATH of a running cluster.\n",
            )
    elif args.kubeconfig is not None and not args.kubeconfig.is_file():
        parser.error(f"--kubeconfig {args.kubeconfig}: no such file")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print human-readable lines and finally one JSON line; return that JSON."""
    result = asyncio.run(run(parse_args(argv)))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

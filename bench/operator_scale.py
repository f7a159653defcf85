"""How the operator scales with the number of jobs: N GuardedTrainingJobs created at once against kmock's
Kubernetes API emulator, the real operator running as its own process (``python -m trainguard_operator``,
kopf and the kubernetes client, as in a cluster).

* ``latency_p50_s``, ``latency_p99_s``, ``latency_max_s``: per job, from the moment the emulator answered
  the GuardedTrainingJob's creation to the moment the request creating its PyTorchJob arrived. The N
  jobs are created back to back (``--concurrency`` POSTs in flight), so this is the latency of a burst:
  queueing included, as after ``kubectl apply`` of many jobs or an operator taking over a full cluster.
* ``reconcile_mean_s`` and ``reconcile_p50_s`` / ``reconcile_p99_s``: the operator's own
  ``trainguard_operator_reconcile_duration_seconds`` histogram (one reconcile step: the API reads,
  the sidecar polls, the writes), the quantiles interpolated within its buckets as Prometheus'
  ``histogram_quantile`` does.
* ``steady_requests_per_s``: API requests per second once every job's PyTorchJob exists (each job's
  daemon looks every ``probePeriodSeconds``, 10 s here; no pods exist, so no sidecar is polled).
* ``operator_peak_rss_mb``: the operator process's peak resident set size (``VmHWM`` in
  ``/proc/<pid>/status`` of the child process, read just before it is stopped); the emulator and this
  script run in another process and are not counted.

The jobs' pods are never created (no kubelet), so every job stays at its first attempt: this measures
admission, rendering and the steady watch, not recovery. Against a real API server (``--real
KUBECONFIG``) it is not implemented yet: that comes with the control-plane work (issue 4).

``python bench/operator_scale.py`` (200 jobs; ``--jobs N``; ``--quick``: 20 jobs and shorter windows).
Human-readable lines, then one JSON line, last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kmock
import yaml
from prometheus_client.parser import text_string_to_metric_families

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO / "tests"))
from test_operator_emulator import Emulator as BaseEmulator  # noqa: E402

GTJ_CRD = _REPO / "crds" / "guardedtrainingjobs.trainguard.dev.yaml"
NS = "default"
GTJ_PATH = f"/apis/trainguard.dev/v1alpha1/namespaces/{NS}/guardedtrainingjobs"
PTJ_RESOURCE = "kubeflow.org/v1/pytorchjobs"
JOB_LABEL = "trainguard.dev/job"
VERBS = {"list", "watch", "get", "create", "update", "patch", "delete"}
RECONCILE_HISTOGRAM = "trainguard_operator_reconcile_duration_seconds"


class Emulator(BaseEmulator):
    """The operator tests' API server emulator (``tests/test_operator_emulator.py``: uids, creation
    timestamps, resourceVersions, label selectors, a flat cost per request) that also records when each
    job's PyTorchJob creation arrived, and counts the requests it serves."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.served = 0
        self.pytorchjob_created: dict[str, float] = {}

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
        return await super()._handle(request)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def job_manifest(name: str) -> dict[str, Any]:
    """A two-replica GuardedTrainingJob with the health settings of examples/k8s/job.yaml."""
    return {
        "apiVersion": "trainguard.dev/v1alpha1",
        "kind": "GuardedTrainingJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": 2,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "pytorch",
                            "image": "registry.example/tiny-lm:1",
                            "command": ["python", "-m", "examples.tiny_lm.train"],
                            "resources": {"limits": {"nvidia.com/gpu": 1}},
                        }
                    ]
                }
            },
            "checkpoint": {"claimName": f"{name}-ckpt", "mountPath": "/ckpt"},
            "health": {"hangTimeoutSeconds": 300, "startupGraceSeconds": 600, "probePeriodSeconds": 10},
        },
    }


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
    async with emulator.post(path, json=body) as response:
        if response.status >= 300:
            raise RuntimeError(f"POST {path}: {response.status} {await response.text()}")


def start_operator(kubeconfig: Path, metrics_port: int, log: Path) -> subprocess.Popen[bytes]:
    """The operator as its own process, cluster-wide (kmock cannot list namespaces), standalone."""
    env = os.environ | {
        "KUBECONFIG": str(kubeconfig),
        "TRAINGUARD_OPERATOR_METRICS_HOST": "127.0.0.1",
        "TRAINGUARD_OPERATOR_METRICS_PORT": str(metrics_port),
        "TRAINGUARD_OPERATOR_CRD_RETRY_SECONDS": "10",
    }
    with log.open("wb") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "trainguard_operator", "--all-namespaces", "--liveness", ""],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=_REPO,
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


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
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


async def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.02)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    jobs = 20 if args.quick else args.jobs
    if args.quick:
        args.settle_seconds, args.steady_seconds = (
            min(args.settle_seconds, 1.0),
            min(args.steady_seconds, 3.0),
        )
    directory = Path(tempfile.mkdtemp(prefix="trainguard-operator-scale-"))
    log = directory / "operator.log"
    metrics_port = free_port()
    load_before = os.getloadavg()[0]
    async with Emulator() as emulator, kmock.Server(emulator):
        kubeconfig = await prepare(emulator, directory)
        process = start_operator(kubeconfig, metrics_port, log)
        try:
            # Warm-up: one job through, so kopf's watch and the operator's clients are up.
            started = time.monotonic()
            await post(emulator, GTJ_PATH, job_manifest("warm-up"))
            await wait_for(lambda: "warm-up" in emulator.pytorchjob_created, 60, "the warm-up job")
            print(
                f"operator pid {process.pid} up; warm-up job admitted in {time.monotonic() - started:.2f} s"
            )

            names = [f"job-{i:04d}" for i in range(jobs)]
            created: dict[str, float] = {}
            pending = asyncio.Semaphore(args.concurrency)

            async def create(name: str) -> None:
                async with pending:
                    await post(emulator, GTJ_PATH, job_manifest(name))
                    created[name] = time.monotonic()

            burst = time.monotonic()
            await asyncio.gather(*(create(n) for n in names))
            posted = time.monotonic() - burst
            print(f"created {jobs} GuardedTrainingJobs in {posted:.2f} s ({args.concurrency} in flight)")
            await wait_for(
                lambda: all(n in emulator.pytorchjob_created for n in names),
                args.timeout,
                f"the PyTorchJobs of {jobs} jobs",
            )
            all_ready = max(emulator.pytorchjob_created[n] for n in names) - burst
            latencies = [emulator.pytorchjob_created[n] - created[n] for n in names]
            print(f"every job's PyTorchJob exists {all_ready:.2f} s after the first creation")

            busy = cpu_seconds(process.pid)
            await asyncio.sleep(args.settle_seconds)  # the creations' follow-up writes and events
            mark, cpu_mark = emulator.served, cpu_seconds(process.pid)
            await asyncio.sleep(args.steady_seconds)
            steady = (emulator.served - mark) / args.steady_seconds
            steady_cpu = (cpu_seconds(process.pid) - cpu_mark) / args.steady_seconds
            samples = await asyncio.to_thread(scrape, metrics_port)
            memory = memory_kib(process.pid)
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
        f"operator CPU: {busy:.1f} s until every PyTorchJob existed (start-up included); steady state "
        f"{steady:.1f} API requests/s and {steady_cpu * 100:.0f}% of a core for {jobs + 1} jobs "
        "(probe period 10 s)"
    )
    print(f"operator process: peak RSS {peak:.1f} MB (VmHWM), RSS {memory.get('VmRSS', 0) / 1024:.1f} MB now")
    load = max(load_before, load_after)
    if load > (os.cpu_count() or 1):
        print(f"warning: load average {load:.2f} on {os.cpu_count()} cores: latencies read high")
    print(f"operator log: {log}")
    return {
        "jobs": jobs,
        "latency_p50_s": round(p50, 4),
        "latency_p99_s": round(p99, 4),
        "latency_max_s": round(max(latencies), 4),
        "create_seconds": round(posted, 3),
        "all_ready_seconds": round(all_ready, 3),
        "reconcile_steps": int(reconcile["count"]),
        "reconcile_mean_s": None if reconcile_mean is None else round(reconcile_mean, 4),
        "reconcile_p50_s": None if reconcile_p50 is None else round(reconcile_p50, 4),
        "reconcile_p99_s": None if reconcile_p99 is None else round(reconcile_p99, 4),
        "steady_requests_per_s": round(steady, 2),
        "steady_cpu_cores": round(steady_cpu, 3),
        "operator_cpu_seconds_to_ready": round(busy, 2),
        "operator_peak_rss_mb": round(peak, 1),
        "rss_source": "VmHWM of the operator child process",
        "load_average": round(load, 2),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=200, help="GuardedTrainingJobs to create (default 200)")
    parser.add_argument(
        "--quick", action="store_true", help="20 jobs, 1 s settle, 3 s steady window: a smoke test"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="creations in flight (default 8)")
    parser.add_argument(
        "--settle-seconds", type=float, default=5.0, help="wait before the steady window (default 5)"
    )
    parser.add_argument(
        "--steady-seconds", type=float, default=10.0, help="steady-state window (default 10: a probe period)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="give up after this long (default 600)")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.concurrency < 1 or args.steady_seconds <= 0 or args.settle_seconds < 0:
        parser.error("--jobs and --concurrency must be at least 1, --steady-seconds positive")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print human-readable lines and finally one JSON line; return that JSON."""
    result = asyncio.run(run(parse_args(argv)))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""Time to recover on the real test node: a hung rank and a crashed rank, each a few times.

Starts the whole test cluster (``tests.support.cluster``: the control plane, a real node, the trainguard
operator installed by its Helm chart), then runs the example job of the end-to-end tests
(``tests.support.jobs``: 60 steps, two ranks, a checkpoint every 10 steps) once per run with one fault at
step 35: ``hang@35:1`` (rank 1 stops stepping; a 4 s hang timeout, polled every second) or
``crash@35:0`` (rank 0 exits non-zero). The gang restarts after a 2 s backoff, as in the tests.

For each run it prints, from the job's status and the attempt's pods (the operator's clock for steps, to
its 1 s poll period; the API server's for pods, to the second):

- ``recover_s``: the last step before the fault to the first step of the next attempt, in all, as the
  operator saw them: at its polls of the sidecars, every probe period (1 s for the hang, 2 s for the
  crash), so either end can read late by up to that;
- ``recover_log_s``: the same on the kubelet's clock, rank 0's last step line of the first attempt to
  its first of the second (the example logs every step here), read while the pods run;
- ``detect_s``: that last step to the failure the operator recorded (the hang timeout, for a hang);
- ``restart_s``: the failure to the next attempt's pods being created (old gang deleted, backoff);
  ``lastFailure.time`` is whole seconds (cut, as Kubernetes' timestamps are), so the split between these
  two moves by up to a second: a crash's ``detect_s`` can read slightly negative;
- ``pod_start_s``: the kubelet's share, those pods' creation to their training container running
  (scheduling, sandbox and network, the init containers, the sidecar), split by the latest pod's
  conditions as read while the attempt runs (a finished pod's sandbox condition turns False):
  ``to_scheduled_s`` (PodScheduled), ``to_sandbox_s`` (PodReadyToStartContainers: the sandbox and its
  network), ``to_initialized_s`` (Initialized: the native sidecar started; no init container waits for a
  Master, the PyTorchJob has Workers only), ``to_running_s`` (the training container running);
- ``first_step_s``: the container running to its first step (Python, torch, the rendezvous, the
  checkpoint), split by rank 0's log lines (the kubelet's timestamps; absent when a line is missing):
  ``to_corpus_s`` the container running to the script's first line (Python, torch, the rendezvous, the
  corpus), ``to_model_s`` to its model (built and wrapped in DDP), ``to_resumed_s`` to its held-out loss
  (the Guardian: the checkpoint agreed on and restored; the script's validation), ``to_step_s`` from
  there to the first step (the operator's clock).

Each kind runs in both ways the operator restarts a gang, side by side in one run (``--ways``): ``new``,
a new PyTorchJob (the chart installed with ``restartInPlace.maxPerPyTorchJob=0``), with the phases
above; and ``in-place``, the chart's default, where the same pods run attempt 2 (each launcher ordered
through its sidecar) and the phases are ``recover_s``, ``recover_log_s``, ``detect_s`` and
``restart_s`` (the failure to the first step of attempt 2, backoff included: no pod starts).

Run as root, after ``bash scripts/setup.sh``::

    python -m bench.recovery_real [--runs 3] [--kinds hang,crash] [--ways in-place,new]

The last line is one JSON object with every run and the medians.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support import cluster as test_cluster
from tests.support import controlplane, node
from tests.support.jobs import FAST_HANG_DETECTION, JOB, JobNamespace, condition, example, timestamp

FAULTS = {"hang": "hang@35:1", "crash": "crash@35:0"}
BACKOFF_SECONDS = 2
#: How the operator restarts the gang, and the chart values that make it so.
WAYS: dict[str, list[str]] = {
    "in-place": [],
    "new": ["--set=restartInPlace.maxPerPyTorchJob=0"],
}


def measure(job: dict[str, Any], pods: list[dict[str, Any]], logs: LogTail) -> dict[str, float]:
    """The phases of the one recovery of a finished job (see the module's docstring); ``pods`` are the
    second attempt's, as read while their training containers ran, and ``logs`` its pods' logs."""
    status = job["status"]
    history = {h["attempt"]: h for h in status["stepHistory"]}
    last_step = timestamp(history[1]["lastStepAt"])
    failed = timestamp(status["lastFailure"]["time"])
    first_step = timestamp(history[2]["firstStepAt"])
    created = min(timestamp(p["metadata"]["creationTimestamp"]) for p in pods)
    running = []
    for pod in pods:
        (container,) = [s for s in pod["status"]["containerStatuses"] if s["name"] == "pytorch"]
        state = container["state"].get("running") or container["state"].get("terminated") or {}
        running.append(timestamp(state["startedAt"]))
    phases = {
        "recover_s": first_step - last_step,
        "detect_s": failed - last_step,
        "restart_s": created - failed,
        "pod_start_s": max(running) - created,
        "first_step_s": first_step - max(running),
    }
    # pod_start_s split by the pods' conditions (the latest pod's, to the second), where all are there.
    mark = created
    for phase, kind in POD_MARKS:
        times = [pod_condition_time(pod, kind) for pod in pods]
        if any(t is None for t in times):
            break
        latest = max(t for t in times if t is not None)
        phases[phase], mark = latest - mark, latest
    else:
        phases["to_running_s"] = max(running) - mark
    # The container's start (to the second) is rank 0's, not the latest: its log is the one read.
    rank0 = next(p for p in pods if p["metadata"]["name"] == f"{JOB}-2-worker-0")
    (container,) = [s for s in rank0["status"]["containerStatuses"] if s["name"] == "pytorch"]
    state = container["state"].get("running") or container["state"].get("terminated") or {}
    mark = timestamp(state["startedAt"])
    old, new = logs.lines(f"{JOB}-1-worker-0"), logs.lines(f"{JOB}-2-worker-0")
    last_logged = [at for at, text in old if STEP_LINE.search(text)]
    first_logged = next((at for at, text in new if STEP_LINE.search(text)), None)
    if last_logged and first_logged is not None:
        phases["recover_log_s"] = first_logged - last_logged[-1]
    for phase, text in LOG_MARKS:
        at = next((at for at, line in new if text in line), None)
        if at is None:
            return phases
        phases[phase], mark = at - mark, at
    if first_logged is not None:
        phases["to_step_s"] = first_logged - mark
    return phases


#: The pod conditions that split ``pod_start_s``: the phase that ends at each (the kubelet's times).
POD_MARKS = (
    ("to_scheduled_s", "PodScheduled"),
    ("to_sandbox_s", "PodReadyToStartContainers"),
    ("to_initialized_s", "Initialized"),
)


def pod_condition_time(pod: dict[str, Any], kind: str) -> float | None:
    """When ``pod``'s condition ``kind`` last became True (None: it is not True, or not there)."""
    for found in pod.get("status", {}).get("conditions") or []:
        if found.get("type") == kind and found.get("status") == "True" and found.get("lastTransitionTime"):
            return timestamp(found["lastTransitionTime"])
    return None


#: The lines of the example's rank 0 that split ``first_step_s``: the phase that ends at each.
LOG_MARKS = (
    ("to_corpus_s", "tiny_lm: corpus:"),
    ("to_model_s", "tiny_lm: model:"),
    ("to_resumed_s", "held-out loss"),
)


#: A step line of the example's rank 0 (``--log-every 1``: every step it applied).
STEP_LINE = re.compile(r"\bstep \d+ loss ")


class LogTail:
    """The ``pytorch`` containers' logs of one namespace's pods on the node, read while they are written: a
    pod's log goes with the pod, and the first attempt's pods are deleted before the job ends."""

    def __init__(self, logs_dir: Path, namespace: str, period: float = 0.2) -> None:
        self._logs_dir, self._namespace, self._period = logs_dir, namespace, period
        self._read: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        self._lines: dict[str, list[tuple[float, str]]] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-tail", daemon=True)
        self._thread.start()

    def lines(self, pod: str) -> list[tuple[float, str]]:
        """``pod``'s lines so far, each with the kubelet's timestamp (Unix seconds)."""
        self._poll()
        with self._lock:
            return list(self._lines.get(pod, []))

    def stop(self) -> None:
        """Stop reading (what was read stays)."""
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self._period):
            self._poll()

    def _poll(self) -> None:
        with self._lock:
            for log in sorted(self._logs_dir.glob(f"{self._namespace}_*/pytorch/*.log")):
                pod = log.parent.parent.name.split("_")[1]
                try:
                    with log.open("rb") as file:
                        file.seek(self._read.get(log, 0))
                        chunk = file.read()
                except OSError:  # removed with its pod
                    continue
                self._read[log] = self._read.get(log, 0) + len(chunk)
                text = self._partial.pop(log, "") + chunk.decode(errors="replace")
                *whole, rest = text.split("\n")
                if rest:
                    self._partial[log] = rest
                for line in whole:
                    stamp, _, message = line.partition(" ")
                    seconds, _, fraction = stamp.rstrip("Z").partition(".")
                    try:
                        at = timestamp(f"{seconds}.{fraction[:6] or '0'}Z")
                    except ValueError:
                        continue
                    self._lines.setdefault(pod, []).append((at, message))


def measure_in_place(job: dict[str, Any], logs: LogTail) -> dict[str, float]:
    """The phases of a recovery in place (see the module's docstring): attempt 2 runs in attempt 1's
    pods, so rank 0's one log holds both attempts' step lines, split at the failure."""
    status = job["status"]
    history = {h["attempt"]: h for h in status["stepHistory"]}
    last_step = timestamp(history[1]["lastStepAt"])
    failed = timestamp(status["lastFailure"]["time"])
    first_step = timestamp(history[2]["firstStepAt"])
    phases = {
        "recover_s": first_step - last_step,
        "detect_s": failed - last_step,
        "restart_s": first_step - failed,
    }
    steps = [at for at, text in logs.lines(f"{JOB}-1-worker-0") if STEP_LINE.search(text)]
    before = [at for at in steps if at <= failed]
    after = [at for at in steps if at > failed]
    if before and after:
        phases["recover_log_s"] = after[0] - before[-1]
    return phases


def run_once(
    cluster: test_cluster.Cluster, kind: str, way: str, index: int, volume: Path
) -> dict[str, float]:
    """One job with one fault of ``kind``, recovered ``way``; its recovery's phases."""
    namespace = JobNamespace.create(cluster, f"recovery-{kind}-{way}-{index}", volume)
    logs = LogTail(cluster.node.pod_logs_dir, namespace.name)
    try:
        health = FAST_HANG_DETECTION if kind == "hang" else None
        recovery = {"maxRestarts": 2, "backoffSeconds": [BACKOFF_SECONDS]}
        namespace.apply(example(faults=FAULTS[kind], health=health, recovery=recovery, log_every=1))
        pods: list[dict[str, Any]] = []
        if way == "new":
            pods = namespace.wait("attempt 2 training", lambda: attempt_running(namespace), timeout=600)
        job = namespace.finished(timeout=600)
        if not condition(job, "Succeeded") or job["status"]["restarts"] != 1:
            raise RuntimeError(f"{kind} {way} run {index}: {json.dumps(job['status'])[:2000]}")
        restart = next(e["message"] for e in namespace.events() if e["reason"] == "GangRestart")
        if ("in place" in restart) != (way == "in-place"):
            raise RuntimeError(f"{kind} run {index} was to restart {way}, but: {restart}")
        return measure(job, pods, logs) if way == "new" else measure_in_place(job, logs)
    finally:
        logs.stop()
        namespace.delete()


def attempt_running(namespace: JobNamespace, attempt: int = 2, ranks: int = 2) -> list[dict[str, Any]]:
    """``attempt``'s pods once all ``ranks`` of them have their training container started (else
    empty)."""
    pods = namespace.cluster.items("pods", namespace.name, f"trainguard.dev/attempt={attempt}")
    started = [
        pod
        for pod in pods
        for container in pod.get("status", {}).get("containerStatuses") or []
        if container["name"] == "pytorch"
        and ("running" in container["state"] or "terminated" in container["state"])
    ]
    return started if len(started) == ranks else []


def main(argv: Sequence[str] | None = None) -> int:
    """Start the cluster, run the jobs, print each run and the medians (JSON on the last line)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="runs of each kind (default: %(default)s)")
    parser.add_argument("--kinds", default="hang,crash", help="comma-separated: hang, crash")
    parser.add_argument("--ways", default="in-place,new", help="comma-separated: in-place, new")
    parser.add_argument(
        "--dns-ttl",
        type=int,
        default=node.DNS_TTL_SECONDS,
        help="CoreDNS's ttl and cache for the cluster's names, which bound how long a 'no such name' is "
        "cached (default: %(default)s, CoreDNS's own; a kubeadm cluster's Corefile says 30)",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.dns_ttl <= 3600:
        parser.error("--dns-ttl must be 1 to 3600 (CoreDNS's range)")
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(FAULTS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}")
    ways = [w for w in args.ways.split(",") if w]
    if not ways or set(ways) - set(WAYS):
        parser.error(f"--ways must name some of {', '.join(WAYS)}")
    bin_dir = controlplane.bin_dir_from_script()
    reason = test_cluster.why_not_runnable(bin_dir)
    if reason:
        print(f"recovery_real: {reason}", file=sys.stderr)
        return 1
    results: dict[str, list[dict[str, float]]] = {f"{kind} {way}": [] for way in ways for kind in kinds}
    with tempfile.TemporaryDirectory(prefix="trainguard-recovery-") as scratch:
        state = Path(scratch)
        plane = controlplane.start(bin_dir, state / "control-plane")
        try:
            cluster = test_cluster.start(plane, state / "cluster", dns_ttl_seconds=args.dns_ttl)
            try:
                for way in ways:
                    cluster.install_operator(WAYS[way])
                    for index in range(args.runs):
                        for kind in kinds:
                            phases = run_once(cluster, kind, way, index, state / f"{kind}-{way}-{index}")
                            results[f"{kind} {way}"].append(phases)
                            line = " ".join(f"{k}={v:.1f}" for k, v in phases.items())
                            print(kind, way, index, line, flush=True)
                    cluster.uninstall_operator()
            finally:
                cluster.stop()
        finally:
            plane.stop()
    medians = {
        kind: {
            key: statistics.median(run[key] for run in runs)
            for key in runs[0]
            if all(key in run for run in runs)
        }
        for kind, runs in results.items()
        if runs
    }
    ratios = {
        kind: medians[f"{kind} in-place"]["recover_s"] / medians[f"{kind} new"]["recover_s"]
        for kind in kinds
        if f"{kind} in-place" in medians and f"{kind} new" in medians
    }
    for kind, ratio in ratios.items():
        print(f"{kind}: recovered in place in {ratio:.2f} of a new PyTorchJob's time (medians)", flush=True)
    figures = {"job": JOB, "backoff_s": BACKOFF_SECONDS, "dns_ttl_s": args.dns_ttl}
    print(json.dumps({**figures, "runs": results, "median": medians, "in_place_over_new": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

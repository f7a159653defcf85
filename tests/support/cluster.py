"""A whole test cluster on one machine: the control plane, a real node, and the trainguard operator.

On top of ``controlplane`` (etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the Kubeflow
training operator, all real, built from the Go module proxy) this starts:

- a real node (``node``, run as root): containerd, the kubelet, kube-proxy and CoreDNS, which run the
  pods the scheduler binds to it from the images of ``scripts/images.sh``;
- the trainguard CRD and the trainguard operator as a local process (``trainguard-operator -A``), as a
  developer runs it against a cluster.

Everything is a process stopped by PID (the operator, then the node, which first has the kubelet stop
its pods, then the control plane).

Run by hand (``bash scripts/control-plane.sh start`` does this)::

    python -m tests.support.cluster --bin-dir DIR [--state-dir DIR] [--no-operator]

prints the kubeconfig path on stdout and runs until Ctrl-C; then ``kubectl apply -f
examples/k8s/job.yaml`` (with a PersistentVolume for its claim) trains on this machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tests.support import controlplane, node
from tests.support.controlplane import ControlPlane, Process
from tests.support.node import Node
from tests.support.paths import REPO_ROOT

CRD_FILE = REPO_ROOT / "crds" / "guardedtrainingjobs.trainguard.dev.yaml"
NODE_NAME = node.NODE_NAME

T = TypeVar("T")


class ClusterError(RuntimeError):
    """The cluster could not be started or did not reach a state in time."""


def why_not_runnable(bin_dir: Path) -> str | None:
    """Why the test node cannot run on this machine (None if it can)."""
    return node.why_not_runnable(bin_dir)


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 0.5) -> T:
    """Poll ``probe`` until it returns something other than None/False; ClusterError after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


@dataclass
class Cluster:
    """A running test cluster and how to reach it."""

    plane: ControlPlane
    node: Node
    operator: Process
    state_dir: Path

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        """kubectl against the cluster; its stdout."""
        return self.plane.kubectl(*args, stdin=stdin, check=check).stdout

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        """One object as JSON, None if it does not exist."""
        result = self.plane.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr:
                return None
            raise ClusterError(result.stderr)
        document: dict[str, Any] = json.loads(result.stdout)
        return document

    def pod_logs(self, namespace: str) -> str:
        """Every container log the kubelet kept for pods of ``namespace`` (for failure messages)."""
        out = []
        for log in sorted(self.node.pod_logs_dir.glob(f"{namespace}_*/*/*.log")):
            text = log.read_text(errors="replace").splitlines()
            out.append(
                f"--- {log.parent.parent.name}/{log.parent.name}/{log.name} ---\n" + "\n".join(text[-30:])
            )
        return "\n".join(out)

    def diagnostics(self, namespace: str) -> str:
        """Objects, events and logs of a namespace, plus the operator's and the node's log tails."""
        parts = [
            self.kubectl("get", "gtj,pytorchjobs,pods,pvc", "-n", namespace, "-o", "wide", check=False),
            self.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False),
            self.pod_logs(namespace),
            f"--- trainguard operator ---\n{self.operator.log_tail(40)}",
            self.node.log_tails(40),
        ]
        return "\n".join(parts)

    def start_operator(self) -> None:
        """Start the trainguard operator (cluster-wide) and wait until it watches."""
        started = time.monotonic()
        self.plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
        self.plane.kubectl(
            "wait", "--for=condition=Established", "--timeout=60s", "crd/guardedtrainingjobs.trainguard.dev"
        )
        self.operator.start(die_with_parent=True)
        wait_for("the trainguard operator to start watching", lambda: _operator_watching(self.operator), 60)
        self.plane.startup_seconds["trainguard-operator"] = time.monotonic() - started

    def stop_operator(self) -> None:
        """Stop the trainguard operator (a no-op if it is not running)."""
        self.operator.stop(grace=10)
        self.operator.popen = None

    def stop(self) -> None:
        """Stop the operator and the node (the control plane is stopped by its own owner)."""
        self.stop_operator()
        self.node.stop()


def start(plane: ControlPlane, state_dir: Path, *, run_operator: bool = True) -> Cluster:
    """Start the control plane's components, a real node and (``run_operator``) the trainguard operator
    on ``plane``; the operator's sidecar image is the node's ``trainguard`` image."""
    reason = why_not_runnable(plane.bin_dir)
    if reason:
        raise ClusterError(reason)
    started = time.monotonic()
    controlplane.start_cluster(plane)
    plane.startup_seconds["components"] = time.monotonic() - started
    state_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    running = node.start(plane, state_dir / "node")
    plane.startup_seconds["node"] = time.monotonic() - started
    for part, seconds in running.startup_seconds.items():
        plane.startup_seconds[f"node:{part}"] = seconds
    operator = Process(
        "trainguard-operator",
        [
            str(Path(sys.executable).parent / "trainguard-operator"),
            "--all-namespaces",
            "--metrics-host=127.0.0.1",
            "--metrics-port=0",
            "--liveness=",
            f"--sidecar-image={running.images['trainguard']}",
        ],
        state_dir / "trainguard-operator.log",
        env=plane.environ(),
    )
    cluster = Cluster(plane=plane, node=running, operator=operator, state_dir=state_dir)
    try:
        if run_operator:
            cluster.start_operator()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _operator_watching(operator: Process) -> bool:
    if not operator.alive():
        raise ClusterError(f"the trainguard operator exited:\n{operator.log_tail()}")
    return "Initial authentication has finished" in operator.log_tail(200)


def main(argv: Sequence[str] | None = None) -> int:
    """Start the whole cluster, print the kubeconfig path, and run until SIGINT or SIGTERM."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bin-dir", type=Path, help="the control plane binaries (default: the script's)")
    parser.add_argument("--state-dir", type=Path, help="state, logs and kubeconfig (default: a temp dir)")
    parser.add_argument(
        "--no-operator", action="store_true", help="do not run the trainguard operator (run your own)"
    )
    args = parser.parse_args(argv)
    bin_dir: Path = args.bin_dir or controlplane.bin_dir_from_script()
    reason = why_not_runnable(bin_dir)
    if reason:
        print(f"cluster: {reason}", file=sys.stderr)
        return 1
    keep = args.state_dir is not None
    state_dir: Path = (args.state_dir or Path(tempfile.mkdtemp(prefix="trainguard-cluster-"))).resolve()
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop.set())
    try:
        plane = controlplane.start(bin_dir, state_dir / "control-plane")
    except controlplane.ControlPlaneError as exc:
        print(f"cluster: {exc}", file=sys.stderr)
        return 1
    try:
        cluster = start(plane, state_dir, run_operator=not args.no_operator)
    except BaseException as exc:
        plane.stop()
        print(f"cluster: {exc}", file=sys.stderr)
        return 1
    timings = ", ".join(f"{k} {v:.1f} s" for k, v in plane.startup_seconds.items())
    print(
        f"cluster: ready ({timings}); logs in {state_dir}\n"
        f"cluster: export KUBECONFIG={plane.kubeconfig}    # Ctrl-C stops everything",
        file=sys.stderr,
    )
    print(plane.kubeconfig, flush=True)
    try:
        controlplane.run_until_stopped([*plane.processes(), *cluster.node.processes()], stop, "cluster")
    finally:
        cluster.stop()
        plane.stop()
        print("cluster: stopped", file=sys.stderr)
        if not keep:
            shutil.rmtree(state_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A whole test cluster on one machine: the control plane, a real node, and the trainguard operator as the
Helm chart installs it.

On top of ``controlplane`` (etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the Kubeflow
training operator, all real, built from the Go module proxy) this starts a real node (``node``, run as
root): containerd, the kubelet, kube-proxy and CoreDNS, which run the pods the scheduler binds to it from
the images of ``scripts/images.sh``.

The trainguard operator runs only as a user installs it: ``Cluster.install_operator`` runs ``helm
install`` of ``charts/trainguard`` with the node's ``trainguard`` image, so the operator is the chart's
Deployment (or StatefulSet) on the node, with in-cluster configuration and the chart's ServiceAccount,
and the API server enforces the chart's RBAC on everything it does. Nothing on its path holds an admin
credential; the tests use the admin kubeconfig only to set things up and to look.

Everything is stopped by PID (the node, which first has the kubelet stop its pods, then the control
plane).

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
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tests.support import controlplane, node, tools
from tests.support.controlplane import ControlPlane
from tests.support.node import Node
from tests.support.paths import CHART

NODE_NAME = node.NODE_NAME
#: Where the tests install the chart (a release of this name in this namespace), as its README does.
OPERATOR_RELEASE = "trainguard"
OPERATOR_NAMESPACE = "trainguard-system"
CRD_NAME = "guardedtrainingjobs.trainguard.dev"
#: What kopf logs once it has logged in and starts watching (its first line after the login handler).
OPERATOR_WATCHING = "Initial authentication has finished"

T = TypeVar("T")


class ClusterError(RuntimeError):
    """The cluster could not be started or did not reach a state in time."""


def why_not_runnable(bin_dir: Path) -> str | None:
    """Why the test cluster cannot run on this machine (None if it can): the node's needs, and helm."""
    reason = node.why_not_runnable(bin_dir)
    if reason is None and shutil.which(str(tools.bin_dir() / "helm")) is None:
        reason = f"helm is not built in {tools.bin_dir()}: run bash scripts/tools.sh"
    return reason


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


def image_values(reference: str, *components: str) -> list[str]:
    """``--set`` arguments that point the chart's ``components`` (operator, sidecar) at an image
    ``repository:tag`` and pull it only when the node does not hold it."""
    repository, _, tag = reference.rpartition(":")
    return [
        argument
        for component in components
        for argument in (
            f"--set={component}.image.repository={repository}",
            f"--set-string={component}.image.tag={tag}",  # a tag of digits is no number
            f"--set={component}.image.pullPolicy=IfNotPresent",
        )
    ]


@dataclass
class Operator:
    """The trainguard operator as one Helm release installed it."""

    release: str
    namespace: str
    values: list[str] = field(default_factory=list)

    @property
    def selector(self) -> str:
        """The label selector of the release's operator pods."""
        return f"app.kubernetes.io/instance={self.release},app.kubernetes.io/component=operator"

    @property
    def service(self) -> str:
        """The metrics Service's (and the Deployment's or StatefulSet's) name."""
        return (
            f"{self.release}-operator"
            if "trainguard" in self.release
            else f"{self.release}-trainguard-operator"
        )


@dataclass
class Cluster:
    """A running test cluster and how to reach it."""

    plane: ControlPlane
    node: Node
    state_dir: Path
    operator: Operator | None = None

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 60) -> str:
        """kubectl against the cluster, as the admin; its stdout."""
        return self.plane.kubectl(*args, stdin=stdin, check=check, timeout=timeout).stdout

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        """One object as JSON, None if it does not exist."""
        result = self.plane.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr:
                return None
            raise ClusterError(result.stderr)
        document: dict[str, Any] = json.loads(result.stdout)
        return document

    def items(self, kind: str, namespace: str, selector: str = "") -> list[dict[str, Any]]:
        """The objects of ``kind`` in ``namespace`` (matching ``selector``), as JSON."""
        args = ["get", kind, "-n", namespace, "-o", "json"] + (["-l", selector] if selector else [])
        found: list[dict[str, Any]] = json.loads(self.kubectl(*args))["items"]
        return found

    def helm(self, *args: str, timeout: float = 300) -> str:
        """helm against the cluster, as the admin (a private, empty Helm home); its stdout."""
        argv = [str(tools.bin_dir() / "helm"), f"--kubeconfig={self.plane.kubeconfig}", *args]
        result = subprocess.run(
            argv, capture_output=True, text=True, env=tools.helm_environ(), timeout=timeout
        )
        if result.returncode != 0:
            raise ClusterError(
                f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
            )
        return result.stdout

    def pod_logs(self, namespace: str) -> str:
        """Every container log the kubelet kept for pods of ``namespace`` (for failure messages)."""
        out = []
        for log in sorted(self.node.pod_logs_dir.glob(f"{namespace}_*/*/*.log")):
            try:
                text = log.read_text(errors="replace").splitlines()
            except FileNotFoundError:  # the pod was deleted, and the kubelet removed its logs, meanwhile
                continue
            out.append(
                f"--- {log.parent.parent.name}/{log.parent.name}/{log.name} ---\n" + "\n".join(text[-30:])
            )
        return "\n".join(out)

    def diagnostics(self, namespace: str) -> str:
        """Objects, events and logs of a namespace, plus the operator's and the node's log tails."""
        parts = [
            self.kubectl("get", "gtj,pytorchjobs,pods,pvc", "-n", namespace, "-o", "wide", check=False),
            # Empty where Trainer's and JobSet's CRDs are not installed.
            self.kubectl("get", "trainjobs,jobsets", "-n", namespace, "-o", "wide", check=False),
            self.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False),
            self.pod_logs(namespace),
        ]
        if self.operator is not None:
            parts.append(
                self.kubectl("get", "pods", "-n", self.operator.namespace, "-o", "wide", check=False)
            )
            parts.append(self.pod_logs(self.operator.namespace))
        parts.append(self.node.log_tails(40))
        return "\n".join(parts)

    def operator_pods(self) -> list[dict[str, Any]]:
        """The installed release's operator pods (none when no release is installed)."""
        if self.operator is None:
            return []
        return self.items("pods", self.operator.namespace, self.operator.selector)

    def install_operator(
        self,
        values: Sequence[str] = (),
        *,
        release: str = OPERATOR_RELEASE,
        namespace: str = OPERATOR_NAMESPACE,
        timeout: float = 180,
    ) -> Operator:
        """``helm install`` the chart with the node's ``trainguard`` image (operator and sidecar) and
        ``values`` (``--set=...`` arguments), in ``namespace``, which enforces the restricted Pod Security
        profile; return once every operator pod runs and has logged in and started watching."""
        if self.operator is not None:
            raise ClusterError(f"release {self.operator.release} is installed already")
        started = time.monotonic()
        self.kubectl("create", "namespace", namespace, check=False)
        self.kubectl(
            "label", "--overwrite", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
        )
        self.adopt_crd(release, namespace)
        chosen = [*image_values(self.node.images["trainguard"], "operator", "sidecar"), *values]
        self.helm("install", release, str(CHART), f"--namespace={namespace}", *chosen)
        self.operator = Operator(release=release, namespace=namespace, values=chosen)
        self.wait_operator_watching(timeout)
        self.plane.startup_seconds["trainguard-operator"] = time.monotonic() - started
        return self.operator

    def wait_operator_watching(self, timeout: float = 180) -> list[dict[str, Any]]:
        """Wait until the release's pods (as many as it asks for) run and each has started watching."""
        operator = self.operator
        assert operator is not None, "no operator installed"
        wanted = next(
            (int(v.rpartition("=")[2]) for v in reversed(operator.values) if "operator.replicas=" in v), 1
        )

        def watching() -> list[dict[str, Any]] | None:
            pods = [p for p in self.operator_pods() if not p["metadata"].get("deletionTimestamp")]
            running = [p for p in pods if p.get("status", {}).get("phase") == "Running"]
            if len(running) != wanted:
                return None
            for pod in running:
                logs = self.kubectl("logs", pod["metadata"]["name"], "-n", operator.namespace, check=False)
                if OPERATOR_WATCHING not in logs:
                    return None
            return running

        try:
            return wait_for("the operator's pods to watch", watching, timeout, interval=1.0)
        except ClusterError as exc:
            raise ClusterError(f"{exc}\n{self.diagnostics(operator.namespace)}") from exc

    def uninstall_operator(self, timeout: float = 120) -> None:
        """``helm uninstall`` the release (the CRD stays, as the chart keeps it) and wait until its pods
        are gone, so no operator of it reconciles what comes next. A no-op when none is installed."""
        operator, self.operator = self.operator, None
        if operator is None:
            return
        self.helm(
            "uninstall", operator.release, f"--namespace={operator.namespace}", "--wait", timeout=timeout
        )
        wait_for(
            "the operator's pods to be gone",
            lambda: not self.items("pods", operator.namespace, operator.selector),
            timeout,
        )

    def adopt_crd(self, release: str, namespace: str) -> None:
        """Let ``release`` adopt a CRD installed before (by hand, or by an earlier release that kept it),
        as the chart's README tells a user to; otherwise helm refuses to install."""
        if self.plane.kubectl("get", "crd", CRD_NAME, check=False).returncode != 0:
            return
        self.kubectl("label", "--overwrite", "crd", CRD_NAME, "app.kubernetes.io/managed-by=Helm")
        self.kubectl(
            "annotate", "--overwrite", "crd", CRD_NAME,
            f"meta.helm.sh/release-name={release}", f"meta.helm.sh/release-namespace={namespace}",
        )  # fmt: skip

    def stop(self) -> None:
        """Stop the node (the control plane is stopped by its own owner); the operator's pods go with it."""
        self.operator = None
        self.node.stop()


def start(plane: ControlPlane, state_dir: Path, *, dns_ttl_seconds: int = node.DNS_TTL_SECONDS) -> Cluster:
    """Start the control plane's components and a real node on ``plane`` (its CoreDNS answering with
    ``dns_ttl_seconds``); no operator is installed."""
    reason = why_not_runnable(plane.bin_dir)
    if reason:
        raise ClusterError(reason)
    started = time.monotonic()
    controlplane.start_cluster(plane)
    plane.startup_seconds["components"] = time.monotonic() - started
    state_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    running = node.start(plane, state_dir / "node", dns_ttl_seconds=dns_ttl_seconds)
    plane.startup_seconds["node"] = time.monotonic() - started
    for part, seconds in running.startup_seconds.items():
        plane.startup_seconds[f"node:{part}"] = seconds
    return Cluster(plane=plane, node=running, state_dir=state_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """Start the whole cluster, install the operator's chart, print the kubeconfig path, and run until
    SIGINT or SIGTERM."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bin-dir", type=Path, help="the control plane binaries (default: the script's)")
    parser.add_argument("--state-dir", type=Path, help="state, logs and kubeconfig (default: a temp dir)")
    parser.add_argument(
        "--no-operator", action="store_true", help="do not install the trainguard chart (install your own)"
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
        cluster = start(plane, state_dir)
    except BaseException as exc:
        plane.stop()
        print(f"cluster: {exc}", file=sys.stderr)
        return 1
    try:
        if not args.no_operator:
            cluster.install_operator()
    except BaseException as exc:
        cluster.stop()
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

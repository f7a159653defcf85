"""The test cluster's node is a real one: the kubelet, containerd and runc enforce what a pod spec says.

Every test runs in a namespace of its own that enforces the Pod Security "restricted" profile, with pods
from the images of ``scripts/images.sh`` (the trainguard image: Python, user 65532; the base image: root),
and asserts on what the API server reports (pod status, Events), on ``kubectl logs`` and ``kubectl
exec``, and on what crosses the pod network (a Service's ClusterIP and its DNS name, through kube-proxy
and CoreDNS). The last tests run trainguard's worker launcher as a container's PID 1 beside a sidecar
that takes restart orders over the pod network.
"""

from __future__ import annotations

import json
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.cluster import Cluster, wait_for
from tests.support.controlplane import PYTORCH_INIT_CONTAINER
from trainer_sidecar.contract.inplace import (
    RestartOrder,
    StopMode,
    order_token_digest,
    pod_identity,
    sign_order,
)

TIMEOUT = 120.0  # for anything that involves scheduling and starting a pod on a busy 2-core machine


def restricted_container(name: str, image: str, script: str, **extra: Any) -> dict[str, Any]:
    """A container that passes the restricted profile and runs ``python3 -c script``."""
    container: dict[str, Any] = {
        "name": name,
        "image": image,
        "imagePullPolicy": "Never",
        "command": ["python3", "-c", textwrap.dedent(script)],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    container.update(extra)
    return container


def pod(name: str, *containers: dict[str, Any], restart: str = "Never", **spec: Any) -> dict[str, Any]:
    """A restricted pod (non-root, RuntimeDefault seccomp) with ``containers``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": 2,
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": list(containers),
            **spec,
        },
    }


class Namespace:
    """A restricted namespace of the test cluster and the helpers its tests use."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        self.cluster = cluster
        self.name = name

    def apply(self, *documents: dict[str, Any]) -> None:
        """``kubectl apply`` the documents in this namespace."""
        self.cluster.kubectl(
            "apply",
            "-n",
            self.name,
            "-f",
            "-",
            stdin=json.dumps({"kind": "List", "apiVersion": "v1", "items": list(documents)}),
        )

    def get_pod(self, name: str) -> dict[str, Any]:
        """The pod's current object (it must exist)."""
        found = self.cluster.get("pod", name, self.name)
        assert found is not None, f"pod {name} is gone"
        return found

    def wait(self, what: str, probe: Any, timeout: float = TIMEOUT) -> Any:
        """``wait_for`` with the namespace's diagnostics on a time-out."""
        try:
            return wait_for(what, probe, timeout=timeout, interval=0.5)
        except Exception as exc:
            raise AssertionError(f"{exc}\n{self.cluster.diagnostics(self.name)}") from exc

    def terminated(self, name: str, container: str | None = None) -> dict[str, Any]:
        """The ``terminated`` state of the pod's (first) container once it has one."""

        def probe() -> dict[str, Any] | None:
            for status in self.get_pod(name).get("status", {}).get("containerStatuses") or []:
                if container in (None, status["name"]):
                    state: dict[str, Any] | None = status.get("state", {}).get("terminated")
                    return state
            return None

        result: dict[str, Any] = self.wait(f"{self.name}/{name} to terminate", probe)
        return result

    def running(self, name: str) -> dict[str, Any]:
        """The pod once every container is ready."""

        def probe() -> dict[str, Any] | None:
            found = self.get_pod(name)
            statuses = found.get("status", {}).get("containerStatuses") or []
            return found if statuses and all(s.get("ready") for s in statuses) else None

        result: dict[str, Any] = self.wait(f"{self.name}/{name} to be ready", probe)
        return result

    def logs(self, name: str, *args: str) -> str:
        """``kubectl logs`` of the pod."""
        return self.cluster.kubectl("logs", "-n", self.name, name, *args)

    def events(self, name: str) -> list[dict[str, Any]]:
        """The Events about object ``name``."""
        listing = json.loads(
            self.cluster.kubectl(
                "get", "events", "-n", self.name, f"--field-selector=involvedObject.name={name}", "-o", "json"
            )
        )
        items: list[dict[str, Any]] = listing["items"]
        return items


@pytest.fixture
def ns(e2e_cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Namespace]:
    """A fresh namespace enforcing Pod Security "restricted", deleted afterwards."""
    name = "node-" + request.node.name.removeprefix("test_").replace("_", "-")[:40].rstrip("-")
    e2e_cluster.kubectl("create", "namespace", name)
    e2e_cluster.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted")
    try:
        yield Namespace(e2e_cluster, name)
    finally:
        e2e_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def image(e2e_cluster: Cluster) -> str:
    """The trainguard image: Python 3.11, user 65532."""
    return e2e_cluster.node.images["trainguard"]


def test_a_pod_runs_as_its_images_numeric_user_and_kubectl_logs_and_exec_reach_it(
    ns: Namespace, image: str
) -> None:
    script = """
        import os, sys, time
        print("uid", os.getuid(), flush=True)
        time.sleep(300)
    """
    ns.apply(pod("whoami", restricted_container("main", image, script)))
    ns.running("whoami")
    # The image's USER (containerd's CRI takes its uid; the group only from runAsGroup).
    assert ns.wait("the log line", lambda: "uid" in ns.logs("whoami") and ns.logs("whoami")) == "uid 65532\n"
    out = ns.cluster.kubectl(
        "exec", "-n", ns.name, "whoami", "--", "python3", "-c", "import os; print(os.getuid())"
    )
    assert out.strip() == "65532"
    # The operator and the sidecar are the image's programs; torch is not in it.
    out = ns.cluster.kubectl(
        "exec", "-n", ns.name, "whoami", "--", "python3", "-c",
        "import importlib.util as u, trainguard_operator.handlers, trainer_sidecar.sidecar.server;"
        "print(u.find_spec('torch'))",
    )  # fmt: skip
    assert out.strip() == "None"


def test_run_as_non_root_is_enforced_by_the_kubelet_on_an_image_that_runs_as_root(
    ns: Namespace, e2e_cluster: Cluster
) -> None:
    # The pod spec names no user, so the restricted admission lets it in; the base image's user is root.
    ns.apply(pod("rooted", restricted_container("main", e2e_cluster.node.images["base"], "print('ran')")))

    def refused() -> str | None:
        for status in ns.get_pod("rooted").get("status", {}).get("containerStatuses") or []:
            waiting = status.get("state", {}).get("waiting") or {}
            if waiting.get("reason") == "CreateContainerConfigError":
                return str(waiting.get("message"))
        return None

    message = ns.wait("the kubelet to refuse the container", refused)
    assert "runAsNonRoot and image will run as root" in message, message
    assert ns.get_pod("rooted")["status"]["phase"] == "Pending"


def test_read_only_root_filesystem_is_enforced(ns: Namespace, image: str) -> None:
    script = """
        import errno, pathlib
        pathlib.Path("/tmp/scratch/ok").write_text("fine")  # an emptyDir stays writable
        try:
            pathlib.Path("/opt/trainguard/written").write_text("no")
        except OSError as exc:
            print("refused", errno.errorcode[exc.errno])
        else:
            print("written")
    """
    container = restricted_container(
        "main",
        image,
        script,
        volumeMounts=[{"name": "scratch", "mountPath": "/tmp/scratch"}],
    )
    container["securityContext"]["readOnlyRootFilesystem"] = True
    ns.apply(pod("readonly", container, volumes=[{"name": "scratch", "emptyDir": {}}]))
    state = ns.terminated("readonly")
    assert state["exitCode"] == 0, state
    assert ns.logs("readonly") == "refused EROFS\n"


def test_a_memory_limit_is_enforced_by_an_oom_kill(ns: Namespace, image: str) -> None:
    script = """
        chunks = []
        for _ in range(300):
            chunks.append(bytearray(1 << 20))  # touched: bytearray zero-fills
        print("survived", flush=True)
    """
    container = restricted_container("main", image, script, resources={"limits": {"memory": "32Mi"}})
    ns.apply(pod("hog", container))
    state = ns.terminated("hog")
    assert (state["reason"], state["exitCode"]) == ("OOMKilled", 137), state


def test_a_failing_liveness_probe_gets_the_container_killed_and_restarted(ns: Namespace, image: str) -> None:
    # Serves nothing on the probed port: every probe fails.
    container = restricted_container(
        "main",
        image,
        "import time; print('started', flush=True); time.sleep(600)",
        livenessProbe={
            "httpGet": {"port": 8080, "path": "/healthz"},
            "periodSeconds": 1,
            "failureThreshold": 2,
        },
    )
    ns.apply(pod("unhealthy", container, restart="Always"))

    def restarted() -> dict[str, Any] | None:
        statuses = ns.get_pod("unhealthy").get("status", {}).get("containerStatuses") or []
        return statuses[0] if statuses and statuses[0].get("restartCount", 0) >= 1 else None

    status = ns.wait("the kubelet to restart the container", restarted)
    assert status["lastState"]["terminated"]["exitCode"] in (137, 143), status  # SIGKILL or SIGTERM
    reasons = {(e["reason"], e["message"].split(":")[0]) for e in ns.events("unhealthy")}
    assert ("Unhealthy", "Liveness probe failed") in reasons, reasons
    assert any(reason == "Killing" for reason, _ in reasons), reasons


def test_a_service_reaches_its_pod_by_cluster_ip_and_by_dns_name(ns: Namespace, image: str) -> None:
    server = """
        import http.server, socketserver
        class Hello(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = f"hello from {self.connection.getsockname()[0]}".encode()
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)
        http.server.ThreadingHTTPServer(("0.0.0.0", 8080), Hello).serve_forever()
    """
    web = restricted_container(
        "web", image, server, readinessProbe={"httpGet": {"port": 8080, "path": "/"}, "periodSeconds": 1}
    )
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    ns.apply(pod("web", web), service)
    pod_ip = ns.running("web")["status"]["podIP"]
    cluster_ip = ns.cluster.get("service", "web", ns.name)["spec"]["clusterIP"]  # type: ignore[index]
    # From another pod: the ClusterIP (kube-proxy) and the DNS name (CoreDNS through kube-dns).
    client = f"""
        import socket, urllib.request
        print(socket.gethostbyname("web.{ns.name}.svc.cluster.local"))
        for url in ("http://{cluster_ip}/", "http://web/", "http://web.{ns.name}.svc.cluster.local/"):
            print(urllib.request.urlopen(url, timeout=10).read().decode())
    """
    ns.apply(pod("client", restricted_container("main", image, client)))
    state = ns.terminated("client")
    assert state["exitCode"] == 0, f"{state}\n{ns.logs('client')}"
    assert ns.logs("client").splitlines() == [cluster_ip] + [f"hello from {pod_ip}"] * 3
    # From the node itself, as the API server or an operator outside the cluster would.
    with urllib.request.urlopen(f"http://{cluster_ip}/", timeout=10) as response:
        assert response.read().decode() == f"hello from {pod_ip}"


def test_a_read_write_many_claim_is_shared_by_two_pods(ns: Namespace, image: str, tmp_path: Path) -> None:
    volume = tmp_path / "shared"
    volume.mkdir()
    volume.chmod(0o777)  # the pods' user (65532) writes to it; a hostPath volume gets no fsGroup
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"{ns.name}-shared"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": str(volume), "type": "Directory"},
            "claimRef": {"namespace": ns.name, "name": "shared"},
        },
    }
    ns.cluster.kubectl("apply", "-f", "-", stdin=json.dumps(pv))
    try:
        claim = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "shared"},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "resources": {"requests": {"storage": "1Gi"}},
            },
        }
        mount = {"volumeMounts": [{"name": "shared", "mountPath": "/shared"}]}
        volumes = [{"name": "shared", "persistentVolumeClaim": {"claimName": "shared"}}]
        writer = """
            import pathlib, time
            pathlib.Path("/shared/from-writer").write_text("written by the writer")
            while not pathlib.Path("/shared/from-reader").exists():
                time.sleep(0.2)
            print(pathlib.Path("/shared/from-reader").read_text())
        """
        reader = """
            import pathlib, time
            while not pathlib.Path("/shared/from-writer").exists():
                time.sleep(0.2)
            print(pathlib.Path("/shared/from-writer").read_text())
            pathlib.Path("/shared/from-reader").write_text("written by the reader")
        """
        ns.apply(
            claim,
            pod("writer", restricted_container("main", image, writer, **mount), volumes=volumes),
            pod("reader", restricted_container("main", image, reader, **mount), volumes=volumes),
        )
        assert ns.terminated("writer")["exitCode"] == 0
        assert ns.terminated("reader")["exitCode"] == 0
        assert ns.logs("writer") == "written by the reader\n"
        assert ns.logs("reader") == "written by the writer\n"
        assert sorted(p.name for p in volume.iterdir()) == ["from-reader", "from-writer"]
        assert {p.stat().st_uid for p in volume.iterdir()} == {65532}
    finally:
        ns.cluster.kubectl("delete", "namespace", ns.name, "--wait=true", "--timeout=120s", check=False)
        ns.cluster.kubectl("delete", "pv", f"{ns.name}-shared", "--wait=false", check=False)


def test_the_training_operators_init_container_finds_a_headless_service_by_its_short_name(
    ns: Namespace, e2e_cluster: Cluster, image: str
) -> None:
    """examples/k8s/pytorch-init-container.yaml, as the training operator fills it in, with the node's
    init image: it waits for the master's headless Service to resolve, and then succeeds."""
    filled = (
        PYTORCH_INIT_CONTAINER.read_text()
        .replace("{{.InitContainerImage}}", e2e_cluster.node.images["pytorch-init"])
        .replace("{{.MaxTries}}", "30")
        .replace("{{.MasterAddr}}", "master-0")
    )
    init = {**yaml.safe_load(filled)[0], "imagePullPolicy": "Never"}
    master = restricted_container(
        "main", image, "import time; time.sleep(600)", readinessProbe={"exec": {"command": ["true"]}}
    )
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "master-0"},
        "spec": {"clusterIP": "None", "selector": {"app": "master"}, "ports": [{"port": 23456}]},
    }
    ns.apply(pod("master", master), headless, pod("waiter", init))
    state = ns.terminated("waiter")
    assert state["exitCode"] == 0, f"{state}\n{ns.logs('waiter')}"


# --- the worker container's launcher (trainguard-launch) on a real kubelet ----------------------------------

ORDER_TOKEN = "e2e-order-token"
ORDER_SIGNING_KEY = "e2" * 32


def launched_pod(name: str, image: str, worker_script: str, order_wait: int) -> dict[str, Any]:
    """A pod whose worker container runs ``worker_script`` under the launcher (PID 1, user 1000), beside
    a sidecar (the image's user) that takes restart orders with ``ORDER_TOKEN``, signed with
    ``ORDER_SIGNING_KEY`` for the pod (its name and namespace by the downward API, as the operator
    renders them); the two share the status directory."""
    status = {"name": "status", "mountPath": "/status"}
    launcher = [
        "python3", "-m", "trainer_sidecar.launcher.launcher", "--status-dir", "/status",
        "--order-wait-seconds", str(order_wait), "--no-spare", "--",
        "python3", "-c", textwrap.dedent(worker_script),
    ]  # fmt: skip
    # The worker runs as another user than the sidecar, as a user's image beside the chart's sidecar does
    # (examples/k8s/job.yaml: 1000; the sidecar: 65532): the order and the state cross users.
    worker = restricted_container(
        "worker", image, "", command=launcher, env=[{"name": "TRAINGUARD_ATTEMPT", "value": "1"}],
        volumeMounts=[status],
    )  # fmt: skip
    worker["securityContext"]["runAsUser"] = 1000
    sidecar = restricted_container(
        "sidecar",
        image,
        "",
        command=["trainguard-sidecar"],
        env=[
            {"name": "TRAINGUARD_STATUS_FILE", "value": "/status/status.json"},
            {"name": "TRAINGUARD_SIDECAR_HOST", "value": "0.0.0.0"},
            {"name": "TRAINGUARD_SIDECAR_PORT", "value": "8080"},
            {"name": "TRAINGUARD_ORDER_TOKEN_SHA256", "value": order_token_digest(ORDER_TOKEN)},
            {"name": "TRAINGUARD_ORDER_SIGNING_KEY", "value": ORDER_SIGNING_KEY},
            {"name": "TRAINGUARD_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "TRAINGUARD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        ],
        volumeMounts=[status],
    )
    return pod(name, worker, sidecar, volumes=[{"name": "status", "emptyDir": {}}])


def post_order(pod_ip: str, pod: str, attempt: int, token: str) -> int:
    """POST a kill order for ``attempt``, signed for ``pod`` (``namespace/name``), to the pod's sidecar;
    the HTTP status."""
    order = RestartOrder(attempt=attempt, environment={}, stop=StopMode.KILL)
    body = sign_order(ORDER_SIGNING_KEY, pod, order, time.time())
    request = urllib.request.Request(
        f"http://{pod_ip}:8080/restart",
        data=body,
        headers={"Authorization": f"Bearer {token}"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        with error:
            return error.code


def test_an_order_restarts_the_worker_inside_its_running_container(ns: Namespace, image: str) -> None:
    script = """
        import os, sys, time
        attempt = os.environ["TRAINGUARD_ATTEMPT"]
        print(f"attempt {attempt} uid {os.getuid()} parent {os.getppid()}", flush=True)
        if attempt == "1":
            time.sleep(600)  # hung: only a kill ends it
    """
    ns.apply(launched_pod("inplace", image, script, order_wait=60))
    running = ns.running("inplace")
    pod_ip, uid = running["status"]["podIP"], running["metadata"]["uid"]
    ns.wait("attempt 1", lambda: "attempt 1" in ns.logs("inplace", "-c", "worker"))
    pod_name = pod_identity(running["metadata"]["namespace"], "inplace")
    assert post_order(pod_ip, pod_name, 2, "not-the-token") == 401
    assert post_order(pod_ip, pod_identity(running["metadata"]["namespace"], "other"), 2, ORDER_TOKEN) == 403
    assert post_order(pod_ip, pod_name, 2, ORDER_TOKEN) == 202
    state = ns.terminated("inplace", "worker")
    assert (state["exitCode"], state["reason"]) == (0, "Completed"), state  # attempt 2's own exit
    lines = ns.logs("inplace", "-c", "worker").splitlines()
    attempts = [line for line in lines if line.startswith("attempt ")]
    assert [line.split()[1] for line in attempts] == ["1", "2"], lines
    # Both attempts ran in the one container of the one pod, children of the launcher as its PID 1.
    assert all(line.endswith("uid 1000 parent 1") for line in attempts), attempts
    found = ns.get_pod("inplace")
    worker = next(s for s in found["status"]["containerStatuses"] if s["name"] == "worker")
    assert (found["metadata"]["uid"], worker["restartCount"]) == (uid, 0)


def test_without_an_order_the_worker_s_exit_is_the_container_s(ns: Namespace, image: str) -> None:
    script = """
        import os, signal
        print("attempt", os.environ["TRAINGUARD_ATTEMPT"], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """
    ns.apply(launched_pod("passthrough", image, script, order_wait=0))
    state = ns.terminated("passthrough", "worker")
    assert state["exitCode"] == 128 + 9, state

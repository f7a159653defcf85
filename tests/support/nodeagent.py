"""A node agent that plays the kubelet for the end-to-end tests: it runs pods as local processes.

No container runtime is available, so the agent does what the kubelet and a CNI plugin would, with the
kernel's own namespaces and the project's Python environment instead of images:

- **Node.** Registers a Node (Ready, capacity, addresses, kubelet version) and renews its Lease in
  ``kube-node-lease``; the scheduler binds pods to it like to any node.
- **Network.** Each pod gets its own network namespace (``ip netns``) with a veth on a bridge of this
  agent, and its own address in the agent's pod CIDR. Ports never clash between pods, and pods, the
  agent and the host's processes (the trainguard operator polling sidecars) reach each pod's IP.
- **DNS.** A DNS server on the bridge address answers ``<service>.<namespace>.svc.cluster.local`` with the
  IPs of the service's ready pods (headless or not: there is no kube-proxy), and
  ``<hostname>.<subdomain>.<namespace>.svc.cluster.local`` for pods. Each pod gets its own
  ``/etc/resolv.conf`` (search path and ``ndots:5`` as the kubelet writes them) and ``/etc/hosts``.
- **Containers.** Init containers in order (native sidecars, ``restartPolicy: Always``, start and keep
  running), then the containers, each as a process in a private mount and UTS namespace
  (``tests/podlaunch.py``) with the pod's hostname, its volumes bind-mounted at their ``mountPath``,
  ``command``/``args`` and ``env`` (``$(VAR)`` expansion, downward API fields, ConfigMap and Secret
  references). Images and user IDs are ignored: commands run as this agent's user, in the project's Python
  environment, in ``--workdir`` (standing in for the image's working directory) unless ``workingDir``
  says otherwise.
- **Volumes.** ``emptyDir`` is a per-pod directory; a ``persistentVolumeClaim`` must be Bound and maps to
  its PersistentVolume's ``hostPath`` (or ``local``) directory, shared by all pods as ReadWriteMany
  storage would be; ``hostPath``, ``configMap``, ``secret``, ``downwardAPI`` and ``projected`` (with
  service-account tokens from the TokenRequest API) are written or mapped as the kubelet does.
- **Probes.** ``httpGet``, ``tcpSocket`` and ``exec`` with kubelet semantics: ``initialDelaySeconds``,
  ``periodSeconds``, ``timeoutSeconds``, ``successThreshold``, ``failureThreshold``; the startup probe
  gates liveness and readiness; a failed liveness or startup probe kills the container (SIGTERM, grace,
  SIGKILL) and the restart policy decides what comes next.
- **Restarts** per ``restartPolicy`` with the kubelet's back-off (10 s doubling to 5 min; the base is a
  flag so tests can shorten it), ``restartCount`` and ``lastState.terminated``.
- **Status** as the kubelet reports it: phase, conditions (PodReadyToStartContainers, Initialized,
  ContainersReady, Ready), container and init container statuses (state, lastState with exit code and
  reason, ready, started, restartCount), podIP(s), hostIP(s), startTime; and Events (Started, Killing,
  Unhealthy, BackOff).
- **Termination messages.** A per-container file is mounted at ``terminationMessagePath`` (where the host
  allows the mount point); its first 4096 bytes, or with ``FallbackToLogsOnError`` and a failure the end
  of the output, become ``state.terminated.message``.
- **Deletion.** A pod being deleted gets SIGTERM, its grace period, then SIGKILL (containers first, then
  sidecars, as the kubelet orders them), and is then removed with a zero grace period.
- **Logs.** Every container's output is kept under ``<state-dir>/pods/<namespace>_<pod>/<container>.log``
  and served on the kubelet's HTTPS port (10250, on the node's address) to the API server, so
  ``kubectl logs`` (``--previous``, ``--tail``, ``-f``) works.

Needs root (namespaces, ``ip``, port 53), ``iproute2`` and, for the training operator's init container,
an ``nslookup`` (Debian's ``bind9-dnsutils``). Run::

    python tests/nodeagent.py --kubeconfig KUBECONFIG --state-dir DIR [--node-name N] [--pod-cidr C]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import ipaddress
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.support.paths import REPO_ROOT

LAUNCHER = Path(__file__).resolve().parent / "podlaunch.py"
CLUSTER_DOMAIN = "cluster.local"
KUBELET_VERSION = "v1.33.13"
TERMINATION_MESSAGE_BYTES = 4096
KUBELET_PORT = 10250  # on the bridge address, which is this agent's own: no clash between agents
LEASE_SECONDS = 40
LEASE_RENEW_SECONDS = 10
DEFAULT_GRACE_SECONDS = 30
MAX_BACKOFF_SECONDS = 300.0
BACKOFF_RESET_SECONDS = 600.0
TICK_SECONDS = 0.2
NETNS_PREFIX = "tgpod-"

log = logging.getLogger("nodeagent")


def now_rfc3339() -> str:
    """The current time as Kubernetes writes timestamps (seconds, UTC, ``Z``)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip() or result.stdout.strip()}")


# --- the Kubernetes API ----------------------------------------------------------------------------


class Api:
    """The few API calls the agent makes, on plain dicts (camelCase, as on the wire)."""

    def __init__(self, kubeconfig: Path) -> None:
        from kubernetes import client, config

        self.client = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
        # Typed as Any: the agent passes plain dicts (wire format), which the client accepts as bodies.
        self.core: Any = client.CoreV1Api(self.client)
        self.coordination: Any = client.CoordinationV1Api(self.client)
        self._lock = threading.Lock()

    def plain(self, obj: Any) -> Any:
        """A client model as the dict the API server sent."""
        return self.client.sanitize_for_serialization(obj)

    def is_not_found(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the API server's 404."""
        from kubernetes.client.exceptions import ApiException

        return isinstance(exc, ApiException) and exc.status == 404

    def is_conflict(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the API server's 409."""
        from kubernetes.client.exceptions import ApiException

        return isinstance(exc, ApiException) and exc.status == 409


# --- pod network: a bridge, a network namespace and a veth per pod -----------------------------------


class PodNetwork:
    """The agent's bridge and pod CIDR: gives each pod a network namespace and an address on the bridge."""

    def __init__(self, cidr: str, bridge: str) -> None:
        self.network = ipaddress.ip_network(cidr)
        self.bridge = bridge
        hosts = self.network.hosts()
        self.gateway = str(next(hosts))  # the bridge's own address: the node IP and the DNS server
        self._free = [str(ip) for ip in hosts]
        self._lock = threading.Lock()
        self._serial = 0

    def setup(self) -> None:
        """Create the bridge (after removing what a dead agent of the same name left behind)."""
        self.cleanup_stale()
        with contextlib.suppress(RuntimeError):
            _run("ip", "link", "del", self.bridge)
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/{self.network.prefixlen}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")

    def teardown(self) -> None:
        """Remove the bridge (the pods' namespaces are removed as their pods go)."""
        with contextlib.suppress(RuntimeError):
            _run("ip", "link", "del", self.bridge)

    @staticmethod
    def cleanup_stale() -> None:
        """Remove pod namespaces whose agent (the PID in their name) is gone."""
        netns_dir = Path("/run/netns")
        if not netns_dir.is_dir():
            return
        for entry in netns_dir.iterdir():
            match = re.fullmatch(rf"{NETNS_PREFIX}(\d+)-\d+", entry.name)
            if match and not Path(f"/proc/{match.group(1)}").exists():
                with contextlib.suppress(RuntimeError):
                    _run("ip", "netns", "del", entry.name)

    def allocate(self) -> tuple[str, str]:
        """A new pod sandbox: (network namespace name, pod IP), wired to the bridge."""
        with self._lock:
            if not self._free:
                raise RuntimeError(f"pod CIDR {self.network} is exhausted")
            ip = self._free.pop(0)
            self._serial += 1
            serial = self._serial
        netns = f"{NETNS_PREFIX}{os.getpid()}-{serial}"
        host_veth = f"tgv{os.getpid() % 10000}x{serial}"[:15]
        try:
            _run("ip", "netns", "add", netns)
            _run("ip", "link", "add", host_veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
            _run("ip", "link", "set", host_veth, "master", self.bridge, "up")
            _run("ip", "-n", netns, "addr", "add", f"{ip}/{self.network.prefixlen}", "dev", "eth0")
            _run("ip", "-n", netns, "link", "set", "eth0", "up")
            _run("ip", "-n", netns, "link", "set", "lo", "up")
            _run("ip", "-n", netns, "route", "add", "default", "via", self.gateway)
        except RuntimeError:
            self.release(netns, ip)
            raise
        return netns, ip

    def release(self, netns: str, ip: str) -> None:
        """Remove a pod's namespace (its veth goes with it) and return its address to the pool."""
        with contextlib.suppress(RuntimeError):
            _run("ip", "netns", "del", netns)
        with self._lock:
            self._free.append(ip)


# --- DNS ---------------------------------------------------------------------------------------------

QTYPE_A = 1
QTYPE_AAAA = 28
RCODE_NXDOMAIN = 3
RCODE_SERVFAIL = 2
RCODE_NOTIMP = 4


def parse_query(packet: bytes) -> tuple[int, int, str, int, bytes]:
    """(id, flags, name, qtype, question section) of a DNS query; ValueError if malformed."""
    if len(packet) < 12:
        raise ValueError("short header")
    ident, flags, qdcount = struct.unpack("!HHH", packet[:6])
    if qdcount != 1:
        raise ValueError("expected one question")
    labels, pos = [], 12
    while True:
        if pos >= len(packet):
            raise ValueError("truncated name")
        length = packet[pos]
        pos += 1
        if length == 0:
            break
        if length & 0xC0:
            raise ValueError("compressed name in a question")
        labels.append(packet[pos : pos + length].decode("ascii", "replace"))
        pos += length
    if pos + 4 > len(packet):
        raise ValueError("truncated question")
    qtype = struct.unpack("!H", packet[pos : pos + 2])[0]
    return ident, flags, ".".join(labels).lower(), qtype, packet[12 : pos + 4]


def build_response(ident: int, flags: int, question: bytes, rcode: int, addresses: list[str]) -> bytes:
    """A DNS response: the question echoed, one A record (TTL 5 s) per address."""
    response_flags = 0x8000 | (flags & 0x0100) | 0x0400 | 0x0080 | rcode  # QR, RD copied, AA, RA
    header = struct.pack("!HHHHHH", ident, response_flags, 1, len(addresses), 0, 0)
    answers = b"".join(
        struct.pack("!HHHIH", 0xC00C, QTYPE_A, 1, 5, 4) + socket.inet_aton(ip) for ip in addresses
    )
    return header + question + answers


class ClusterResolver:
    """Names of the cluster domain to pod IPs, read from the API server (cached for a second)."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self._cache: dict[str, tuple[float, list[str] | None]] = {}
        self._lock = threading.Lock()

    def resolve(self, name: str) -> list[str] | None:
        """The A records of ``name``: a list (maybe empty: the name exists, no ready pod), None if unknown."""
        with self._lock:
            cached = self._cache.get(name)
            if cached and time.monotonic() - cached[0] < 1.0:
                return cached[1]
        result = self._lookup(name)
        with self._lock:
            self._cache[name] = (time.monotonic(), result)
        return result

    def _lookup(self, name: str) -> list[str] | None:
        suffix = f".svc.{CLUSTER_DOMAIN}"
        if not name.endswith(suffix):
            return None
        parts = name[: -len(suffix)].split(".")
        if len(parts) == 2:
            service, namespace = parts
            return self._service_ips(namespace, service, hostname=None)
        if len(parts) == 3:
            hostname, service, namespace = parts
            return self._service_ips(namespace, service, hostname=hostname)
        return None

    def _service_ips(self, namespace: str, service: str, hostname: str | None) -> list[str] | None:
        try:
            svc = self.api.plain(self.api.core.read_namespaced_service(service, namespace))
        except Exception as exc:
            if self.api.is_not_found(exc):
                return None
            raise
        selector = svc.get("spec", {}).get("selector") or {}
        if not selector:
            return None if hostname else []
        label_selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        pods = self.api.plain(self.api.core.list_namespaced_pod(namespace, label_selector=label_selector))
        ips = []
        for pod in pods.get("items", []):
            status = pod.get("status", {})
            # As the endpoints of a Service: ready pods only (there is no publishNotReadyAddresses here).
            ready = any(
                c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", [])
            )
            if not ready or not status.get("podIP") or pod["metadata"].get("deletionTimestamp"):
                continue
            if hostname is not None:
                spec = pod.get("spec", {})
                if spec.get("hostname") != hostname or spec.get("subdomain") != service:
                    continue
            ips.append(status["podIP"])
        if hostname is not None and not ips:
            return None
        return sorted(ips)


class DnsServer:
    """A UDP DNS server for the cluster domain, on the bridge address, port 53 (as a pod's resolver)."""

    def __init__(self, address: str, resolver: ClusterResolver) -> None:
        resolve = resolver.resolve

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                data, sock = self.request
                try:
                    ident, flags, name, qtype, question = parse_query(data)
                except ValueError:
                    return
                try:
                    ips = resolve(name)
                except Exception as exc:  # the API server unreachable: SERVFAIL, the client retries
                    log.warning("dns: %s: %s", name, exc)
                    sock.sendto(
                        build_response(ident, flags, question, RCODE_SERVFAIL, []), self.client_address
                    )
                    return
                if ips is None:
                    reply = build_response(ident, flags, question, RCODE_NXDOMAIN, [])
                elif qtype == QTYPE_A:
                    reply = build_response(ident, flags, question, 0, ips)
                else:  # AAAA and the rest: the name exists, no records of that type
                    reply = build_response(ident, flags, question, 0, [])
                sock.sendto(reply, self.client_address)

        socketserver.ThreadingUDPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingUDPServer((address, 53), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="dns", daemon=True)

    def start(self) -> None:
        """Serve on a daemon thread."""
        self.thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.server.shutdown()
        self.server.server_close()


# --- probes ------------------------------------------------------------------------------------------


@dataclass
class ProbeSpec:
    """One probe of a container, with the kubelet's defaults filled in."""

    kind: str  # startup, liveness, readiness
    handler: dict[str, Any]
    initial_delay: float
    period: float
    timeout: float
    success_threshold: int
    failure_threshold: int
    termination_grace: float | None

    @classmethod
    def from_dict(cls, kind: str, probe: dict[str, Any]) -> ProbeSpec:
        """The probe as the API server stored it (it already defaulted most fields)."""
        handler = {k: v for k, v in probe.items() if k in ("httpGet", "tcpSocket", "exec", "grpc")}
        grace = probe.get("terminationGracePeriodSeconds")
        return cls(
            kind=kind,
            handler=handler,
            initial_delay=float(probe.get("initialDelaySeconds", 0)),
            period=float(probe.get("periodSeconds", 10)),
            timeout=float(probe.get("timeoutSeconds", 1)),
            success_threshold=int(probe.get("successThreshold", 1)),
            failure_threshold=int(probe.get("failureThreshold", 3)),
            termination_grace=float(grace) if grace is not None else None,
        )


def _port(value: Any, container: dict[str, Any]) -> int:
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        return int(value)
    for port in container.get("ports", []):
        if port.get("name") == value:
            return int(port["containerPort"])
    raise ValueError(f"no port named {value!r} in container {container.get('name')}")


def run_probe(
    probe: ProbeSpec, pod_ip: str, container: dict[str, Any], exec_in: Callable[[list[str], float], int]
) -> tuple[bool, str]:
    """Run one probe once: (success, a message for the Unhealthy event)."""
    handler = probe.handler
    try:
        if "httpGet" in handler:
            get = handler["httpGet"]
            host = get.get("host") or pod_ip
            port = _port(get.get("port"), container)
            connection_class = (
                http.client.HTTPSConnection
                if get.get("scheme", "HTTP") == "HTTPS"
                else http.client.HTTPConnection
            )
            connection = connection_class(host, port, timeout=probe.timeout)
            try:
                headers = {h["name"]: h["value"] for h in get.get("httpHeaders", [])}
                headers.setdefault("User-Agent", f"kube-probe/{KUBELET_VERSION[1:].rsplit('.', 1)[0]}")
                connection.request("GET", get.get("path", "/"), headers=headers)
                response = connection.getresponse()
                body = response.read(1024).decode(errors="replace").strip()
            finally:
                connection.close()
            if 200 <= response.status < 400:
                return True, ""
            return False, f"HTTP probe failed with statuscode: {response.status} {body}"
        if "tcpSocket" in handler:
            tcp = handler["tcpSocket"]
            with socket.create_connection(
                (tcp.get("host") or pod_ip, _port(tcp.get("port"), container)), timeout=probe.timeout
            ):
                return True, ""
        if "exec" in handler:
            code = exec_in(list(handler["exec"].get("command", [])), probe.timeout)
            return code == 0, f"exec probe exited {code}"
        return False, f"unsupported probe handler {sorted(handler)}"
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return False, f"{probe.kind} probe error: {exc}"


# --- containers --------------------------------------------------------------------------------------


@dataclass
class Terminated:
    """How a container instance ended."""

    exit_code: int
    reason: str
    started_at: float
    finished_at: float
    signal: int | None = None
    message: str = ""

    def as_state(self) -> dict[str, Any]:
        """The ``terminated`` container state."""
        state: dict[str, Any] = {
            "exitCode": self.exit_code,
            "reason": self.reason,
            "startedAt": _rfc3339(self.started_at),
            "finishedAt": _rfc3339(self.finished_at),
        }
        if self.signal:
            state["signal"] = self.signal
        if self.message:
            state["message"] = self.message
        return state


class Container:
    """One container of a pod: its process, probes, restarts and status (a small state machine).

    The pod worker drives it with ``tick()``; probes run on their own threads, as the kubelet's probe
    workers do, and only request a kill.
    """

    def __init__(
        self,
        pod: PodWorker,
        spec: dict[str, Any],
        *,
        init: bool,
        restart_policy: str,
    ) -> None:
        self.pod = pod
        self.spec = spec
        self.name: str = spec["name"]
        self.init = init
        self.sidecar = init and spec.get("restartPolicy") == "Always"
        if self.sidecar:
            self.restart_policy = "Always"
        elif init:  # an init container must succeed once: it is retried on failure unless the pod says Never
            self.restart_policy = "Never" if restart_policy == "Never" else "OnFailure"
        else:
            self.restart_policy = restart_policy
        self.process: subprocess.Popen[bytes] | None = None
        self.instance = 0
        self.restart_count = 0
        self.started_at = 0.0
        self.terminated: Terminated | None = None
        self.last_terminated: Terminated | None = None
        self.waiting_reason = "PodInitializing"
        self.waiting_message = ""
        self.next_start = 0.0
        self.backoff = pod.agent.backoff_base
        self.started = False  # the startup probe succeeded (or there is none) for this instance
        self.ready = False
        self.kill_reason: str | None = None
        self.lock = threading.Lock()
        self.probes = [
            ProbeSpec.from_dict(kind, spec[f"{kind}Probe"])
            for kind in ("startup", "liveness", "readiness")
            if spec.get(f"{kind}Probe")
        ]
        self.done = False  # terminated and will not restart
        self.final = False  # stopped by the pod for good: no restart whatever the policy

    # state

    @property
    def running(self) -> bool:
        """Whether the current instance's process is alive."""
        return self.process is not None and self.terminated is None

    def status(self) -> dict[str, Any]:
        """This container's entry of ``containerStatuses`` / ``initContainerStatuses``."""
        with self.lock:
            if self.running:
                state: dict[str, Any] = {"running": {"startedAt": _rfc3339(self.started_at)}}
            elif self.terminated is not None:
                state = {"terminated": self.terminated.as_state()}
            else:
                waiting: dict[str, Any] = {"reason": self.waiting_reason}
                if self.waiting_message:
                    waiting["message"] = self.waiting_message
                state = {"waiting": waiting}
            last = self.last_terminated
            entry: dict[str, Any] = {
                "name": self.name,
                "image": self.spec.get("image", ""),
                "imageID": "",
                "ready": self.ready,
                "restartCount": self.restart_count,
                "started": self.running and self.started,
                "state": state,
                "lastState": {"terminated": last.as_state()} if last else {},
            }
            if self.process is not None:
                entry["containerID"] = f"process://{self.process.pid}"
            return entry

    # lifecycle

    def start(self) -> None:
        """Start a new instance of the container (the pod worker decides when)."""
        log_path = self.pod.log_dir / f"{self.name}.log"
        try:
            argv, env = self.pod.command_and_env(self.spec)
            spec_file = self.pod.write_launch_spec(self.spec, argv, env)
            self.pod.termination_file(self.name).write_bytes(b"")  # each instance starts with none
        except (
            Exception
        ) as exc:  # a bad reference (missing ConfigMap key, ...): kubelet's CreateContainerConfigError
            with self.lock:
                self.waiting_reason = "CreateContainerConfigError"
                self.waiting_message = str(exc)
                self.next_start = time.monotonic() + self.backoff
            self.pod.event("Warning", "Failed", f"Error: {exc}", self.name)
            return
        with self.lock:
            if self.instance > 0:
                self.restart_count += 1
            self.terminated = None
            self.instance += 1
            self.started = not any(p.kind == "startup" for p in self.probes)
            self.ready = False
            self.kill_reason = None
            self.waiting_message = ""
            self.next_start = 0.0
            with log_path.open("ab") as out:
                out.write(f"--- {now_rfc3339()} start #{self.instance} ---\n".encode())
                out.flush()
                self.process = subprocess.Popen(
                    [sys.executable, str(LAUNCHER), str(spec_file)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.started_at = time.time()
            instance = self.instance
        self.pod.event("Normal", "Started", f"Started container {self.name}", self.name)
        for probe in self.probes:
            threading.Thread(
                target=self._probe_loop,
                args=(probe, instance),
                name=f"probe-{self.name}-{probe.kind}",
                daemon=True,
            ).start()
        with self.lock:  # without a readiness probe a container is ready once it has started
            if not any(p.kind == "readiness" for p in self.probes) and self.started and self.running:
                self.ready = True

    def _probe_loop(self, probe: ProbeSpec, instance: int) -> None:
        started = time.monotonic()
        successes = failures = 0
        time.sleep(probe.initial_delay)
        while True:
            with self.lock:
                if self.instance != instance or not self.running or self.kill_reason:
                    return
                gated = probe.kind != "startup" and not self.started
                if probe.kind == "startup" and self.started:
                    return
            if not gated:
                ok, message = run_probe(probe, self.pod.ip, self.spec, self.pod.exec_in_container(self))
                with self.lock:
                    if self.instance != instance or not self.running:
                        return
                if ok:
                    successes, failures = successes + 1, 0
                    if successes >= probe.success_threshold:
                        if probe.kind == "startup":
                            with self.lock:
                                self.started = True
                                if not any(p.kind == "readiness" for p in self.probes):
                                    self.ready = True
                            self.pod.wake()
                            return
                        if probe.kind == "readiness" and not self.ready:
                            self.ready = True
                            self.pod.wake()
                else:
                    successes, failures = 0, failures + 1
                    self.pod.event(
                        "Warning",
                        "Unhealthy",
                        f"{probe.kind.capitalize()} probe failed: {message}",
                        self.name,
                    )
                    if failures >= probe.failure_threshold:
                        if probe.kind == "readiness":
                            if self.ready:
                                self.ready = False
                                self.pod.wake()
                        else:
                            grace = probe.termination_grace
                            if grace is None:
                                grace = self.pod.grace_period()
                            self.pod.event(
                                "Normal",
                                "Killing",
                                f"Container {self.name} failed {probe.kind} probe, will be restarted",
                                self.name,
                            )
                            self.kill(grace, reason=f"{probe.kind} probe failed")
                            return
            elapsed = time.monotonic() - started
            time.sleep(max(0.05, probe.period - (elapsed % probe.period) if probe.period else 1.0))

    def kill(self, grace: float, reason: str, *, final: bool = False) -> None:
        """SIGTERM the container's process group, SIGKILL after ``grace`` seconds (on a thread).

        ``final``: the pod is stopping this container for good (deleted, or finished), so the restart
        policy does not apply; otherwise (a failed probe) it does.
        """
        with self.lock:
            if final:
                self.final = True
            process = self.process
            if process is None or self.terminated is not None or self.kill_reason is not None:
                return
            self.kill_reason = reason
            self.ready = False

        def terminate() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            self.pod.wake()

        threading.Thread(target=terminate, name=f"kill-{self.name}", daemon=True).start()

    def reap(self) -> bool:
        """Record the exit of the current instance; True when it just ended."""
        with self.lock:
            process = self.process
            if process is None or self.terminated is not None:
                return False
            code = process.poll()
            if code is None:
                return False
            # Whatever the main process left in its group dies with it, as in a container.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            sig = -code if code < 0 else None
            exit_code = 128 + sig if sig else code
            self.terminated = Terminated(
                exit_code=exit_code,
                reason="Completed" if exit_code == 0 else "Error",
                started_at=self.started_at,
                finished_at=time.time(),
                signal=sig,
                message=self._termination_message(exit_code),
            )
            self.ready = False
            self.started = False
            ran = self.terminated.finished_at - self.started_at
            restart = self.restart_policy == "Always" or (
                self.restart_policy == "OnFailure" and exit_code != 0
            )
            if self.pod.deleting or self.final:
                restart = False
            if restart:
                if ran > BACKOFF_RESET_SECONDS:
                    self.backoff = self.pod.agent.backoff_base
                # Waiting in CrashLoopBackOff, the instance that ended shown as the last state.
                self.last_terminated, self.terminated, self.process = self.terminated, None, None
                self.next_start = time.monotonic() + self.backoff
                self.waiting_reason = "CrashLoopBackOff"
                self.waiting_message = (
                    f"back-off {self.backoff:g}s restarting failed container={self.name} pod={self.pod.name}"
                )
                self.backoff = min(self.backoff * 2, MAX_BACKOFF_SECONDS)
            else:
                self.done = True
        log.info("%s/%s: container %s exited %s", self.pod.namespace, self.pod.name, self.name, exit_code)
        if restart:
            self.pod.event(
                "Warning", "BackOff", f"Back-off restarting failed container {self.name}", self.name
            )
        return True

    def _termination_message(self, exit_code: int) -> str:
        """What the container left at its terminationMessagePath (the kubelet keeps 4096 bytes), or with
        ``FallbackToLogsOnError`` and a failure, the end of its output."""
        try:
            data = self.pod.termination_file(self.name).read_bytes()[:TERMINATION_MESSAGE_BYTES]
        except OSError:
            data = b""
        if (
            not data
            and exit_code != 0
            and self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError"
        ):
            try:
                output = log_segment((self.pod.log_dir / f"{self.name}.log").read_bytes(), previous=False)
            except OSError:
                output = b""
            data = tail_lines(output, 80)[-2048:]
        return data.decode(errors="replace")

    def due(self) -> bool:
        """Whether a restart is due now."""
        with self.lock:
            return (
                not self.done
                and self.process is None
                and self.next_start > 0
                and time.monotonic() >= self.next_start
            )


# --- pods --------------------------------------------------------------------------------------------


class PodWorker(threading.Thread):
    """Runs one pod from sandbox to deletion; the only writer of that pod's status."""

    def __init__(self, agent: NodeAgent, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.agent = agent
        self.pod = pod
        self.uid: str = meta["uid"]
        self.name: str = meta["name"]
        self.namespace: str = meta["namespace"]
        self.dir = agent.state_dir / "pods" / f"{self.namespace}_{self.name}_{self.uid[:8]}"
        self.log_dir = agent.state_dir / "pods" / f"{self.namespace}_{self.name}"
        self.netns = ""
        self.ip = ""
        self.phase = "Pending"
        self.reason = ""
        self.message = ""
        self.start_time = now_rfc3339()
        self.init_containers: list[Container] = []
        self.containers: list[Container] = []
        self.mounts: dict[str, Path] = {}
        self.deleting = False
        self.gone = False
        self._wake = threading.Event()
        self._published: str = ""
        self._transitions: dict[tuple[str, str], str] = {}
        self.sandbox_ready = False
        self.initialized = False

    # inputs from the agent's watch

    def update(self, pod: dict[str, Any], deleted: bool = False) -> None:
        """A newer version of the pod (or its removal) from the watch."""
        self.pod = pod
        if deleted:
            self.gone = True
        if pod["metadata"].get("deletionTimestamp") or deleted:
            self.deleting = True
        self.wake()

    def wake(self) -> None:
        """Make the loop run now rather than at the next tick."""
        self._wake.set()

    def grace_period(self) -> float:
        """The pod's termination grace period in seconds."""
        meta_grace = self.pod["metadata"].get("deletionGracePeriodSeconds")
        if meta_grace is not None:
            return float(meta_grace)
        return float(self.pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS))

    # the loop

    def run(self) -> None:
        """Sandbox, init containers, containers, status; then stop everything when the pod is deleted."""
        try:
            self._run()
        except Exception:
            log.exception("%s/%s: pod worker failed", self.namespace, self.name)
        finally:
            self._teardown()

    def _sleep(self, seconds: float = TICK_SECONDS) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def _run(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        spec = self.pod["spec"]
        policy = spec.get("restartPolicy", "Always")
        self.init_containers = [
            Container(self, c, init=True, restart_policy=policy) for c in spec.get("initContainers", [])
        ]
        self.containers = [
            Container(self, c, init=False, restart_policy=policy) for c in spec.get("containers", [])
        ]
        if self.pod["status"].get("phase") in ("Succeeded", "Failed"):
            self.phase = self.pod["status"]["phase"]
            self._await_deletion()
            return
        # The sandbox: network, volumes, hosts and resolv.conf. Volumes may wait (an unbound claim).
        while not self.deleting:
            try:
                self._make_sandbox()
                break
            except Exception as exc:
                self.message = str(exc)
                log.info("%s/%s: sandbox not ready: %s", self.namespace, self.name, exc)
                self.publish()
                self._sleep(2.0)
        self.sandbox_ready = True
        self.message = ""
        self.publish()
        # Init containers, in order.
        for container in self.init_containers:
            if self.deleting:
                break
            container.start()
            while not self.deleting:
                container.reap()
                if container.due():
                    container.start()
                if container.sidecar and container.running and container.started:
                    break
                if not container.sidecar and container.terminated and container.done:
                    break
                self.publish()
                self._sleep()
            if not container.sidecar and container.terminated and container.terminated.exit_code != 0:
                # restartPolicy Never: the pod fails on its first failed init container.
                self.phase, self.reason = "Failed", ""
                self._stop_all()
                self.publish()
                self._await_deletion()
                return
        if not self.deleting:
            self.initialized = True
            for container in self.containers:
                container.start()
            self.phase = "Running"
        while not self.deleting:
            for container in [*self.init_containers, *self.containers]:
                container.reap()
                if container.due() and (container.sidecar or not container.init):
                    container.start()
            regular = self.containers
            if regular and all(c.done for c in regular):
                self.phase = (
                    "Succeeded"
                    if all(c.terminated and c.terminated.exit_code == 0 for c in regular)
                    else "Failed"
                )
                self._stop_sidecars()
                self.publish()
                self._await_deletion()
                return
            self.publish()
            self._sleep()
        self._stop_all()
        self.publish()
        self._finish_deletion()

    def _stop_sidecars(self) -> None:
        grace = self.grace_period()
        for container in reversed(self.init_containers):
            if container.running:
                container.kill(grace, reason="pod finished", final=True)
        self._wait_stopped(self.init_containers, grace + 5)

    def _stop_all(self) -> None:
        grace = self.grace_period()
        for container in self.containers:
            if container.running:
                self.event("Normal", "Killing", f"Stopping container {container.name}", container.name)
                container.kill(grace, reason="pod deleted", final=True)
        self._wait_stopped(self.containers, grace + 5)
        for container in reversed(self.init_containers):
            if container.running:
                container.kill(grace, reason="pod deleted", final=True)
        self._wait_stopped(self.init_containers, grace + 5)

    def _wait_stopped(self, containers: list[Container], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for container in containers:
                container.reap()
            if not any(c.running for c in containers):
                return
            self._sleep()

    def _await_deletion(self) -> None:
        while not self.deleting:
            self._sleep(1.0)
        self._finish_deletion()

    def _finish_deletion(self) -> None:
        if self.gone:
            return
        try:
            self.agent.api.core.delete_namespaced_pod(
                self.name,
                self.namespace,
                grace_period_seconds=0,
                body={"preconditions": {"uid": self.uid}, "gracePeriodSeconds": 0},
            )
        except Exception as exc:
            if not (self.agent.api.is_not_found(exc) or self.agent.api.is_conflict(exc)):
                log.warning("%s/%s: final delete failed: %s", self.namespace, self.name, exc)

    def _teardown(self) -> None:
        for container in [*self.containers, *self.init_containers]:
            if container.running and container.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(container.process.pid, signal.SIGKILL)
                container.reap()
        if self.netns:
            self.agent.network.release(self.netns, self.ip)
            self.netns = ""
        shutil.rmtree(self.dir, ignore_errors=True)
        self.agent.forget(self.uid)

    # sandbox

    def _make_sandbox(self) -> None:
        spec = self.pod["spec"]
        mounts: dict[str, Path] = {}
        volumes_dir = self.dir / "volumes"
        for volume in spec.get("volumes", []):
            mounts[volume["name"]] = self._volume(volume, volumes_dir / volume["name"])
        if not self.netns:
            self.netns, self.ip = self.agent.network.allocate()
        self.mounts = mounts
        hostname = (spec.get("hostname") or self.name)[:63]
        names = [hostname]
        if spec.get("subdomain"):
            names.insert(0, f"{hostname}.{spec['subdomain']}.{self.namespace}.svc.{CLUSTER_DOMAIN}")
        (self.dir / "hosts").write_text(
            "# Kubernetes-managed hosts file (trainguard node agent).\n"
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"{self.ip}\t{' '.join(names)}\n"
        )
        (self.dir / "resolv.conf").write_text(
            f"search {self.namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}\n"
            f"nameserver {self.agent.network.gateway}\noptions ndots:5\n"
        )
        self.hostname = hostname

    def _volume(self, volume: dict[str, Any], own: Path) -> Path:
        api = self.agent.api
        if "emptyDir" in volume:
            own.mkdir(parents=True, exist_ok=True)
            own.chmod(0o777)
            return own
        if "hostPath" in volume:
            path = Path(volume["hostPath"]["path"])
            if volume["hostPath"].get("type") in ("DirectoryOrCreate", None, ""):
                path.mkdir(parents=True, exist_ok=True)
            return path
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            pvc = api.plain(api.core.read_namespaced_persistent_volume_claim(claim, self.namespace))
            if pvc.get("status", {}).get("phase") != "Bound":
                raise RuntimeError(f"persistentvolumeclaim {claim!r} is not bound")
            pv = api.plain(api.core.read_persistent_volume(pvc["spec"]["volumeName"]))
            source = pv["spec"].get("hostPath") or pv["spec"].get("local")
            if not source:
                raise RuntimeError(
                    f"persistentvolume {pv['metadata']['name']}: only hostPath and local are supported"
                )
            path = Path(source["path"])
            path.mkdir(parents=True, exist_ok=True)
            return path
        own.mkdir(parents=True, exist_ok=True)
        files: dict[str, bytes] = {}
        if "configMap" in volume or "secret" in volume:
            files = self._projection(
                {"configMap": volume["configMap"]} if "configMap" in volume else {"secret": volume["secret"]}
            )
        elif "downwardAPI" in volume:
            files = self._projection({"downwardAPI": volume["downwardAPI"]})
        elif "projected" in volume:
            for source in volume["projected"].get("sources", []):
                files.update(self._projection(source))
        else:
            log.warning(
                "%s/%s: volume %s of an unsupported type: an empty directory",
                self.namespace,
                self.name,
                volume["name"],
            )
        for relative, content in files.items():
            target = own / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        return own

    def _projection(self, source: dict[str, Any]) -> dict[str, bytes]:
        api = self.agent.api
        files: dict[str, bytes] = {}
        if "configMap" in source or "secret" in source:
            is_secret = "secret" in source
            ref = source["secret" if is_secret else "configMap"]
            name = ref.get("secretName" if is_secret else "name") or ref.get("name")
            try:
                obj = api.plain(
                    api.core.read_namespaced_secret(name, self.namespace)
                    if is_secret
                    else api.core.read_namespaced_config_map(name, self.namespace)
                )
            except Exception as exc:
                if api.is_not_found(exc) and ref.get("optional"):
                    return {}
                raise
            data = (
                {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
                if is_secret
                else {k: v.encode() for k, v in (obj.get("data") or {}).items()}
            )
            items = ref.get("items")
            if items:
                return {item["path"]: data[item["key"]] for item in items if item["key"] in data}
            return data
        if "downwardAPI" in source:
            for item in source["downwardAPI"].get("items", []):
                if "fieldRef" in item:
                    files[item["path"]] = self.field_ref(item["fieldRef"]["fieldPath"]).encode()
            return files
        if "serviceAccountToken" in source:
            sat = source["serviceAccountToken"]
            account = self.pod["spec"].get("serviceAccountName", "default")
            body = {
                "spec": {
                    "audiences": [sat["audience"]] if sat.get("audience") else [],
                    "expirationSeconds": sat.get("expirationSeconds", 3607),
                    "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": self.name, "uid": self.uid},
                }
            }
            token = api.core.create_namespaced_service_account_token(account, self.namespace, body)
            files[sat.get("path", "token")] = token.status.token.encode()
        return files

    # containers' inputs

    def field_ref(self, path: str) -> str:
        """The downward API value of ``fieldPath``."""
        meta, spec = self.pod["metadata"], self.pod["spec"]
        simple = {
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
            "metadata.uid": self.uid,
            "spec.nodeName": spec.get("nodeName", ""),
            "spec.serviceAccountName": spec.get("serviceAccountName", ""),
            "status.podIP": self.ip,
            "status.podIPs": self.ip,
            "status.hostIP": self.agent.network.gateway,
            "status.hostIPs": self.agent.network.gateway,
        }
        if path in simple:
            return str(simple[path])
        match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if match:
            return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
        if path in ("metadata.labels", "metadata.annotations"):
            values = meta.get(path.split(".")[1]) or {}
            return "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
        raise ValueError(f"unsupported fieldRef {path!r}")

    def command_and_env(self, container: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        """The argv and environment of a container, with ``$(VAR)`` references expanded."""
        system_path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        env: dict[str, str] = {
            "PATH": f"{Path(sys.executable).parent}:{system_path}",
            "HOME": os.environ.get("HOME", "/root"),
            "HOSTNAME": getattr(self, "hostname", self.name),
            "LANG": "C.UTF-8",
            **self.agent.extra_env,
        }
        for source in container.get("envFrom", []):
            ref = source.get("configMapRef") or source.get("secretRef")
            kind = "secret" if "secretRef" in source else "configMap"
            name = ref["name"]
            files = self._projection(
                {
                    kind: ({"secretName": name} if kind == "secret" else {"name": name})
                    | {"optional": ref.get("optional", False)}
                }
            )
            for key, value in files.items():
                env[source.get("prefix", "") + key] = value.decode()
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = expand(item["value"], env)
            elif "valueFrom" in item:
                source = item["valueFrom"]
                if "fieldRef" in source:
                    env[item["name"]] = self.field_ref(source["fieldRef"]["fieldPath"])
                elif "resourceFieldRef" in source:
                    env[item["name"]] = _resource_value(container, source["resourceFieldRef"])
                elif "configMapKeyRef" in source or "secretKeyRef" in source:
                    is_secret = "secretKeyRef" in source
                    ref = source["secretKeyRef" if is_secret else "configMapKeyRef"]
                    files = self._projection(
                        {"secret": {"secretName": ref["name"], "optional": ref.get("optional", False)}}
                        if is_secret
                        else {"configMap": {"name": ref["name"], "optional": ref.get("optional", False)}}
                    )
                    if ref["key"] in files:
                        env[item["name"]] = files[ref["key"]].decode()
                    elif not ref.get("optional"):
                        raise ValueError(
                            f"couldn't find key {ref['key']} in "
                            f"{'Secret' if is_secret else 'ConfigMap'} {ref['name']}"
                        )
            else:
                env[item["name"]] = ""
        argv = [expand(a, env) for a in container.get("command", [])] + [
            expand(a, env) for a in container.get("args", [])
        ]
        if not argv:
            raise ValueError("no command: images are not run here, so the container must say its command")
        return argv, env

    def write_launch_spec(self, container: dict[str, Any], argv: list[str], env: dict[str, str]) -> Path:
        """The spec file ``podlaunch.py`` reads for one start of ``container``."""
        mounts: list[tuple[str, str, bool] | tuple[str, str, bool, bool]] = [
            (str(self.dir / "hosts"), "/etc/hosts", False),
            (str(self.dir / "resolv.conf"), "/etc/resolv.conf", False),
        ]
        termination = container.get("terminationMessagePath") or "/dev/termination-log"
        self.termination_file(container["name"]).touch()
        # Optional: where the host cannot take a mount point there (a read-only /dev), the container
        # runs without a termination message rather than not at all.
        mounts.append((str(self.termination_file(container["name"])), termination, False, True))
        for mount in container.get("volumeMounts", []):
            source = self.mounts.get(mount["name"])
            if source is None:
                raise ValueError(f"volumeMount {mount['name']!r} names no volume of the pod")
            if mount.get("subPath"):
                source = source / mount["subPath"]
                if not source.exists():  # a file of the volume (a ConfigMap key) is mounted as it is
                    source.mkdir(parents=True)
            mounts.append((str(source), mount["mountPath"], bool(mount.get("readOnly", False))))
        spec = {
            "netns": self.netns,
            "hostname": self.hostname,
            "mounts": mounts,
            "cwd": container.get("workingDir") or str(self.agent.workdir),
            "argv": argv,
            "env": env,
        }
        path = self.dir / f"launch-{container['name']}.json"
        path.write_text(json.dumps(spec))
        return path

    def termination_file(self, container: str) -> Path:
        """The host file behind a container's terminationMessagePath."""
        return self.dir / f"termination-{container}"

    def exec_in_container(self, container: Container) -> Callable[[list[str], float], int]:
        """A function that runs a command in ``container``'s namespaces (for exec probes): its exit code."""

        def run(command: list[str], timeout: float) -> int:
            process = container.process
            if process is None:
                return 1
            try:
                result = subprocess.run(
                    ["nsenter", "-t", str(process.pid), "-n", "-m", "-u", "--", *command],
                    capture_output=True,
                    timeout=timeout,
                    cwd=container.spec.get("workingDir") or str(self.agent.workdir),
                )
            except subprocess.TimeoutExpired:
                return 1
            return result.returncode

        return run

    # status and events

    def _condition(self, kind: str, ok: bool, reason: str = "") -> dict[str, Any]:
        value = "True" if ok else "False"
        key = (kind, value)
        if key not in self._transitions:
            self._transitions[key] = now_rfc3339()
            self._transitions.pop((kind, "False" if ok else "True"), None)
        condition = {
            "type": kind,
            "status": value,
            "lastProbeTime": None,
            "lastTransitionTime": self._transitions[key],
        }
        if reason and not ok:
            condition["reason"] = reason
        return condition

    def status(self) -> dict[str, Any]:
        """The pod's status as the kubelet would report it now."""
        terminal = self.phase in ("Succeeded", "Failed")
        sidecars_ready = all(c.ready for c in self.init_containers if c.sidecar) or terminal
        containers_ready = (
            not terminal
            and bool(self.containers)
            and all(c.ready for c in self.containers)
            and sidecars_ready
        )
        not_ready_reason = "PodCompleted" if terminal else "ContainersNotReady"
        status: dict[str, Any] = {
            "phase": self.phase,
            "conditions": [
                self._condition("PodReadyToStartContainers", self.sandbox_ready and not terminal),
                self._condition("Initialized", self.initialized or terminal, "ContainersNotInitialized"),
                self._condition("ContainersReady", containers_ready, not_ready_reason),
                self._condition("Ready", containers_ready, not_ready_reason),
            ],
            "hostIP": self.agent.network.gateway,
            "hostIPs": [{"ip": self.agent.network.gateway}],
            "startTime": self.start_time,
            "containerStatuses": [c.status() for c in self.containers],
            "qosClass": self.pod.get("status", {}).get("qosClass", "BestEffort"),
        }
        if self.init_containers:
            status["initContainerStatuses"] = [c.status() for c in self.init_containers]
        if self.ip:
            status["podIP"] = self.ip
            status["podIPs"] = [{"ip": self.ip}]
        # Null, not absent, once cleared: the status is a strategic merge patch, which keeps absent keys.
        status["message"] = self.message or None
        status["reason"] = self.reason or None
        return status

    def publish(self) -> None:
        """Write the status to the API server when it changed."""
        status = self.status()
        encoded = json.dumps(status, sort_keys=True)
        if encoded == self._published or self.gone:
            return
        try:
            self.agent.api.core.patch_namespaced_pod_status(self.name, self.namespace, {"status": status})
            self._published = encoded
        except Exception as exc:
            if self.agent.api.is_not_found(exc):
                self.gone = True
                self.deleting = True
            else:
                log.warning("%s/%s: status update failed: %s", self.namespace, self.name, exc)

    def event(self, kind: str, reason: str, message: str, container: str | None = None) -> None:
        """Post an Event about this pod (best effort, as the kubelet's)."""
        self.agent.event(self.pod, kind, reason, message, container)


def _resource_value(container: dict[str, Any], ref: dict[str, Any]) -> str:
    resource = ref["resource"]
    section, _, name = resource.partition(".")
    value = str((container.get("resources", {}).get(section) or {}).get(name, "0"))
    if name == "cpu":
        cores = float(value[:-1]) / 1000 if value.endswith("m") else float(value)
        return str(max(1, int(-(-cores // 1))))  # the kubelet rounds CPU up to whole cores by default
    return value


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined variables are replaced, ``$$`` escapes, the rest stays.

    The kubelet's scanner (``third_party/forked/golang/expansion``): ``$(`` opens a reference that runs to
    the next ``)`` whatever it holds, so a name may be any relaxed environment variable name, and an unknown
    or unterminated reference is kept as written.
    """
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
        elif text[i + 1] == "$":  # escaped: `$$` is `$`, and `$$(VAR)` is never expanded
            out.append("$")
            i += 2
        elif text[i + 1] == "(":
            close = text.find(")", i + 2)
            if close < 0:  # unterminated: kept
                out.append("$(")
                i += 2
                continue
            name = text[i + 2 : close]
            out.append(env[name] if name in env else text[i : close + 1])
            i = close + 1
        else:  # a `$` that opens nothing
            out.append("$")
            i += 1
    return "".join(out)


# --- the kubelet API: container logs -------------------------------------------------------------

_INSTANCE_MARK = re.compile(rb"^--- \S+ start #\d+ ---$", re.MULTILINE)


def log_segment(text: bytes, previous: bool) -> bytes:
    """One container instance's output from the agent's log file: the current one, or the one before."""
    marks = list(_INSTANCE_MARK.finditer(text))
    if not marks:
        return text
    index = len(marks) - (2 if previous else 1)
    if index < 0:
        return b""
    start = marks[index].end() + 1
    end = marks[index + 1].start() if index + 1 < len(marks) else len(text)
    return text[start:end]


def tail_lines(data: bytes, lines: int | None) -> bytes:
    """The last ``lines`` lines of ``data`` (all of it when None)."""
    if lines is None:
        return data
    if lines <= 0:
        return b""
    kept = data.splitlines(keepends=True)[-lines:]
    return b"".join(kept)


class KubeletServer:
    """The part of the kubelet's HTTPS API that ``kubectl logs`` uses: ``/containerLogs/NS/POD/CONTAINER``
    (``tailLines``, ``previous``, ``limitBytes``, ``follow``) and ``/healthz``.

    The API server proxies ``kubectl logs`` to the node's address and ``daemonEndpoints`` port. Like a
    kubelet with anonymous auth on, it does not authenticate the caller (the API server does).
    """

    def __init__(self, agent: NodeAgent, address: str, port: int, cert: Path, key: Path) -> None:
        import http.server
        import ssl
        import urllib.parse

        def logs(path: str, query: dict[str, list[str]]) -> tuple[int, bytes, bool, Path | None]:
            parts = path.split("/")
            if len(parts) != 5 or parts[1] != "containerLogs":
                return 404, b"not found\n", False, None
            _, _, namespace, pod, container = parts
            file = agent.state_dir / "pods" / f"{namespace}_{pod}" / f"{container}.log"
            if not file.exists():
                return (
                    404,
                    f"container {container} in pod {namespace}/{pod} has no logs\n".encode(),
                    False,
                    None,
                )
            previous = query.get("previous", ["false"])[0] == "true"
            text = log_segment(file.read_bytes(), previous)
            lines = int(query["tailLines"][0]) if "tailLines" in query else None
            body = tail_lines(text, lines)
            if "limitBytes" in query:
                body = body[: int(query["limitBytes"][0])]
            follow = query.get("follow", ["false"])[0] == "true" and not previous
            return 200, body, follow, file

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                if url.path == "/healthz":
                    self._reply(200, b"ok")
                    return
                code, body, follow, file = logs(url.path, urllib.parse.parse_qs(url.query))
                if not follow or file is None:
                    self._reply(code, body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self._chunk(body)
                offset = file.stat().st_size
                parts = url.path.split("/")
                while not agent.stopping.is_set() and agent.container_running(parts[2], parts[3], parts[4]):
                    time.sleep(0.5)
                    size = file.stat().st_size
                    if size > offset:
                        with file.open("rb") as handle:
                            handle.seek(offset)
                            self._chunk(handle.read(size - offset))
                        offset = size
                self._chunk(b"")

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _reply(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                log.debug("kubelet api: " + format, *args)

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(cert), str(key))
        self.server = http.server.ThreadingHTTPServer((address, port), Handler)
        self.server.daemon_threads = True
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, name="kubelet-api", daemon=True)

    def start(self) -> None:
        """Serve on a daemon thread."""
        self.thread.start()

    def stop(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()


def serving_certificate(directory: Path, address: str) -> tuple[Path, Path]:
    """A self-signed serving certificate for ``address`` (as a kubelet makes when it has none)."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "kubelet.crt", directory / "kubelet.key"
    _run(
        "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=trainguard-node",
        "-addext", f"subjectAltName=IP:{address}",
    )  # fmt: skip
    return cert, key


# --- the agent ---------------------------------------------------------------------------------------


class NodeAgent:
    """Registers the node, keeps its lease, serves DNS and runs a PodWorker per pod bound to the node."""

    def __init__(
        self,
        api: Api,
        node_name: str,
        state_dir: Path,
        network: PodNetwork,
        workdir: Path,
        backoff_base: float = 10.0,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.api = api
        self.node_name = node_name
        self.state_dir = state_dir
        self.network = network
        self.workdir = workdir
        self.backoff_base = backoff_base
        self.extra_env = extra_env or {}
        self.workers: dict[str, PodWorker] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.dns: DnsServer | None = None
        self.kubelet: KubeletServer | None = None

    # node and lease

    def register(self) -> None:
        """Create (or take over) the Node object and mark it Ready."""
        labels = {
            "kubernetes.io/hostname": self.node_name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
        }
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node_name, "labels": labels}}
        try:
            self.api.core.create_node(body)
        except Exception as exc:
            if not self.api.is_conflict(exc):
                raise
        self._node_status()

    def _node_status(self) -> None:
        stamp = now_rfc3339()
        capacity = {"cpu": "64", "memory": "256Gi", "pods": "110", "ephemeral-storage": "100Gi"}

        def condition(kind: str, value: str, reason: str, message: str) -> dict[str, str]:
            return {
                "type": kind,
                "status": value,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": self._node_since,
            }

        status = {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [
                condition(
                    "MemoryPressure",
                    "False",
                    "KubeletHasSufficientMemory",
                    "kubelet has sufficient memory available",
                ),
                condition(
                    "DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"
                ),
                condition(
                    "PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"
                ),
                condition("Ready", "True", "KubeletReady", "trainguard node agent is posting ready status"),
            ],
            "addresses": [
                {"type": "InternalIP", "address": self.network.gateway},
                {"type": "Hostname", "address": self.node_name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": KUBELET_PORT}},
            "nodeInfo": {
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
                "kernelVersion": os.uname().release,
                "osImage": "trainguard node agent",
                "containerRuntimeVersion": "process://0",
                "kubeletVersion": KUBELET_VERSION,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }
        self.api.core.patch_node_status(self.node_name, {"status": status})

    _node_since = now_rfc3339()

    def _lease_loop(self) -> None:
        from kubernetes.client.exceptions import ApiException

        name, namespace = self.node_name, "kube-node-lease"
        last_status = time.monotonic()
        while not self.stopping.is_set():
            now_micro = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {
                    "holderIdentity": name,
                    "leaseDurationSeconds": LEASE_SECONDS,
                    "renewTime": now_micro,
                },
            }
            try:
                try:
                    self.api.coordination.patch_namespaced_lease(name, namespace, {"spec": body["spec"]})
                except ApiException as exc:
                    if exc.status != 404:
                        raise
                    self.api.coordination.create_namespaced_lease(namespace, body)
                if time.monotonic() - last_status > 60:
                    self._node_status()
                    last_status = time.monotonic()
            except Exception as exc:
                log.warning("lease renewal failed: %s", exc)
            self.stopping.wait(LEASE_RENEW_SECONDS)

    # pods

    def forget(self, uid: str) -> None:
        """Drop a finished pod worker."""
        with self.lock:
            self.workers.pop(uid, None)

    def _handle(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        with self.lock:
            worker = self.workers.get(uid)
            if worker is None:
                if kind == "DELETED":
                    return
                worker = PodWorker(self, pod)
                self.workers[uid] = worker
                worker.start()
                return
        worker.update(pod, deleted=kind == "DELETED")

    def _watch_pods(self) -> None:
        from kubernetes import watch

        selector = f"spec.nodeName={self.node_name}"
        while not self.stopping.is_set():
            try:
                listing = self.api.core.list_pod_for_all_namespaces(field_selector=selector)
                version = listing.metadata.resource_version
                seen = set()
                for item in listing.items:
                    pod = self.api.plain(item)
                    seen.add(pod["metadata"]["uid"])
                    self._handle("ADDED", pod)
                with self.lock:
                    vanished = [w for uid, w in self.workers.items() if uid not in seen]
                for worker in vanished:
                    worker.update(worker.pod, deleted=True)
                stream = watch.Watch().stream(  # type: ignore[no-untyped-call]
                    self.api.core.list_pod_for_all_namespaces,
                    field_selector=selector,
                    resource_version=version,
                    timeout_seconds=300,
                    allow_watch_bookmarks=True,
                )
                for event in stream:
                    if self.stopping.is_set():
                        return
                    kind = event["type"]
                    if kind == "ERROR":
                        break
                    if kind == "BOOKMARK":
                        continue
                    self._handle(kind, event["raw_object"])
            except Exception as exc:
                if not self.stopping.is_set():
                    log.warning("pod watch: %s; relisting", exc)
                    self.stopping.wait(1.0)

    def event(self, pod: dict[str, Any], kind: str, reason: str, message: str, container: str | None) -> None:
        """Post an Event about ``pod`` from this node's kubelet (best effort)."""
        meta = pod["metadata"]
        stamp = now_rfc3339()
        involved: dict[str, Any] = {
            "kind": "Pod",
            "apiVersion": "v1",
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
        }
        if container:
            involved["fieldPath"] = f"spec.containers{{{container}}}"
        body = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": involved,
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": "kubelet", "host": self.node_name},
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
            "reportingComponent": "kubelet",
            "reportingInstance": self.node_name,
        }
        try:
            self.api.core.create_namespaced_event(meta["namespace"], body)
        except Exception as exc:
            log.debug("event %s for %s/%s not posted: %s", reason, meta["namespace"], meta["name"], exc)

    def container_running(self, namespace: str, pod: str, container: str) -> bool:
        """Whether that container of a pod on this node is running now."""
        with self.lock:
            workers = [w for w in self.workers.values() if (w.namespace, w.name) == (namespace, pod)]
        return any(
            c.name == container and c.running for w in workers for c in [*w.init_containers, *w.containers]
        )

    # run

    def run(self) -> None:
        """Until ``stop()``: node, lease, DNS, the kubelet API, pods."""
        self.network.setup()
        self.dns = DnsServer(self.network.gateway, ClusterResolver(self.api))
        self.dns.start()
        cert, key = serving_certificate(self.state_dir / "pki", self.network.gateway)
        self.kubelet = KubeletServer(self, self.network.gateway, KUBELET_PORT, cert, key)
        self.kubelet.start()
        self.register()
        threading.Thread(target=self._lease_loop, name="lease", daemon=True).start()
        log.info(
            "node %s ready: pods on %s, DNS on %s:53",
            self.node_name,
            self.network.network,
            self.network.gateway,
        )
        print(f"nodeagent: node {self.node_name} ready", flush=True)
        self._watch_pods()

    def stop(self) -> None:
        """Kill every pod's processes, release the network, stop DNS (the Node stays, as after a kubelet
        stop)."""
        self.stopping.set()
        with self.lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.deleting = True
            worker.gone = True
            worker.wake()
        for worker in workers:
            worker.join(timeout=15)
        if self.dns is not None:
            self.dns.stop()
        if self.kubelet is not None:
            self.kubelet.stop()
        self.network.teardown()


def main(argv: Iterable[str] | None = None) -> int:
    """Run the agent until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--state-dir", type=Path, required=True, help="pod directories and logs")
    parser.add_argument("--node-name", default="trainguard-node")
    parser.add_argument(
        "--pod-cidr",
        default="",
        help="the pods' addresses (default: a random /24 in 10.200.0.0/13, so two agents rarely collide)",
    )
    parser.add_argument("--bridge", default="", help="bridge name (default: tgbr<pid>)")
    parser.add_argument("--workdir", type=Path, default=REPO_ROOT, help="the working directory of containers")
    parser.add_argument("--backoff-base", type=float, default=10.0, help="restart back-off start (s)")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE given to every container")
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if os.geteuid() != 0:
        print("nodeagent: must run as root (network and mount namespaces, port 53)", file=sys.stderr)
        return 2
    cidr = args.pod_cidr or f"10.{random.randint(200, 207)}.{random.randint(0, 255)}.0/24"
    bridge = args.bridge or f"tgbr{os.getpid()}"[:15]
    extra_env = dict(item.split("=", 1) for item in args.env)
    agent = NodeAgent(
        Api(args.kubeconfig),
        args.node_name,
        args.state_dir.resolve(),
        PodNetwork(cidr, bridge),
        args.workdir.resolve(),
        backoff_base=args.backoff_base,
        extra_env=extra_env,
    )

    def on_signal(*_: Any) -> None:
        agent.stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    runner = threading.Thread(target=agent.run, name="agent", daemon=True)
    runner.start()
    while runner.is_alive() and not agent.stopping.is_set():
        agent.stopping.wait(0.5)
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

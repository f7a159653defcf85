"""A real Kubernetes node for the test cluster: containerd, the kubelet, kube-proxy and CoreDNS.

On a control plane of ``controlplane`` (whose binaries ``scripts/control-plane.sh`` builds, kubelet,
kube-proxy and CoreDNS included) this starts, as root, one node named NODE_NAME:

- **containerd** (Debian's), with its own state and socket (RUNTIME_DIR) and its own root, kept between
  runs in the cache (``containerd_root()``: an image is unpacked once), its CRI plugin set up
  for this machine: ``restrict_oom_score_adj`` (the machine refuses a negative ``oom_score_adj``, even to
  root), runc through ``io.containerd.runc.v2``, cgroupfs, the pause image of ``scripts/images.sh`` as
  the sandbox image, CNI from Debian's plugins in ``/usr/lib/cni``. The images of ``scripts/images.sh``
  are imported into it (``ctr -n k8s.io images import``) before the kubelet starts; it pulls from a
  registry only where ``Node.trust_registry`` wrote the registry's hosts file (a test's registry);
- **the network**: a bridge BRIDGE with the node's address NODE_IP (the pods' gateway: an address
  outside 127/8, which the kubelet needs), the CNI ``bridge`` plugin with ``host-local`` addresses in
  POD_CIDR, IP forwarding, and two guards that keep every packet on this machine: the Service range is
  routed onto the bridge (a ClusterIP no rule rewrote goes nowhere), and nothing from the pods is
  forwarded out of it;
- **the kubelet** (cgroupfs driver, cgroup v1 allowed), registered to the API server with a client
  certificate (user ``system:node:<name>``, bound to the ``system:node`` ClusterRole); it authenticates
  the API server by our CA (``kubectl logs``/``exec``); image garbage collection and disk eviction are
  off, so the imported images stay;
- **kube-proxy** (iptables mode, user ``system:kube-proxy``, which the default RBAC binds);
- **CoreDNS** as a static pod in ``kube-system`` on the host network (it reaches the API server on
  127.0.0.1 with its own client certificate and a ClusterRole to read Services, EndpointSlices and
  Namespaces), behind the ``kube-dns`` Service at CLUSTER_DNS_IP, answering ``cluster.local`` only
  (nothing is forwarded off the machine).

One node at a time runs on a machine (kube-proxy's iptables chains and the bridge are the machine's):
a lock in /run serialises them. ``stop()`` deletes the node's pods through the API and waits until the
kubelet has torn them down, then stops kube-proxy, the kubelet and containerd by PID (and the shims of
this containerd, found by its socket), unmounts what they left, removes kube-proxy's rules, the bridge,
the routes and the rules, and restores IP forwarding.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support import controlplane, images
from tests.support.controlplane import ControlPlane, ControlPlaneError, Process
from tests.support.ports import free_ports

NODE_NAME = "trainguard-node"
BRIDGE = "tg-cni0"
POD_CIDR = "10.88.0.0/24"
NODE_IP = controlplane.NODE_IP  # the pods' gateway; the API server advertises it
CLUSTER_DNS_IP = "10.0.0.10"
CLUSTER_DOMAIN = "cluster.local"
DNS_PORT = 1053  # CoreDNS's port on the node: non-root, so not 53; the kube-dns Service maps 53 to it
CNI_BIN_DIR = Path("/usr/lib/cni")
NODE_LOCK = Path("/run/trainguard-node.lock")
# containerd's state and sockets and the kubelet's root: a fixed place, so a start finds what a killed run
# left (its shims, its mounts).
RUNTIME_DIR = Path("/run/trainguard-node")
NODE_BINARIES = ("kubelet", "kube-proxy")
PACKAGES = {
    "containerd": "containerd",
    "ctr": "containerd",
    "runc": "runc",
    "iptables": "iptables",
    "conntrack": "conntrack",
    "ip": "iproute2",
}


class NodeError(ControlPlaneError):
    """The node could not be started or stopped; the message says which part and why."""


def why_not_runnable(bin_dir: Path) -> str | None:
    """Why a node cannot run on this machine (None if it can): root, packages, binaries, images."""
    if os.geteuid() != 0:
        return "the test node needs root (containerd, network, cgroups)"
    missing = sorted({pkg for tool, pkg in PACKAGES.items() if shutil.which(tool) is None})
    if not (CNI_BIN_DIR / "bridge").exists():
        missing.append("containernetworking-plugins")
    if missing:
        return f"missing Debian packages {', '.join(missing)}: bash scripts/control-plane.sh installs them"
    absent = [name for name in NODE_BINARIES if not os.access(bin_dir / name, os.X_OK)]
    if absent:
        return f"{', '.join(absent)} not built in {bin_dir}: run bash scripts/control-plane.sh"
    if not images.references():
        return f"the images are not built ({images.manifest_path()}): run bash scripts/images.sh"
    return None


def _run(*argv: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise NodeError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def _wait(
    what: str, probe: Callable[[], tuple[bool, str]], processes: list[Process], timeout: float
) -> float:
    """Poll ``probe`` until it holds; fail fast if one of ``processes`` exits. Returns seconds waited."""
    started = time.monotonic()
    last = ""
    while time.monotonic() - started < timeout:
        ok, last = probe()
        if ok:
            return time.monotonic() - started
        for process in processes:
            if not process.alive():
                raise NodeError(f"{process.name} exited before {what}:\n{process.log_tail()}")
        time.sleep(0.2)
    tails = "\n".join(f"--- {p.name} ---\n{p.log_tail(20)}" for p in processes)
    raise NodeError(f"{what} not reached in {timeout:.0f} s (last: {last})\n{tails}")


@dataclass
class Node:
    """A running test node: its processes, where its state is, and how to stop it."""

    plane: ControlPlane
    state_dir: Path
    images: dict[str, str]  # name: reference (tests.support.images)
    containerd: Process
    kubelet: Process
    kube_proxy: Process
    startup_seconds: dict[str, float] = field(default_factory=dict)
    _lock: Any = None
    _forwarding: str = "0"

    @property
    def socket(self) -> Path:
        """containerd's socket."""
        return RUNTIME_DIR / "containerd.sock"

    @property
    def pod_logs_dir(self) -> Path:
        """Where the kubelet keeps container logs (``<namespace>_<pod>_<uid>/<container>/<n>.log``)."""
        return self.state_dir / "pod-logs"

    @property
    def registries_dir(self) -> Path:
        """containerd's registry hosts configuration (``<host>/hosts.toml``), read at each pull."""
        return self.state_dir / "registries"

    def trust_registry(self, host: str) -> None:
        """Let the node pull from the registry at ``host`` (``ADDRESS:PORT``) over plain HTTP: a test's
        registry on this machine, which has no certificate."""
        directory = self.registries_dir / host
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "hosts.toml").write_text(
            f'server = "http://{host}"\n\n[host."http://{host}"]\n  capabilities = ["pull", "resolve"]\n'
        )

    def processes(self) -> list[Process]:
        """The node's processes, in order of start."""
        return [self.containerd, self.kubelet, self.kube_proxy]

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``ctr`` against this node's containerd, namespace ``k8s.io`` (the kubelet's)."""
        return _run("ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args, check=check)

    def log_tails(self, lines: int = 20) -> str:
        """The end of each process's log, for failure messages."""
        return "\n".join(f"--- {p.name} ---\n{p.log_tail(lines)}" for p in self.processes())

    def stop(self) -> None:
        """Tear the node down: its pods through the kubelet, then every process and what they set up."""
        try:
            if self.kubelet.alive():
                self._drain()
        finally:
            for process in (self.kube_proxy, self.kubelet):
                process.stop(grace=15)
            self.containerd.stop(grace=15)
            _kill_shims()
            _unmount_below(self.state_dir)
            _unmount_below(RUNTIME_DIR)
            _unmount_below(containerd_root())
            _teardown_network(self.plane.bin_dir, self._forwarding)
            if self._lock is not None:
                self._lock.close()
                self._lock = None

    def _drain(self, timeout: float = 60) -> None:
        """Delete every pod bound to this node (static ones by their manifests) and wait until containerd
        runs no task: the kubelet stops each sandbox, so CNI releases its address and veth."""
        for manifest in (self.state_dir / "manifests").glob("*.yaml"):
            manifest.unlink()
        self.plane.kubectl(
            "delete", "pods", "--all-namespaces", f"--field-selector=spec.nodeName={NODE_NAME}",
            "--grace-period=0", "--force", "--wait=false", check=False, timeout=60,
        )  # fmt: skip

        def idle() -> tuple[bool, str]:
            running = [
                line
                for line in self.ctr("tasks", "list", check=False).stdout.splitlines()[1:]
                if "RUNNING" in line
            ]
            return not running, f"{len(running)} tasks running"

        with contextlib.suppress(NodeError):
            _wait("the node's containers to stop", idle, [self.kubelet], timeout)


def containerd_root() -> Path:
    """containerd's root (content store, unpacked images): kept in the cache between runs, so an image
    is imported and unpacked once. Only the node holding NODE_LOCK uses it."""
    cache = Path(os.environ.get("TRAINGUARD_CACHE") or Path.home() / ".cache" / "trainguard")
    return cache / "containerd"


def _kill_shims() -> None:
    """SIGKILL the runc shims of the node's containerd (found by its socket in their command line): they
    outlive containerd by design, and those of a killed run outlive it too."""
    address = str(RUNTIME_DIR / "containerd.sock").encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and address in argv:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), 9)


def _unmount_below(directory: Path) -> None:
    """Lazily unmount every mount point under ``directory``, deepest first (the kubelet's volumes, the
    overlay snapshots, the sandboxes' shm)."""
    prefix = str(directory.resolve()) + "/"
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1].replace("\\040", " ") for line in mounts]
    for point in sorted({p for p in points if p.startswith(prefix)}, key=len, reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True)


def _iptables_guard(action: str) -> list[str]:
    # Pods reach pods, Services (rewritten to pods before this chain) and the node; nothing else.
    return ["iptables", "-w", action, "FORWARD", "-s", POD_CIDR, "!", "-d", POD_CIDR, "-j", "DROP"]


def _setup_network() -> str:
    """The bridge with the node's address, the guards, forwarding on; returns the old ip_forward."""
    forwarding = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
    prefix = POD_CIDR.split("/")[1]
    if _run("ip", "link", "show", BRIDGE, check=False).returncode != 0:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
    _run("ip", "addr", "replace", f"{NODE_IP}/{prefix}", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    _run("ip", "route", "replace", controlplane.SERVICE_CIDR, "dev", BRIDGE)
    if _run(*_iptables_guard("-C"), check=False).returncode != 0:
        _run(*_iptables_guard("-I"))
    for name, value in (("net/ipv4/ip_forward", "1"), ("net/bridge/bridge-nf-call-iptables", "1")):
        path = Path("/proc/sys") / name
        if not path.exists():
            raise NodeError(f"{path} is missing: kube-proxy cannot route Services between pods here")
        path.write_text(value)
    return forwarding


def _remove_kube_chains() -> None:
    """Remove the iptables chains the kubelet and kube-proxy made (``KUBE-*``, in every table) and the
    rules of the built-in chains that jump to them."""
    for table in ("filter", "nat", "mangle"):
        rules = subprocess.run(["iptables", "-w", "-t", table, "-S"], capture_output=True, text=True).stdout
        chains = [line.split()[1] for line in rules.splitlines() if line.startswith("-N KUBE-")]
        for line in rules.splitlines():
            words = line.split()
            if (
                words[:1] == ["-A"]
                and not words[1].startswith("KUBE-")
                and any(w.startswith("KUBE-") for w in words)
            ):
                subprocess.run(["iptables", "-w", "-t", table, "-D", *words[1:]], capture_output=True)
        for flag in ("-F", "-X"):
            for chain in chains:
                subprocess.run(["iptables", "-w", "-t", table, flag, chain], capture_output=True)


def _teardown_network(bin_dir: Path, forwarding: str) -> None:
    """Undo ``_setup_network`` and the kubelet's and kube-proxy's rules; remove the pods' network
    namespaces left behind."""
    subprocess.run([str(bin_dir / "kube-proxy"), "--cleanup"], capture_output=True)
    _remove_kube_chains()
    while subprocess.run(_iptables_guard("-D"), capture_output=True).returncode == 0:
        pass
    subprocess.run(["ip", "route", "del", controlplane.SERVICE_CIDR, "dev", BRIDGE], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
    _delete_cni_netns()
    with contextlib.suppress(OSError):
        Path("/proc/sys/net/ipv4/ip_forward").write_text(forwarding)


def _delete_cni_netns() -> None:
    """Delete the network namespaces containerd's CRI made for sandboxes (``/var/run/netns/cni-*``): only
    the node holding NODE_LOCK makes them on this machine."""
    for path in Path("/var/run/netns").glob("cni-*"):
        subprocess.run(["ip", "netns", "delete", path.name], capture_output=True)


def _take_lock(timeout: float) -> Any:
    """The machine's node lock (one test node at a time); NodeError naming the holder after ``timeout``."""
    NODE_LOCK.parent.mkdir(parents=True, exist_ok=True)
    handle = NODE_LOCK.open("a+")
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() > deadline:
                handle.seek(0)
                holder = handle.read().strip() or "unknown"
                handle.close()
                raise NodeError(f"another test node runs on this machine ({NODE_LOCK}: {holder})") from None
            time.sleep(1)
            continue
        handle.seek(0)
        handle.truncate()
        handle.write(f"PID {os.getpid()}\n")
        handle.flush()
        return handle


# --- configuration --------------------------------------------------------------------------------


def _containerd_config(cni_dir: Path, sandbox_image: str, registries_dir: Path) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{containerd_root()}"
state = "{RUNTIME_DIR / "state"}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "{RUNTIME_DIR / "containerd.sock"}"
[ttrpc]
  address = "{RUNTIME_DIR / "containerd.sock.ttrpc"}"
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{RUNTIME_DIR / "opt"}"

[{cri}]
  sandbox_image = "{sandbox_image}"
  # This machine refuses a negative oom_score_adj, even to root (runc: "can't get final child's PID
  # from pipe: EOF"): containers get at least containerd's own.
  restrict_oom_score_adj = true
  enable_selinux = false
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni_dir}"
  # One directory per registry host (``Node.trust_registry``), read at each pull.
  [{cri}.registry]
    config_path = "{registries_dir}"
"""


def _cni_config(ipam_dir: Path) -> dict[str, Any]:
    return {
        "cniVersion": "0.4.0",
        "name": "trainguard",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,  # a pod reaches itself through its own Service
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_IP}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(ipam_dir),
                },
            }
        ],
    }


def _kubelet_config(state: Path, pki: Path, port: int, healthz_port: int) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_IP,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(pki / "ca.crt")},
        },
        "authorization": {"mode": "AlwaysAllow"},  # any client our CA signed: the API server
        "cgroupDriver": "cgroupfs",  # PID 1 is not systemd here
        "failCgroupV1": False,  # this machine has cgroup v1
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{RUNTIME_DIR / 'containerd.sock'}",
        "clusterDNS": [CLUSTER_DNS_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(state / "resolv.conf"),  # no search domains nor servers of the host
        "staticPodPath": str(state / "manifests"),
        "podLogsDir": str(state / "pod-logs"),
        "tlsCertFile": str(pki / "kubelet-serving.crt"),
        "tlsPrivateKeyFile": str(pki / "kubelet-serving.key"),
        # The imported images cannot be pulled again: never collect them, never evict for disk.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "serializeImagePulls": False,
        "syncFrequency": "10s",
        "fileCheckFrequency": "2s",
        "nodeStatusUpdateFrequency": "5s",
        "kubeReserved": {},
        "shutdownGracePeriod": "0s",
    }


def _kube_proxy_config(kubeconfig: Path, healthz_port: int, metrics_port: int) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables",
        "clusterCIDR": POD_CIDR,
        "hostnameOverride": NODE_NAME,
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "nodePortAddresses": [f"{NODE_IP}/32"],
        # Leave the machine's conntrack table sizes and timeouts alone.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "iptables": {"syncPeriod": "30s", "minSyncPeriod": "0s"},
    }


def _coredns_pod(image: str, kubeconfig: Path, dns_ttl_seconds: int) -> dict[str, Any]:
    corefile = (
        f"{CLUSTER_DOMAIN}:{DNS_PORT} {{\n"
        f"  bind {NODE_IP}\n"
        f"  errors\n"
        f"  health {NODE_IP}:{DNS_PORT + 1}\n"
        f"  ready {NODE_IP}:{DNS_PORT + 2}\n"
        f"  kubernetes {CLUSTER_DOMAIN} {{\n"
        f"    kubeconfig {kubeconfig.name} trainguard-test\n"
        f"    pods insecure\n"
        f"    ttl {dns_ttl_seconds}\n"
        f"  }}\n"
        f"  cache {dns_ttl_seconds}\n"
        f"}}\n"
    )
    (kubeconfig.parent / "Corefile").write_text(corefile)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "coredns", "namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}},
        "spec": {
            "hostNetwork": True,  # to reach the API server on 127.0.0.1
            "dnsPolicy": "Default",
            "priorityClassName": "system-node-critical",
            "containers": [
                {
                    "name": "coredns",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "args": ["-conf", "/etc/coredns/Corefile"],
                    "workingDir": "/etc/coredns",
                    "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns", "readOnly": True}],
                    "readinessProbe": {
                        "httpGet": {"host": NODE_IP, "port": DNS_PORT + 2, "path": "/ready"},
                        "periodSeconds": 1,
                    },
                    "securityContext": {
                        "runAsNonRoot": True,
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "resources": {"limits": {"memory": "128Mi"}},
                }
            ],
            "volumes": [
                {"name": "config", "hostPath": {"path": str(kubeconfig.parent), "type": "Directory"}}
            ],
        },
    }


def _cluster_objects(user_kubelet: str) -> list[dict[str, Any]]:
    """RBAC for the kubelet and CoreDNS, and the kube-dns Service."""
    coredns_rules = [
        {"apiGroups": [""], "resources": ["services", "pods", "namespaces"], "verbs": ["list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
    ]
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "trainguard-test-node"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "system:node",
            },
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user_kubelet}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "trainguard-test-coredns"},
            "rules": coredns_rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "trainguard-test-coredns"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "trainguard-test-coredns",
            },
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "system:coredns"}],
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}},
            "spec": {
                "clusterIP": CLUSTER_DNS_IP,
                "selector": {"k8s-app": "kube-dns"},
                "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": DNS_PORT},
                    {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": DNS_PORT},
                ],
            },
        },
    ]


def _certificates(pki: Path) -> None:
    """Client certificates of the kubelet, kube-proxy and CoreDNS and the kubelet's serving certificate,
    signed by the control plane's CA (made once per state dir)."""
    marker = pki / ".complete-node-clients"
    if marker.exists():
        return
    leaf = controlplane._leaf
    cert = controlplane._certificate
    cert(pki, "kubelet", f"/O=system:nodes/CN=system:node:{NODE_NAME}", leaf("clientAuth"))
    cert(pki, "kube-proxy", "/CN=system:kube-proxy", leaf("clientAuth"))
    cert(pki, "coredns", "/CN=system:coredns", leaf("clientAuth"))
    cert(pki, "kubelet-serving", f"/CN={NODE_NAME}", leaf("serverAuth", f"IP:{NODE_IP},DNS:{NODE_NAME}"))
    marker.touch()


# --- start ----------------------------------------------------------------------------------------


#: How long CoreDNS answers (and caches a "no such name") for the cluster's names: CoreDNS's own default.
#: A kubeadm cluster's default Corefile says 30 (``ttl 30``, ``cache 30``).
DNS_TTL_SECONDS = 5


def start(
    plane: ControlPlane,
    state_dir: Path,
    *,
    timeout: float = 180.0,
    lock_timeout: float = 600.0,
    dns_ttl_seconds: int = DNS_TTL_SECONDS,
) -> Node:
    """Start containerd, the network, the kubelet, kube-proxy and CoreDNS for ``plane``; return once the
    node is Ready and ``kube-dns`` has an endpoint. NodeError (with the log tails) if a part fails.
    ``dns_ttl_seconds``: CoreDNS's ttl and cache for the cluster's names."""
    reason = why_not_runnable(plane.bin_dir)
    if reason:
        raise NodeError(reason)
    refs = images.references()
    lock = _take_lock(lock_timeout)
    state_dir.mkdir(parents=True, exist_ok=True)
    # What a killed run left: its containers' shims, mounts and containerd state.
    _kill_shims()
    _unmount_below(RUNTIME_DIR)
    _unmount_below(containerd_root())
    _delete_cni_netns()
    shutil.rmtree(RUNTIME_DIR, ignore_errors=True)
    for sub in ("cni", "manifests", "pod-logs", "kubelet", "coredns", "cni-ipam", "registries"):
        (state_dir / sub).mkdir(parents=True, exist_ok=True)
    (state_dir / "resolv.conf").write_text(f"nameserver {CLUSTER_DNS_IP}\n")
    node = Node(
        plane=plane,
        state_dir=state_dir,
        images=refs,
        containerd=Process("containerd", [], state_dir / "containerd.log"),
        kubelet=Process("kubelet", [], state_dir / "kubelet.log"),
        kube_proxy=Process("kube-proxy", [], state_dir / "kube-proxy.log"),
        _lock=lock,
    )
    try:
        _start(node, refs, timeout, dns_ttl_seconds)
    except BaseException:
        node.stop()
        raise
    return node


def _start(node: Node, refs: dict[str, str], timeout: float, dns_ttl_seconds: int) -> None:
    plane, state = node.plane, node.state_dir
    pki = plane.pki
    started = time.monotonic()
    _certificates(pki)
    node._forwarding = _setup_network()
    node.startup_seconds["network"] = time.monotonic() - started

    started = time.monotonic()
    config = state / "containerd.toml"
    config.write_text(_containerd_config(state / "cni", refs["pause"], node.registries_dir))
    (state / "cni" / "10-trainguard.conflist").write_text(json.dumps(_cni_config(state / "cni-ipam")))
    node.containerd.argv = ["containerd", f"--config={config}", "--log-level=warn"]
    node.containerd.start(die_with_parent=True)
    _wait(
        "containerd serving",
        lambda: (node.ctr("version", check=False).returncode == 0, "no answer"),
        [node.containerd],
        60,
    )
    # Containers a killed run left in the kept root (their tasks died with it).
    stale = node.ctr("containers", "list", "--quiet", check=False).stdout.split()
    if stale:
        node.ctr("containers", "delete", *stale, check=False)
    node.startup_seconds["containerd"] = time.monotonic() - started

    started = time.monotonic()
    _run("bash", str(images.IMAGES_SCRIPT), "import", str(node.socket), timeout=900)
    node.startup_seconds["images"] = time.monotonic() - started

    started = time.monotonic()
    plane.kubectl(
        "apply",
        "--server-side",
        "-f",
        "-",
        stdin=yaml.safe_dump_all(_cluster_objects(f"system:node:{NODE_NAME}")),
    )
    kubelet_port, kubelet_healthz, proxy_healthz, proxy_metrics = free_ports(4)
    kubelet_kubeconfig = state / "kubelet" / "kubeconfig"
    controlplane._write_kubeconfig(kubelet_kubeconfig, plane.server, pki, "kubelet")
    config = state / "kubelet" / "config.yaml"
    config.write_text(yaml.safe_dump(_kubelet_config(state, pki, kubelet_port, kubelet_healthz)))
    node.kubelet.argv = [
        str(plane.bin_dir / "kubelet"),
        f"--config={config}",
        f"--kubeconfig={kubelet_kubeconfig}",
        # Under RUNTIME_DIR: the volumes a killed run's kubelet mounted are found and unmounted at the next
        # start.
        f"--root-dir={RUNTIME_DIR / 'kubelet'}",
        f"--hostname-override={NODE_NAME}",
        f"--node-ip={NODE_IP}",
        "--v=1",
    ]
    node.kubelet.start(die_with_parent=True)

    def ready() -> tuple[bool, str]:
        code, body = plane.get(f"/api/v1/nodes/{NODE_NAME}")
        if code != 200:
            return False, f"{code}"
        conditions = json.loads(body).get("status", {}).get("conditions", [])
        ready = [c for c in conditions if c.get("type") == "Ready"]
        return bool(ready) and ready[0].get("status") == "True", json.dumps(ready)

    _wait("the node Ready", ready, [node.containerd, node.kubelet], timeout)
    node.startup_seconds["kubelet"] = time.monotonic() - started

    started = time.monotonic()
    proxy_kubeconfig = state / "kube-proxy.kubeconfig"
    controlplane._write_kubeconfig(proxy_kubeconfig, plane.server, pki, "kube-proxy")
    proxy_config = state / "kube-proxy.yaml"
    proxy_config.write_text(
        yaml.safe_dump(_kube_proxy_config(proxy_kubeconfig, proxy_healthz, proxy_metrics))
    )
    node.kube_proxy.argv = [str(plane.bin_dir / "kube-proxy"), f"--config={proxy_config}", "--v=1"]
    node.kube_proxy.start(die_with_parent=True)
    coredns_kubeconfig = state / "coredns" / "coredns.kubeconfig"
    controlplane._write_kubeconfig(coredns_kubeconfig, plane.server, pki, "coredns")
    for name in ("coredns.crt", "coredns.key", "ca.crt"):  # CoreDNS reads them through its hostPath
        shutil.copy(pki / name, state / "coredns" / name)
    relative = yaml.safe_load(coredns_kubeconfig.read_text())
    relative["clusters"][0]["cluster"]["certificate-authority"] = "/etc/coredns/ca.crt"
    relative["users"][0]["user"] = {
        "client-certificate": "/etc/coredns/coredns.crt",
        "client-key": "/etc/coredns/coredns.key",
    }
    coredns_kubeconfig.write_text(yaml.safe_dump(relative))
    for path in (state / "coredns").iterdir():
        path.chmod(0o644)  # CoreDNS runs as 65532
    (state / "coredns").chmod(0o755)
    (state / "manifests" / "coredns.yaml").write_text(
        yaml.safe_dump(_coredns_pod(refs["coredns"], coredns_kubeconfig, dns_ttl_seconds))
    )

    def dns_served() -> tuple[bool, str]:
        code, body = plane.get(
            "/apis/discovery.k8s.io/v1/namespaces/kube-system/endpointslices?labelSelector="
            "kubernetes.io%2Fservice-name%3Dkube-dns"
        )
        endpoints = [
            e
            for item in (json.loads(body).get("items", []) if code == 200 else [])
            for e in item.get("endpoints") or []
            if (e.get("conditions") or {}).get("ready")
        ]
        return bool(endpoints), f"{code} {len(endpoints)} ready endpoints"

    _wait("kube-dns ready", dns_served, node.processes(), timeout)
    node.startup_seconds["kube-proxy+coredns"] = time.monotonic() - started

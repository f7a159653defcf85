"""A real Kubernetes control plane (etcd + kube-apiserver), for end-to-end tests.

The binaries are built by ``scripts/control-plane.sh`` (cached under ``~/.cache/trainguard/bin``); this
module only runs them:

- a throwaway CA (``openssl``, from Debian's ``openssl`` package) signs etcd's and the API server's
  serving certificates, the API server's etcd client certificate and an admin client certificate
  (``O=system:masters``); an EC key signs service-account tokens;
- etcd serves clients over mutual TLS, its data dir in the state dir; the API server uses RBAC;
- every port is a free one on 127.0.0.1 (a start that loses a port race is retried with new ports); the
  API server listens on every address of the machine, and advertises the test node's (NODE_IP), so pods
  reach it through the `kubernetes` Service; everything else listens on 127.0.0.1 only;
- readiness is etcd's ``/health`` and the API server's ``/readyz``, polled with the admin certificate;
- ``start_cluster`` adds the rest of a small cluster on the same plane (no kubelet, no kube-proxy):
  kube-controller-manager, kube-scheduler (each with its own client certificate and kubeconfig) and the
  Kubeflow training operator (PyTorchJob only, after its CRD), each ready on its own health endpoint;
- everything is stopped by PID (SIGTERM, then SIGKILL after a grace period): the extra components in
  reverse order of start, then the API server, then etcd. The processes also get SIGKILL if the Python
  process that started them dies (``PR_SET_PDEATHSIG``).

Run by hand (``bash scripts/control-plane.sh start`` does this)::

    python tests/controlplane.py --bin-dir DIR [--state-dir DIR] [--components]

prints the kubeconfig path on stdout and runs until Ctrl-C.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support import images, kubeflow
from tests.support.paths import REPO_ROOT
from tests.support.ports import free_ports
from trainer_sidecar.contract.prctl import PR_SET_PDEATHSIG, load_prctl

CONTROL_PLANE_SCRIPT = REPO_ROOT / "scripts" / "control-plane.sh"
PYTORCH_INIT_CONTAINER = REPO_ROOT / "examples" / "k8s" / "pytorch-init-container.yaml"
# The first address of the service range is the `kubernetes` Service's ClusterIP; the serving
# certificate names it, as a real cluster's does.
SERVICE_CIDR = "10.0.0.0/24"
KUBERNETES_SERVICE_IP = "10.0.0.1"
# The test node's address (``node.NODE_IP``: the pods' gateway on its bridge). The API server advertises
# it, so the `kubernetes` Service's endpoint is an address pods reach: an in-cluster client (the
# trainguard operator of the Helm chart) goes to KUBERNETES_SERVICE_IP:443, which kube-proxy rewrites to
# NODE_IP and the API server's port. Without a node the address is not on the machine, and only
# in-cluster clients would miss it.
NODE_IP = "10.88.0.1"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
START_ATTEMPTS = 3
# make_pki's marker: a new name whenever the set of certificates grows, so an older state dir regenerates.
PKI_MARKER = ".complete-node-ip"
CONTROL_PLANE_BINARIES = ("etcd", "kube-apiserver")
COMPONENT_BINARIES = ("kube-controller-manager", "kube-scheduler", "training-operator")
# Controllers left out of kube-controller-manager (names as `kube-controller-manager --help` lists them in
# v1.33): none. The test node's pods have bridge addresses, which Endpoints and EndpointSlices take, and
# kube-proxy routes Services to them.
DISABLED_CONTROLLERS: tuple[str, ...] = ()
TRAINING_OPERATOR_NAMESPACE = "kubeflow"
# What the training operator's cert rotator (open-policy-agent/cert-controller) keeps its webhook CA and
# serving certificate in; it must exist before the operator starts (the rotator only updates it).
WEBHOOK_SECRET = "training-operator-webhook-cert"
# Hard-coded in the operator (pkg/cert): where a pod would mount that Secret. Shared by every operator
# started on this machine; only its webhook server reads it, and nothing here calls that server.
WEBHOOK_CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")


class ControlPlaneError(RuntimeError):
    """The control plane could not be started; the message carries the failing process's log tail."""


def bin_dir_from_script() -> Path:
    """The directory ``scripts/control-plane.sh`` links the binaries into (it builds nothing for this)."""
    out = subprocess.run(
        ["bash", str(CONTROL_PLANE_SCRIPT), "--bin-dir"], check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip())


def missing_binaries(bin_dir: Path, *, components: bool = False) -> list[str]:
    """The control plane binaries that are not (yet) in ``bin_dir``; with ``components``, also those
    ``start_cluster`` runs (controller manager, scheduler, training operator)."""
    names = CONTROL_PLANE_BINARIES + (COMPONENT_BINARIES if components else ())
    return [name for name in names if not os.access(bin_dir / name, os.X_OK)]


def find_kubectl(bin_dir: Path) -> Path:
    """The kubectl the build script chose: the one it built next to the server, else the one on PATH."""
    built = bin_dir / "kubectl"
    if os.access(built, os.X_OK):
        return built
    found = shutil.which("kubectl")
    if found is None:
        raise ControlPlaneError("no kubectl: run bash scripts/control-plane.sh (it builds one if needed)")
    return Path(found)


# --- certificates --------------------------------------------------------------------------------


def _openssl(*args: str) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ControlPlaneError("openssl is not installed (apt-get install openssl)")
    result = subprocess.run([openssl, *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise ControlPlaneError(f"openssl {' '.join(args)} failed:\n{result.stderr}")


def _ec_key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))
    path.chmod(0o600)


def _certificate(
    pki: Path,
    name: str,
    subject: str,
    extensions: dict[str, str],
    *,
    ca: str | None = "ca",
) -> None:
    """``pki/<name>.key`` and ``pki/<name>.crt``: self-signed if ``ca`` is None, else signed by it."""
    key, crt, conf = pki / f"{name}.key", pki / f"{name}.crt", pki / f"{name}.cnf"
    conf.write_text(
        "[req]\ndistinguished_name = dn\n[dn]\n[ext]\n"
        + "".join(f"{k} = {v}\n" for k, v in extensions.items())
    )
    _ec_key(key)
    days = "3650"
    if ca is None:
        _openssl("req", "-x509", "-new", "-key", str(key), "-out", str(crt), "-days", days,
                 "-subj", subject, "-config", str(conf), "-extensions", "ext")  # fmt: skip
        return
    csr = pki / f"{name}.csr"
    _openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", subject, "-config", str(conf))
    _openssl("x509", "-req", "-in", str(csr), "-out", str(crt), "-days", days,
             "-CA", str(pki / f"{ca}.crt"), "-CAkey", str(pki / f"{ca}.key"),
             "-set_serial", str(int.from_bytes(os.urandom(8), "big")),
             "-extfile", str(conf), "-extensions", "ext")  # fmt: skip
    csr.unlink()


def _leaf(usage: str, alt_names: str | None = None) -> dict[str, str]:
    ext = {
        "basicConstraints": "critical,CA:FALSE",
        "keyUsage": "critical,digitalSignature,keyEncipherment",
        "extendedKeyUsage": usage,
    }
    if alt_names:
        ext["subjectAltName"] = alt_names
    return ext


def make_pki(pki: Path) -> None:
    """The CA, serving and client certificates and the service-account key, unless already made."""
    if (pki / PKI_MARKER).exists():
        return
    pki.mkdir(parents=True, exist_ok=True)
    _certificate(
        pki,
        "ca",
        "/CN=trainguard-test-ca",
        {
            "basicConstraints": "critical,CA:TRUE",
            "keyUsage": "critical,keyCertSign,cRLSign,digitalSignature",
            "subjectKeyIdentifier": "hash",
        },
        ca=None,
    )
    loopback = "IP:127.0.0.1,DNS:localhost"
    # etcd's gRPC gateway dials etcd itself with the serving certificate, so it must allow clientAuth.
    _certificate(pki, "etcd-server", "/CN=etcd", _leaf("serverAuth,clientAuth", loopback))
    _certificate(pki, "etcd-client", "/CN=kube-apiserver-etcd-client", _leaf("clientAuth"))
    _certificate(
        pki,
        "apiserver",
        "/CN=kube-apiserver",
        _leaf(
            "serverAuth",
            f"{loopback},IP:{KUBERNETES_SERVICE_IP},IP:{NODE_IP},DNS:kubernetes,DNS:kubernetes.default,"
            "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local",
        ),
    )
    _certificate(pki, "admin", "/O=system:masters/CN=trainguard-admin", _leaf("clientAuth"))
    # The controller manager and scheduler authenticate as the users their default RBAC roles name; for
    # simplicity they are also in system:masters, so no role binding can be missing in a test cluster.
    for component in ("kube-controller-manager", "kube-scheduler"):
        _certificate(pki, component, f"/O=system:masters/CN=system:{component}", _leaf("clientAuth"))
    # The API server's client certificate for kubelets (kubectl logs, exec): a kubelet trusts our CA.
    _certificate(
        pki,
        "apiserver-kubelet-client",
        "/O=system:masters/CN=kube-apiserver-kubelet-client",
        _leaf("clientAuth"),
    )
    _ec_key(pki / "service-account.key")
    _openssl(
        "pkey", "-in", str(pki / "service-account.key"), "-pubout", "-out", str(pki / "service-account.pub")
    )
    (pki / PKI_MARKER).touch()


# --- processes -----------------------------------------------------------------------------------


_PRCTL = load_prctl()  # looked up here, not between fork and exec


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the starting process dies, so nothing outlives a crash."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


@dataclass
class Process:
    """One control plane process: its command, log file and (once started) PID."""

    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    env: dict[str, str] | None = None  # the whole environment; None: this process's

    def start(self, *, die_with_parent: bool) -> None:
        """Start it with stdout and stderr appended to its log file."""
        with self.log.open("ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=REPO_ROOT,  # so that ``python -m tests.support.X`` finds the package
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in a terminal reaches only us; we stop it in order
                preexec_fn=_die_with_parent if die_with_parent else None,
            )

    @property
    def pid(self) -> int:
        """The process ID (the process must have been started)."""
        assert self.popen is not None, f"{self.name} was not started"
        return self.popen.pid

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The end of the log, for error messages."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM by PID, SIGKILL after ``grace`` seconds; returns the exit code (None if never run)."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(grace)
        return self.popen.returncode


def _tls_context(pki: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    return context


def _unverified_context() -> ssl.SSLContext:
    """For the health endpoints of components that serve a self-signed certificate made at start."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def _get(url: str, context: ssl.SSLContext | None) -> tuple[int, str]:
    """Status code and body of a GET; (0, error) when the server does not answer."""
    try:
        with urllib.request.urlopen(url, context=context, timeout=5) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def _wait_until(what: str, ready: Callable[[], tuple[bool, str]], process: Process, timeout: float) -> float:
    """Poll ``ready`` every 0.2 s until it holds; fail fast if ``process`` dies. Returns seconds waited."""
    started = time.monotonic()
    last = ""
    while time.monotonic() - started < timeout:
        ok, last = ready()
        if ok:
            return time.monotonic() - started
        if not process.alive():
            raise ControlPlaneError(
                f"{process.name} exited ({process.popen.returncode if process.popen else '?'}) before "
                f"{what}; last answer: {last}\n--- {process.log} ---\n{process.log_tail()}"
            )
        time.sleep(0.2)
    raise ControlPlaneError(
        f"{what} not reached in {timeout:.0f} s; last answer: {last}\n--- {process.log} ---\n"
        f"{process.log_tail()}"
    )


@dataclass
class ControlPlane:
    """A running etcd + kube-apiserver pair, and how to reach it."""

    bin_dir: Path
    state_dir: Path
    etcd: Process
    apiserver: Process
    server: str
    etcd_url: str
    kubeconfig: Path
    startup_seconds: dict[str, float] = field(default_factory=dict)
    # Extra processes (start_cluster's), in order of start.
    components: list[Process] = field(default_factory=list)

    @property
    def pki(self) -> Path:
        """Where the certificates and keys are."""
        return self.state_dir / "pki"

    def stop(self) -> None:
        """Stop the extra components in reverse order of start, then the API server, then etcd, by PID."""
        for process in reversed(self.components):
            process.stop()
        self.apiserver.stop()
        self.etcd.stop()

    def restart_apiserver(self, down_seconds: float, *, timeout: float = 120.0) -> float:
        """Stop kube-apiserver (SIGTERM, as an upgrade or a crash-looping control plane node does), keep
        it down ``down_seconds`` more, and start it again on the same port and etcd, whose state is
        kept; returns once ``/readyz`` says ok, with the seconds it took to get ready."""
        self.apiserver.stop()
        time.sleep(down_seconds)
        self.apiserver.start(die_with_parent=True)
        context = _tls_context(self.pki)

        def ready() -> tuple[bool, str]:
            code, body = _get(f"{self.server}/readyz", context)
            return code == 200 and body.strip() == "ok", f"{code} {body[-2000:]}"

        return _wait_until("kube-apiserver /readyz after a restart", ready, self.apiserver, timeout)

    def processes(self) -> list[Process]:
        """Every process of this plane, in order of start."""
        return [self.etcd, self.apiserver, *self.components]

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this control plane; raises with its output if ``check`` and it fails."""
        argv = [
            str(find_kubectl(self.bin_dir)),
            f"--kubeconfig={self.kubeconfig}",
            f"--cache-dir={self.state_dir / 'kubectl-cache'}",  # not ~/.kube: nothing outlives the run
            *args,
        ]
        result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
            )
        return result

    def environ(self) -> dict[str, str]:
        """This process's environment with KUBECONFIG pointing here, for clients run as subprocesses."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` for this control plane, as the admin user."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))  # type: ignore[no-untyped-call]

    def get(self, path: str) -> tuple[int, str]:
        """GET a path of the API server as the admin user: (status code, body)."""
        return _get(self.server + path, _tls_context(self.pki))


def _write_kubeconfig(path: Path, server: str, pki: Path, user: str = "admin") -> None:
    """A kubeconfig for ``server`` as the client certificate ``pki/<user>.crt``."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "trainguard-test",
                "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")},
            }
        ],
        "users": [
            {
                "name": f"trainguard-{user}",
                "user": {
                    "client-certificate": str(pki / f"{user}.crt"),
                    "client-key": str(pki / f"{user}.key"),
                },
            }
        ],
        "contexts": [
            {
                "name": "trainguard-test",
                "context": {
                    "cluster": "trainguard-test",
                    "user": f"trainguard-{user}",
                    "namespace": "default",
                },
            }
        ],
        "current-context": "trainguard-test",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)


def _etcd_argv(bin_dir: Path, state: Path, pki: Path, client_port: int, peer_port: int) -> list[str]:
    client, peer = f"https://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [
        str(bin_dir / "etcd"),
        "--name=trainguard",
        f"--data-dir={state / 'etcd'}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=trainguard={peer}",
        f"--cert-file={pki / 'etcd-server.crt'}",
        f"--key-file={pki / 'etcd-server.key'}",
        f"--trusted-ca-file={pki / 'ca.crt'}",
        "--client-cert-auth=true",
        # A throwaway test store: skipping fsync makes every write cheaper; durability is not tested.
        "--unsafe-no-fsync=true",
        "--log-level=warn",
    ]


def _apiserver_argv(bin_dir: Path, pki: Path, etcd_url: str, port: int) -> list[str]:
    return [
        str(bin_dir / "kube-apiserver"),
        # Every address (mutual TLS or a service-account token on each request): the admin's clients use
        # 127.0.0.1, the pods NODE_IP, through the `kubernetes` Service whose endpoint the lease
        # reconciler (the default) keeps at the advertised address.
        "--bind-address=0.0.0.0",
        f"--advertise-address={NODE_IP}",
        f"--secure-port={port}",
        f"--etcd-servers={etcd_url}",
        f"--etcd-cafile={pki / 'ca.crt'}",
        f"--etcd-certfile={pki / 'etcd-client.crt'}",
        f"--etcd-keyfile={pki / 'etcd-client.key'}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-key-file={pki / 'service-account.pub'}",
        f"--service-account-signing-key-file={pki / 'service-account.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-mode=RBAC",
        # Test nodes register no resolvable hostname: reach their kubelet API (kubectl logs) by IP,
        # with a client certificate the kubelet checks against our CA.
        "--kubelet-preferred-address-types=InternalIP",
        f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
        "--profiling=false",
        "--v=1",
    ]


def start(
    bin_dir: Path,
    state_dir: Path,
    *,
    timeout: float = 120.0,
    die_with_parent: bool = True,
) -> ControlPlane:
    """Start etcd and kube-apiserver with state in ``state_dir``; return once ``/readyz`` says ok.

    A start that fails (a port taken between choosing and binding it, say) is retried with fresh ports,
    up to START_ATTEMPTS times; the last failure is raised as ControlPlaneError with the log tail.
    """
    missing = missing_binaries(bin_dir)
    if missing:
        raise ControlPlaneError(
            f"{', '.join(missing)} missing in {bin_dir}: run bash scripts/control-plane.sh"
        )
    state_dir.mkdir(parents=True, exist_ok=True)
    pki = state_dir / "pki"
    started = time.monotonic()
    make_pki(pki)
    pki_seconds = time.monotonic() - started
    error: ControlPlaneError | None = None
    for _ in range(START_ATTEMPTS):
        fresh_store = not (state_dir / "etcd").exists()
        try:
            plane = _start_once(bin_dir, state_dir, timeout=timeout, die_with_parent=die_with_parent)
        except ControlPlaneError as exc:
            error = exc
            if fresh_store:  # the next attempt's etcd must not inherit this one's member and ports
                shutil.rmtree(state_dir / "etcd", ignore_errors=True)
            continue
        plane.startup_seconds["pki"] = pki_seconds
        return plane
    assert error is not None
    raise error


def _start_once(bin_dir: Path, state_dir: Path, *, timeout: float, die_with_parent: bool) -> ControlPlane:
    pki = state_dir / "pki"
    client_port, peer_port, api_port = sorted_free_ports(3)
    etcd_url = f"https://127.0.0.1:{client_port}"
    server = f"https://127.0.0.1:{api_port}"
    context = _tls_context(pki)
    etcd_context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    etcd_context.load_cert_chain(str(pki / "etcd-client.crt"), str(pki / "etcd-client.key"))

    etcd = Process(
        "etcd", _etcd_argv(bin_dir, state_dir, pki, client_port, peer_port), state_dir / "etcd.log"
    )
    apiserver = Process(
        "kube-apiserver", _apiserver_argv(bin_dir, pki, etcd_url, api_port), state_dir / "kube-apiserver.log"
    )
    plane = ControlPlane(
        bin_dir=bin_dir,
        state_dir=state_dir,
        etcd=etcd,
        apiserver=apiserver,
        server=server,
        etcd_url=etcd_url,
        kubeconfig=state_dir / "kubeconfig",
    )
    try:
        etcd.start(die_with_parent=die_with_parent)

        def etcd_healthy() -> tuple[bool, str]:
            code, body = _get(f"{etcd_url}/health", etcd_context)
            return code == 200 and '"health":"true"' in body.replace(" ", ""), f"{code} {body}"

        plane.startup_seconds["etcd"] = _wait_until("etcd /health", etcd_healthy, etcd, timeout)
        apiserver.start(die_with_parent=die_with_parent)

        def apiserver_ready() -> tuple[bool, str]:
            code, body = _get(f"{server}/readyz", context)
            return code == 200 and body.strip() == "ok", f"{code} {body[-2000:]}"

        plane.startup_seconds["kube-apiserver"] = _wait_until(
            "kube-apiserver /readyz", apiserver_ready, apiserver, timeout
        )
    except BaseException:
        plane.stop()
        raise
    _write_kubeconfig(plane.kubeconfig, server, pki)
    return plane


# --- the rest of a cluster: controller manager, scheduler, training operator ----------------------


def _health_check(url: str, context: ssl.SSLContext | None) -> Callable[[], tuple[bool, str]]:
    """A readiness check for ``_wait_until``: ``url`` answers 200 ``ok``."""

    def check() -> tuple[bool, str]:
        code, body = _get(url, context)
        return code == 200 and body.strip() == "ok", f"{code} {body[-2000:]}"

    return check


def _start_component(
    plane: ControlPlane,
    name: str,
    argv: Callable[[list[int]], list[str]],
    ready: Callable[[list[int]], Callable[[], tuple[bool, str]]],
    *,
    ports: int,
    timeout: float,
    die_with_parent: bool,
    env: dict[str, str] | None = None,
) -> Process:
    """Start ``name`` (``argv(ports)``, log ``<state dir>/<name>.log``) and wait until ``ready(ports)`` holds.

    A start whose process exits before it is ready (a port taken between choosing and binding it, say)
    is retried with fresh ports, up to START_ATTEMPTS times; one that is still running at the timeout is
    not. The seconds to ready, over all attempts, go to ``plane.startup_seconds[name]``.
    """
    started = time.monotonic()
    error: ControlPlaneError | None = None
    for _ in range(START_ATTEMPTS):
        chosen = sorted_free_ports(ports)
        process = Process(name, argv(chosen), plane.state_dir / f"{name}.log", env=env)
        process.start(die_with_parent=die_with_parent)
        try:
            _wait_until(f"{name} ready", ready(chosen), process, timeout)
        except ControlPlaneError as exc:
            exited = not process.alive()
            process.stop()
            if not exited:
                raise
            error = exc
            continue
        except BaseException:
            process.stop()
            raise
        plane.startup_seconds[name] = time.monotonic() - started
        return process
    assert error is not None
    raise error


def _component_kubeconfig(plane: ControlPlane, user: str) -> Path:
    """``<state dir>/<user>.kubeconfig``: this plane's API server, as the client certificate ``user``."""
    path = plane.state_dir / f"{user}.kubeconfig"
    _write_kubeconfig(path, plane.server, plane.pki, user)
    return path


def _delegated_auth_flags(kubeconfig: Path, pki: Path) -> list[str]:
    """How the controller manager and scheduler authenticate and authorize callers of their HTTPS port.

    Client certificates are checked against our CA directly, and the lookup of the rest in the
    ``kube-system/extension-apiserver-authentication`` ConfigMap is skipped: this API server has no
    front proxy (no ``--requestheader-client-ca-file``), and the lookup would log an error about the
    missing bundle every few seconds. Authorization is delegated to the API server (SubjectAccessReview);
    ``/healthz``, ``/readyz`` and ``/livez`` are always allowed, also anonymously.
    """
    return [
        f"--authentication-kubeconfig={kubeconfig}",
        "--authentication-skip-lookup=true",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--authorization-kubeconfig={kubeconfig}",
    ]


def _start_kube_component(
    plane: ControlPlane, name: str, flags: list[str], *, timeout: float, die_with_parent: bool
) -> Process:
    """Start kube-controller-manager or kube-scheduler with the flags both take, then ``flags``; return
    it once its ``/healthz`` says ok."""
    kubeconfig = _component_kubeconfig(plane, name)

    def argv(ports: list[int]) -> list[str]:
        return [
            str(plane.bin_dir / name),
            f"--kubeconfig={kubeconfig}",
            *_delegated_auth_flags(kubeconfig, plane.pki),
            "--bind-address=127.0.0.1",
            f"--secure-port={ports[0]}",
            "--leader-elect=false",
            *flags,
            "--profiling=false",
            "--v=1",
        ]

    def ready(ports: list[int]) -> Callable[[], tuple[bool, str]]:
        # It serves a self-signed certificate it made in memory at start: nothing to verify it against.
        return _health_check(f"https://127.0.0.1:{ports[0]}/healthz", _unverified_context())

    return _start_component(
        plane, name, argv, ready, ports=1, timeout=timeout, die_with_parent=die_with_parent
    )


def start_controller_manager(
    plane: ControlPlane, *, timeout: float = 120.0, die_with_parent: bool = True
) -> Process:
    """Start kube-controller-manager against ``plane``; return it once its ``/healthz`` says ok.

    Every on-by-default controller runs (garbage collector, namespace, service account and its tokens,
    persistent-volume binder, node lifecycle, endpoint slices, ...) but DISABLED_CONTROLLERS. The caller
    stops the process (``start_cluster`` hands it to the plane).
    """
    pki = plane.pki
    flags = [
        f"--service-account-private-key-file={pki / 'service-account.key'}",
        f"--root-ca-file={pki / 'ca.crt'}",
        "--use-service-account-credentials=false",
        f"--controllers={','.join(['*', *('-' + c for c in DISABLED_CONTROLLERS)])}",
        # Resync PVs and claims every 5 s rather than 15 s, so a test's claim binds promptly even if it
        # raced its volume.
        "--pvclaimbinder-sync-period=5s",
        # Its default is under /usr/libexec, which it would create on the host.
        f"--flex-volume-plugin-dir={plane.state_dir / 'flexvolume'}",
    ]
    return _start_kube_component(
        plane, "kube-controller-manager", flags, timeout=timeout, die_with_parent=die_with_parent
    )


def start_scheduler(plane: ControlPlane, *, timeout: float = 120.0, die_with_parent: bool = True) -> Process:
    """Start kube-scheduler against ``plane``; return it once its ``/healthz`` says ok."""
    return _start_kube_component(
        plane, "kube-scheduler", [], timeout=timeout, die_with_parent=die_with_parent
    )


def _api_json(plane: ControlPlane, path: str) -> tuple[int, dict[str, Any]]:
    """GET ``path`` as the admin user: (status code, decoded body or {})."""
    code, body = plane.get(path)
    try:
        decoded = json.loads(body)
    except ValueError:
        decoded = {}
    return code, decoded if isinstance(decoded, dict) else {}


def _pytorchjob_crd_served(plane: ControlPlane) -> tuple[bool, str]:
    """The PyTorchJob CRD is Established and ``kubeflow.org/v1`` discovery lists it (the operator's REST
    mapper looks it up once, at start, and exits if it is missing)."""
    code, crd = _api_json(
        plane, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/pytorchjobs.kubeflow.org"
    )
    conditions = {c.get("type"): c.get("status") for c in crd.get("status", {}).get("conditions") or []}
    if conditions.get("Established") != "True":
        return False, f"{code} conditions {conditions}"
    code, group = _api_json(plane, "/apis/kubeflow.org/v1")
    served = {r.get("name") for r in group.get("resources") or []}
    return "pytorchjobs" in served, f"discovery {code} {sorted(str(r) for r in served)}"


def _mount_webhook_secret(plane: ControlPlane, namespace: str) -> str:
    """The kubelet's part for the operator's cert rotator: once the rotator has filled in the webhook
    Secret, copy its ``tls.key`` and ``tls.crt`` into WEBHOOK_CERT_DIR (the rotator waits for
    ``tls.crt`` there before it reports ready). Returns what it found, for error messages."""
    code, secret = _api_json(plane, f"/api/v1/namespaces/{namespace}/secrets/{WEBHOOK_SECRET}")
    data = secret.get("data") or {}
    if code != 200 or "tls.crt" not in data or "tls.key" not in data:
        return f"secret {namespace}/{WEBHOOK_SECRET}: {code}, keys {sorted(data)}"
    WEBHOOK_CERT_DIR.mkdir(parents=True, exist_ok=True)
    for key in ("tls.key", "tls.crt"):  # the certificate last: the rotator polls for it
        content = base64.b64decode(data[key])
        target = WEBHOOK_CERT_DIR / key
        with contextlib.suppress(OSError):
            if target.read_bytes() == content:
                continue
        partial = target.with_name(f".{key}.{os.getpid()}")
        partial.write_bytes(content)
        partial.chmod(0o600)
        os.replace(partial, target)  # atomic, as the kubelet's symlink swap is
    return f"secret {namespace}/{WEBHOOK_SECRET} copied to {WEBHOOK_CERT_DIR}"


def start_training_operator(
    plane: ControlPlane,
    namespace: str = TRAINING_OPERATOR_NAMESPACE,
    *,
    timeout: float = 120.0,
    die_with_parent: bool = True,
) -> Process:
    """Start the Kubeflow training operator (PyTorchJob only) against ``plane``; return it once its
    ``/readyz`` answers 200.

    First the PyTorchJob CRD is applied (server-side; waited for until Established and served), then
    ``namespace`` and the empty webhook Secret the operator's cert rotator fills in. The rotator writes
    the certificates to the Secret only; a pod would get them in WEBHOOK_CERT_DIR through a Secret
    volume, so ``_mount_webhook_secret`` copies them there while the operator starts.

    No ValidatingWebhookConfiguration (``validator.training-operator.kubeflow.org``) is registered: the
    rotator only logs that it is missing and still gets ready, and the API server could not call the
    webhook anyway: it would go through the ``training-operator`` Service's ClusterIP, and this cluster
    has no kube-proxy to route it. So PyTorchJobs are admitted on the CRD's schema alone. The operator
    watches every namespace (no ``--namespace``), as the standalone install does.
    """
    name = "training-operator"
    started = time.monotonic()
    plane.kubectl("apply", "--server-side", "--force-conflicts", f"--filename={kubeflow.pytorchjob_crd()}")
    _wait_until("PyTorchJob CRD established", lambda: _pytorchjob_crd_served(plane), plane.apiserver, timeout)
    plane.startup_seconds["pytorchjob-crd"] = time.monotonic() - started
    setup = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": WEBHOOK_SECRET, "namespace": namespace}},
    ]
    # Server-side apply: certificates the rotator already wrote (an earlier start) are not its fields,
    # so they stay.
    plane.kubectl("apply", "--server-side", "--filename=-", stdin=yaml.safe_dump_all(setup))
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBEFLOW_NAMESPACE")}
    env["MY_POD_NAMESPACE"] = namespace  # where the rotator looks for its Secret
    # The worker init container's image: the test node's (no registry serves the default, alpine).
    init_ref = images.references().get("pytorch-init")
    init_image = [f"--pytorch-init-container-image={init_ref}"] if init_ref else []

    def argv(ports: list[int]) -> list[str]:
        metrics, probe, webhook = ports
        return [
            str(plane.bin_dir / name),
            f"--kubeconfig={plane.kubeconfig}",  # controller-runtime's flag; as the admin user
            f"--metrics-bind-address=127.0.0.1:{metrics}",
            f"--health-probe-bind-address=127.0.0.1:{probe}",
            # The webhook server has no host flag: it listens on every interface, on this port.
            f"--webhook-server-port={webhook}",
            "--enable-scheme=pytorchjob",
            # Worker pods admissible in a namespace enforcing Pod Security "restricted" (see the file).
            f"--pytorch-init-container-template-file={PYTORCH_INIT_CONTAINER}",
            *init_image,
            "--leader-elect=false",
            "--zap-log-level=info",
        ]

    def ready(ports: list[int]) -> Callable[[], tuple[bool, str]]:
        url = f"http://127.0.0.1:{ports[1]}/readyz"

        def check() -> tuple[bool, str]:
            mounted = _mount_webhook_secret(plane, namespace)
            code, body = _get(url, None)
            return code == 200, f"{code} {body[-2000:]}; {mounted}"

        return check

    return _start_component(
        plane, name, argv, ready, ports=3, timeout=timeout, die_with_parent=die_with_parent, env=env
    )


def start_cluster(plane: ControlPlane, *, timeout: float = 120.0, die_with_parent: bool = True) -> None:
    """Start kube-controller-manager, kube-scheduler and the training operator on ``plane``, in that
    order, appending each to ``plane.components`` (``plane.stop()`` stops them) with its time to ready
    in ``plane.startup_seconds``.

    Idempotent: components already running are left alone, so any number of fixtures may call it; one
    that has exited is started again (its log keeps the earlier run's output).
    """
    missing = missing_binaries(plane.bin_dir, components=True)
    if missing:
        raise ControlPlaneError(
            f"{', '.join(missing)} missing in {plane.bin_dir}: run bash scripts/control-plane.sh"
        )
    for process in [p for p in plane.components if not p.alive()]:
        process.stop()  # reap it
        plane.components.remove(process)
    starters: dict[str, Callable[..., Process]] = {
        "kube-controller-manager": start_controller_manager,
        "kube-scheduler": start_scheduler,
        "training-operator": start_training_operator,
    }
    running = {process.name for process in plane.components}
    for name, starter in starters.items():
        if name not in running:
            plane.components.append(starter(plane, timeout=timeout, die_with_parent=die_with_parent))


# --- by hand ---------------------------------------------------------------------------------------


def run_until_stopped(processes: Sequence[Process], stop: threading.Event, prefix: str) -> None:
    """Wait until ``stop`` is set, or set it when one of ``processes`` exits (printing its log tail)."""
    while not stop.wait(1.0):
        for process in processes:
            if not process.alive():
                print(f"{prefix}: {process.name} exited:\n{process.log_tail()}", file=sys.stderr)
                stop.set()


def main(argv: Sequence[str] | None = None) -> int:
    """Start the control plane (with ``--components``, the whole ``start_cluster`` set), print the
    kubeconfig path, and run until SIGINT or SIGTERM."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--bin-dir", type=Path, help="where etcd and kube-apiserver are (default: the script's)"
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="certificates, etcd data, logs and the kubeconfig (kept; reused by the next start); "
        "default: a temp dir removed at exit",
    )
    parser.add_argument(
        "--components",
        action="store_true",
        # scripts/control-plane.sh start passes only --bin-dir and --state-dir: the variable reaches
        # this flag through it.
        default=os.environ.get("TRAINGUARD_CONTROL_PLANE_COMPONENTS") == "1",
        help="also run kube-controller-manager, kube-scheduler and the Kubeflow training operator "
        "(default: on if TRAINGUARD_CONTROL_PLANE_COMPONENTS=1)",
    )
    args = parser.parse_args(argv)
    bin_dir: Path = args.bin_dir or bin_dir_from_script()
    keep = args.state_dir is not None
    state_dir: Path = args.state_dir or Path(tempfile.mkdtemp(prefix="trainguard-control-plane-"))
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop.set())
    missing = missing_binaries(bin_dir, components=args.components)
    if missing:
        print(f"control-plane: {', '.join(missing)} missing in {bin_dir}", file=sys.stderr)
        return 1
    try:
        plane = start(bin_dir, state_dir.resolve(), die_with_parent=True)
    except ControlPlaneError as exc:
        print(f"control-plane: {exc}", file=sys.stderr)
        return 1
    if args.components:
        try:
            start_cluster(plane, die_with_parent=True)
        except ControlPlaneError as exc:
            plane.stop()
            print(f"control-plane: {exc}", file=sys.stderr)
            return 1
    timings = ", ".join(f"{k} {v:.1f} s" for k, v in plane.startup_seconds.items())
    others = "".join(f", {p.name} (PID {p.pid})" for p in plane.components)
    print(
        f"control-plane: kube-apiserver {plane.server} (PID {plane.apiserver.pid}), etcd {plane.etcd_url} "
        f"(PID {plane.etcd.pid}){others}; ready ({timings}); logs in {state_dir}\n"
        f"control-plane: export KUBECONFIG={plane.kubeconfig}    # Ctrl-C stops them all",
        file=sys.stderr,
    )
    print(plane.kubeconfig, flush=True)
    try:
        run_until_stopped(plane.processes(), stop, "control-plane")
    finally:
        plane.stop()
        print("control-plane: stopped", file=sys.stderr)
        if not keep:
            shutil.rmtree(state_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def sorted_free_ports(count: int) -> list[int]:
    """``count`` distinct free ports, ascending."""
    return sorted(free_ports(count))

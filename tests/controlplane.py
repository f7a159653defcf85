"""A real Kubernetes control plane (etcd + kube-apiserver) on 127.0.0.1, for end-to-end tests.

The binaries are built by ``scripts/control-plane.sh`` (cached under ``~/.cache/trainguard/bin``); this
module only runs them:

- a throwaway CA (``openssl``, from Debian's ``openssl`` package) signs etcd's and the API server's
  serving certificates, the API server's etcd client certificate and an admin client certificate
  (``O=system:masters``); an EC key signs service-account tokens;
- etcd serves clients over mutual TLS, its data dir in the state dir; the API server uses RBAC;
- every port is a free one on 127.0.0.1 (a start that loses a port race is retried with new ports);
- readiness is etcd's ``/health`` and the API server's ``/readyz``, polled with the admin certificate;
- everything is stopped by PID (SIGTERM, then SIGKILL after a grace period), the API server first.
  The processes also get SIGKILL if the Python process that started them dies (``PR_SET_PDEATHSIG``).

Run by hand (``bash scripts/control-plane.sh start`` does this)::

    python tests/controlplane.py --bin-dir DIR [--state-dir DIR]

prints the kubeconfig path on stdout and runs until Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import socket
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

ROOT = Path(__file__).resolve().parent.parent
CONTROL_PLANE_SCRIPT = ROOT / "scripts" / "control-plane.sh"
# The first address of the service range is the `kubernetes` Service's ClusterIP; the serving
# certificate names it, as a real cluster's does.
SERVICE_CIDR = "10.0.0.0/24"
KUBERNETES_SERVICE_IP = "10.0.0.1"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
START_ATTEMPTS = 3
PR_SET_PDEATHSIG = 1


class ControlPlaneError(RuntimeError):
    """The control plane could not be started; the message carries the failing process's log tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def bin_dir_from_script() -> Path:
    """The directory ``scripts/control-plane.sh`` links the binaries into (it builds nothing for this)."""
    out = subprocess.run(
        ["bash", str(CONTROL_PLANE_SCRIPT), "--bin-dir"], check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip())


def missing_binaries(bin_dir: Path) -> list[str]:
    """The control plane binaries that are not (yet) in ``bin_dir``."""
    return [name for name in ("etcd", "kube-apiserver") if not os.access(bin_dir / name, os.X_OK)]


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
    if (pki / ".complete").exists():
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
            f"{loopback},IP:{KUBERNETES_SERVICE_IP},DNS:kubernetes,DNS:kubernetes.default,"
            "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local",
        ),
    )
    _certificate(pki, "admin", "/O=system:masters/CN=trainguard-admin", _leaf("clientAuth"))
    _ec_key(pki / "service-account.key")
    _openssl(
        "pkey", "-in", str(pki / "service-account.key"), "-pubout", "-out", str(pki / "service-account.pub")
    )
    (pki / ".complete").touch()


# --- processes -----------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the starting process dies, so nothing outlives a crash."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class Process:
    """One control plane process: its command, log file and (once started) PID."""

    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self, *, die_with_parent: bool) -> None:
        """Start it with stdout and stderr appended to its log file."""
        with self.log.open("ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
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


def _get(url: str, context: ssl.SSLContext) -> tuple[int, str]:
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

    @property
    def pki(self) -> Path:
        """Where the certificates and keys are."""
        return self.state_dir / "pki"

    def stop(self) -> None:
        """Stop the API server, then etcd, each by PID."""
        self.apiserver.stop()
        self.etcd.stop()

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


def _write_kubeconfig(path: Path, server: str, pki: Path) -> None:
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
                "name": "trainguard-admin",
                "user": {
                    "client-certificate": str(pki / "admin.crt"),
                    "client-key": str(pki / "admin.key"),
                },
            }
        ],
        "contexts": [
            {
                "name": "trainguard-test",
                "context": {"cluster": "trainguard-test", "user": "trainguard-admin", "namespace": "default"},
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
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
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
        # The `kubernetes` Service's endpoints would be the advertise address, and Endpoints may not hold
        # a loopback address: the reconciler would log an error every few seconds. Nothing here needs
        # them (in-cluster clients are given the server's address directly).
        "--endpoint-reconciler-type=none",
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
    ports = {free_port() for _ in range(3)}
    while len(ports) < 3:
        ports.add(free_port())
    client_port, peer_port, api_port = sorted(ports)
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


# --- by hand ---------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Start the control plane, print the kubeconfig path, and run until SIGINT or SIGTERM."""
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
    args = parser.parse_args(argv)
    bin_dir: Path = args.bin_dir or bin_dir_from_script()
    keep = args.state_dir is not None
    state_dir: Path = args.state_dir or Path(tempfile.mkdtemp(prefix="trainguard-control-plane-"))
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop.set())
    try:
        plane = start(bin_dir, state_dir.resolve(), die_with_parent=True)
    except ControlPlaneError as exc:
        print(f"control-plane: {exc}", file=sys.stderr)
        return 1
    timings = ", ".join(f"{k} {v:.1f} s" for k, v in plane.startup_seconds.items())
    print(
        f"control-plane: kube-apiserver {plane.server} (PID {plane.apiserver.pid}), etcd {plane.etcd_url} "
        f"(PID {plane.etcd.pid}); ready ({timings}); logs in {state_dir}\n"
        f"control-plane: export KUBECONFIG={plane.kubeconfig}    # Ctrl-C stops both",
        file=sys.stderr,
    )
    print(plane.kubeconfig, flush=True)
    try:
        while not stop.wait(1.0):
            for process in (plane.etcd, plane.apiserver):
                if not process.alive():
                    print(f"control-plane: {process.name} exited:\n{process.log_tail()}", file=sys.stderr)
                    stop.set()
    finally:
        plane.stop()
        print("control-plane: stopped", file=sys.stderr)
        if not keep:
            shutil.rmtree(state_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

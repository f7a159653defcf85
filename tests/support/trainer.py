"""Kubeflow Trainer v2 on the test control plane: the JobSet controller and Trainer's controller manager.

``scripts/trainer.sh`` builds both from the Go module proxy (JobSet v0.12.0, Trainer v2.3.0) and copies
their CRDs, webhook configurations and Trainer's shipped ``torch-distributed`` runtime out of the
modules; this module only runs them, out of cluster, as host processes against the test API server,
each with the admin kubeconfig, as ``controlplane.start_training_operator`` runs the v1 operator:

- the CRDs are applied first (server-side) and waited for until Established and served: both managers
  look their kinds up once, at start;
- both serve admission webhooks that the API server must call: JobSet's defaulter fills in what its
  controller relies on (the success policy, the network's DNS hostnames, ...), its pod webhooks place
  and gate the pods of a JobSet, and Trainer's defaulter and validators check TrainJobs and runtimes.
  Each would make a self-signed CA and rotate it into a Secret for a ``Service`` to reach it; here
  nothing routes a Service to a host process, so their cert management is turned off in their
  configuration files, each serves a certificate for 127.0.0.1 signed by the test CA (the kubelet's job
  of mounting a Secret is a file copy), and the module's webhook configurations are registered with a
  ``url`` to 127.0.0.1 and that CA, so the API server (a host process too) calls them directly;
- each is ready on its own health endpoint's ``/readyz`` (which waits for its webhook server), and keeps
  its log in ``<state dir>/<name>.log``;
- ``Trainer.stop`` removes the webhook configurations first (their failure policy is Fail: a JobSet or
  TrainJob created afterwards would be refused), then stops both by PID.
"""

from __future__ import annotations

import base64
import copy
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support import controlplane
from tests.support.controlplane import ControlPlane, ControlPlaneError, Process
from tests.support.paths import REPO_ROOT

TRAINER_SCRIPT = REPO_ROOT / "scripts" / "trainer.sh"
BINARIES = ("jobset", "trainer-controller-manager")
TRAINER_NAMESPACE = "kubeflow-system"
TRAINER_CRDS = (
    "trainer.kubeflow.org_clustertrainingruntimes.yaml",
    "trainer.kubeflow.org_trainingruntimes.yaml",
    "trainer.kubeflow.org_trainjobs.yaml",
)
JOBSET_CRD = "jobset.x-k8s.io_jobsets.yaml"
TORCH_RUNTIME = "torch_distributed.yaml"
TORCH_RUNTIME_NAME = "torch-distributed"
# The kinds each manager needs served before it starts: CRD name, group/version, plural.
JOBSET_KINDS = (("jobsets.jobset.x-k8s.io", "jobset.x-k8s.io/v1alpha2", "jobsets"),)
TRAINER_KINDS = (
    ("trainjobs.trainer.kubeflow.org", "trainer.kubeflow.org/v1alpha1", "trainjobs"),
    ("trainingruntimes.trainer.kubeflow.org", "trainer.kubeflow.org/v1alpha1", "trainingruntimes"),
    (
        "clustertrainingruntimes.trainer.kubeflow.org",
        "trainer.kubeflow.org/v1alpha1",
        "clustertrainingruntimes",
    ),
)


def _script(flag: str) -> Path:
    out = subprocess.run(["bash", str(TRAINER_SCRIPT), flag], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def bin_dir() -> Path:
    """Where the binaries are: ``TRAINGUARD_TRAINER_BIN`` if set (``.ci/run`` sets it), else the
    directory ``scripts/trainer.sh`` links them into (it builds nothing for this)."""
    configured = os.environ.get("TRAINGUARD_TRAINER_BIN")
    return Path(configured) if configured else _script("--bin-dir")


def trainer_manifests() -> Path:
    """Trainer's CRDs, webhook configurations and torch-distributed runtime, as the script copied them."""
    return _script("--trainer-dir")


def jobset_manifests() -> Path:
    """JobSet's CRD and webhook configurations, as the script copied them."""
    return _script("--jobset-dir")


def why_not_runnable(directory: Path) -> str | None:
    """Why Trainer cannot run here (a binary or manifest not built or fetched), or None."""
    missing = [name for name in BINARIES if not os.access(directory / name, os.X_OK)]
    files = [trainer_manifests() / f for f in (*TRAINER_CRDS, TORCH_RUNTIME, "webhooks.yaml")]
    files += [jobset_manifests() / f for f in (JOBSET_CRD, "webhooks.yaml")]
    missing += [str(path) for path in files if not path.is_file()]
    if missing:
        return f"{', '.join(missing)} missing (in {directory}): run bash scripts/trainer.sh"
    return None


# --- webhooks -----------------------------------------------------------------------------------


def _json_patch(document: dict[str, Any], operations: list[dict[str, Any]]) -> dict[str, Any]:
    """``document`` with the ``add``/``replace`` operations of a JSON patch (what the modules' kustomize
    patches use) applied, on a copy."""
    patched = copy.deepcopy(document)
    for operation in operations:
        if operation.get("op") not in ("add", "replace"):
            raise ValueError(f"unsupported JSON patch operation {operation!r}")
        *parents, last = operation["path"].lstrip("/").split("/")
        target: Any = patched
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            target[int(last)] = operation["value"]
        else:
            target[last] = operation["value"]
    return patched


def webhook_configurations(
    directory: Path, name: str, port: int, ca: bytes, patches: dict[str, str]
) -> list[dict[str, Any]]:
    """The module's webhook configurations (``directory/webhooks.yaml``, with the kustomize patches named
    in ``patches``, by kind) renamed ``name`` and pointed at ``https://127.0.0.1:<port><path>`` with the
    CA bundle ``ca`` instead of their Service."""
    documents = [d for d in yaml.safe_load_all((directory / "webhooks.yaml").read_text()) if d]
    configured = []
    for document in documents:
        patch = patches.get(document["kind"])
        if patch:
            document = _json_patch(document, yaml.safe_load((directory / patch).read_text()))
        document["metadata"] = {"name": name}
        for webhook in document["webhooks"]:
            path = webhook["clientConfig"]["service"]["path"]
            webhook["clientConfig"] = {
                "url": f"https://127.0.0.1:{port}{path}",
                "caBundle": base64.b64encode(ca).decode(),
            }
        configured.append(document)
    return configured


def _serving_certificate(plane: ControlPlane, name: str, cert_dir: Path) -> None:
    """``cert_dir/tls.crt`` and ``tls.key``: a serving certificate for 127.0.0.1 signed by the test CA."""
    pki = plane.pki
    if not (pki / f"{name}.crt").exists():
        leaf = controlplane._leaf("serverAuth", "IP:127.0.0.1,DNS:localhost")
        controlplane._certificate(pki, name, f"/CN={name}", leaf)
    cert_dir.mkdir(parents=True, exist_ok=True)
    for suffix in ("key", "crt"):
        target = cert_dir / f"tls.{suffix}"
        target.write_bytes((pki / f"{name}.{suffix}").read_bytes())
        target.chmod(0o600)


# --- processes ----------------------------------------------------------------------------------

Kinds = tuple[tuple[str, str, str], ...]


def _kinds_served(plane: ControlPlane, kinds: Kinds) -> Callable[[], tuple[bool, str]]:
    """A readiness check: every CRD of ``kinds`` is Established and its group's discovery lists it."""

    def check() -> tuple[bool, str]:
        for crd_name, group_version, plural in kinds:
            path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd_name}"
            code, crd = controlplane._api_json(plane, path)
            conditions = {
                c.get("type"): c.get("status") for c in crd.get("status", {}).get("conditions") or []
            }
            if conditions.get("Established") != "True":
                return False, f"{crd_name}: {code} conditions {conditions}"
            code, group = controlplane._api_json(plane, f"/apis/{group_version}")
            if plural not in {r.get("name") for r in group.get("resources") or []}:
                return False, f"{group_version} discovery {code} lacks {plural}"
        return True, "served"

    return check


def install_crds(plane: ControlPlane, files: list[Path], kinds: Kinds, timeout: float = 120.0) -> float:
    """Apply the CRD ``files`` (server-side) and wait until ``kinds`` are served; returns the seconds."""
    started = time.monotonic()
    for path in files:
        plane.kubectl("apply", "--server-side", "--force-conflicts", f"--filename={path}")
    what = f"{', '.join(kind[0] for kind in kinds)} served"
    controlplane._wait_until(what, _kinds_served(plane, kinds), plane.apiserver, timeout)
    return time.monotonic() - started


def _readyz(port: int) -> Callable[[], tuple[bool, str]]:
    url = f"http://127.0.0.1:{port}/readyz"

    def check() -> tuple[bool, str]:
        code, body = controlplane._get(url, None)
        return code == 200, f"{code} {body[-2000:]}"

    return check


# configuration(probe port, webhook port, cert dir): the manager's configuration file.
Configuration = Callable[[int, int, Path], dict[str, Any]]


def _start_manager(
    plane: ControlPlane, binary: Path, configuration: Configuration, *, timeout: float
) -> tuple[Process, int]:
    """Start ``binary`` with ``--config`` a file of ``configuration(...)`` and its webhook certificate in
    ``<state>/k8s-webhook-server/serving-certs`` (controller-runtime's default directory under TMPDIR,
    which Trainer's configuration cannot set); return it once its ``/readyz`` says 200, with its webhook
    port."""
    name = binary.name
    state = plane.state_dir / name
    cert_dir = state / "k8s-webhook-server" / "serving-certs"
    _serving_certificate(plane, name, cert_dir)
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env["TMPDIR"] = str(state)
    chosen: list[int] = []

    def argv(ports: list[int]) -> list[str]:
        chosen[:] = ports
        config = state / "config.yaml"
        config.write_text(yaml.safe_dump(configuration(ports[0], ports[1], cert_dir)))
        return [
            str(binary),
            f"--kubeconfig={plane.kubeconfig}",  # controller-runtime's flag; as the admin user
            f"--config={config}",
            "--zap-log-level=info",
        ]

    process = controlplane._start_component(
        plane, name, argv, lambda ports: _readyz(ports[0]), ports=2, timeout=timeout,
        die_with_parent=True, env=env,
    )  # fmt: skip
    return process, chosen[1]


def jobset_configuration(probe: int, webhook: int, cert_dir: Path) -> dict[str, Any]:
    """JobSet's configuration (config.jobset.x-k8s.io): no leader election, no metrics, no cert rotation;
    health and webhooks on 127.0.0.1."""
    return {
        "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{probe}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": webhook, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "internalCertManagement": {"enable": False},
    }


def trainer_configuration(probe: int, webhook: int, cert_dir: Path) -> dict[str, Any]:
    """Trainer's configuration (config.trainer.kubeflow.org), as JobSet's; its webhook certificate is in
    controller-runtime's default directory (``cert_dir``)."""
    del cert_dir
    return {
        "apiVersion": "config.trainer.kubeflow.org/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{probe}"},
        "metrics": {"bindAddress": "0", "secureServing": False},
        "webhook": {"port": webhook, "host": "127.0.0.1"},
        "certManagement": {"enable": False},
    }


@dataclass
class Trainer:
    """The JobSet controller and Trainer's controller manager running against one control plane."""

    plane: ControlPlane
    jobset: Process
    manager: Process
    webhooks: list[tuple[str, str]] = field(default_factory=list)  # (kind, name) registered
    startup_seconds: dict[str, float] = field(default_factory=dict)

    def processes(self) -> list[Process]:
        """Both managers, in order of start."""
        return [self.jobset, self.manager]

    def log_tails(self, lines: int = 40) -> str:
        """The end of both logs, for failure messages."""
        return "\n".join(f"--- {p.log} ---\n{p.log_tail(lines)}" for p in self.processes())

    def stop(self) -> None:
        """Remove the webhook configurations, then stop Trainer's manager and JobSet's, by PID."""
        for kind, name in reversed(self.webhooks):
            self.plane.kubectl("delete", kind, name, "--ignore-not-found", check=False)
        self.webhooks.clear()
        self.manager.stop()
        self.jobset.stop()


def _register_webhooks(
    plane: ControlPlane, directory: Path, name: str, port: int, patches: dict[str, str]
) -> list[tuple[str, str]]:
    documents = webhook_configurations(directory, name, port, (plane.pki / "ca.crt").read_bytes(), patches)
    plane.kubectl(
        "apply", "--server-side", "--force-conflicts", "--filename=-", stdin=yaml.safe_dump_all(documents)
    )
    return [(document["kind"].lower(), name) for document in documents]


def start(plane: ControlPlane, directory: Path | None = None, *, timeout: float = 180.0) -> Trainer:
    """Start JobSet's controller, then Trainer's manager, against ``plane`` (binaries in ``directory``,
    default ``bin_dir()``): each after its CRDs are served, each with its webhooks registered once it is
    ready; then apply Trainer's shipped torch-distributed ClusterTrainingRuntime (which Trainer's webhook
    validates). The caller stops it (``Trainer.stop``)."""
    directory = directory or bin_dir()
    reason = why_not_runnable(directory)
    if reason:
        raise ControlPlaneError(reason)
    seconds: dict[str, float] = {}
    jobset_dir, trainer_dir = jobset_manifests(), trainer_manifests()
    seconds["jobset-crd"] = install_crds(plane, [jobset_dir / JOBSET_CRD], JOBSET_KINDS, timeout)
    jobset, port = _start_manager(plane, directory / "jobset", jobset_configuration, timeout=timeout)
    # Until Trainer's manager runs, ``manager`` is JobSet's process too, so that a failed start stops
    # (and unregisters) what ran; stopping a stopped process is a no-op.
    running = Trainer(plane=plane, jobset=jobset, manager=jobset, startup_seconds=seconds)
    try:
        seconds["jobset"] = plane.startup_seconds.get("jobset", 0.0)
        patches = {
            "MutatingWebhookConfiguration": "webhooks-mutating-patch.yaml",
            "ValidatingWebhookConfiguration": "webhooks-validating-patch.yaml",
        }
        running.webhooks += _register_webhooks(plane, jobset_dir, "trainguard-test-jobset", port, patches)
        files = [trainer_dir / crd for crd in TRAINER_CRDS]
        seconds["trainer-crds"] = install_crds(plane, files, TRAINER_KINDS, timeout)
        binary = directory / "trainer-controller-manager"
        running.manager, port = _start_manager(plane, binary, trainer_configuration, timeout=timeout)
        seconds["trainer-controller-manager"] = plane.startup_seconds.get(binary.name, 0.0)
        patches = {"ValidatingWebhookConfiguration": "webhooks-validating-patch.yaml"}
        running.webhooks += _register_webhooks(plane, trainer_dir, "trainguard-test-trainer", port, patches)
        apply_runtime(plane, trainer_dir / TORCH_RUNTIME, timeout)
    except BaseException:
        running.stop()
        raise
    return running


def apply_runtime(plane: ControlPlane, path: Path, timeout: float = 60.0) -> None:
    """Apply a (Cluster)TrainingRuntime; retried while the just registered webhooks are not yet called
    (the API server picks a new webhook configuration up within a second or so)."""
    deadline = time.monotonic() + timeout
    while True:
        result = plane.kubectl(
            "apply", "--server-side", "--force-conflicts", f"--filename={path}", check=False
        )
        if result.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise ControlPlaneError(f"applying {path} failed:\n{result.stdout}\n{result.stderr}")
        time.sleep(1.0)

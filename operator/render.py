"""GuardedTrainingJob -> Kubeflow PyTorchJob (``kubeflow.org/v1``), one per gang attempt. Pure.

An attempt that starts in new pods gets its own PyTorchJob, named after the job and the attempt, owned
by the GuardedTrainingJob, with ``replicas`` Workers and no Master: Worker ``i`` is node rank ``i``, and
Worker 0 is the rendezvous host. Every replica's pod is the user's template with trainguard's pieces
added: the ``trainguard-sidecar`` native sidecar, the status volume, the checkpoint claim, the guardian's
environment, torch.distributed's rendezvous variables, NCCL fail-fast settings, and a liveness probe on
the training container that asks the sidecar. With an order key (restarts in place), the training
container's command also runs under trainguard's launcher, and the sidecar knows the digest of the
PyTorchJob's order token and its signing key: a later attempt can then start in these same pods (see
``reconcile``).

Workers only, deliberately: with a Master replica the training operator (1.9) gives every Worker an init
container that polls the Master's Service name every 2 s until cluster DNS publishes it, which it does
only once the Master pod is Ready. That put the Master's whole start in front of every Worker's: on the
test node a gang restart's new pods took 8 s to their training container with a Master, 1 s without.
Without a Master the pods start side by side and only torch.distributed's own connect waits for Worker 0
(it retries), by then usually long up. The training operator sets ``MASTER_ADDR``, ``RANK`` and
``WORLD_SIZE`` only when there is a Master, so trainguard sets them: the rank from the pod's
replica-index label, through the downward API.

Restart policy ``Never`` on every replica, deliberately: a rank restarted alone (by the kubelet, or by
the training operator's OnFailure/ExitCode policies) cannot rejoin a running collective -- its peers are
blocked in an all-reduce with the old process, or have already torn the communicator down -- so a
single-rank restart only turns a crash into a hang. The trainguard operator owns restarts and always
restarts the whole gang: in its pods, through every rank's launcher at once, or as a fresh PyTorchJob
(see ``reconcile``).
"""

from __future__ import annotations

import copy
import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainguard_operator.inplace import OrderSigner, launcher_command, order_signer, order_wait_seconds
from trainguard_operator.settings import OperatorSettings

from trainer_sidecar.contract.env import ORDER_SIGNING_KEY_ENV, ORDER_TOKEN_DIGEST_ENV, POD_NAME_ENV
from trainer_sidecar.contract.inplace import ORDERABLE_VARIABLES, order_token_digest
from trainer_sidecar.contract.settings import RemediationOrder
from trainer_sidecar.contract.stopping import BROKEN_GANG_GRACE_SECONDS
from trainguard.core.environment import sidecar_environment, worker_environment
from trainguard.core.probes import probe_timing
from trainguard.core.spec import API_VERSION, KIND, WORKER_CONTAINER, GuardedTrainingJob
from trainguard.core.torchrun import NodeLaunch, NotPython, under_torchrun

PYTORCHJOB_GROUP = "kubeflow.org"
PYTORCHJOB_VERSION = "v1"
PYTORCHJOB_PLURAL = "pytorchjobs"
PYTORCHJOB_KIND = "PyTorchJob"
PYTORCHJOB_API_VERSION = f"{PYTORCHJOB_GROUP}/{PYTORCHJOB_VERSION}"

JOB_LABEL = "trainguard.dev/job"
ATTEMPT_LABEL = "trainguard.dev/attempt"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "trainguard-operator"
#: Labels the Kubeflow training operator puts on the pods it creates.
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
#: The replica type of every rank (module docstring).
REPLICA_TYPE = "Worker"
#: Label on the pods of a Workers-only PyTorchJob: its value says Worker ``i`` is rank ``i``. Pods without
#: it were rendered by an operator before this layout (Master 0 is rank 0, Worker ``i`` is rank ``i + 1``)
#: and are still read that way, so an upgrade does not misnumber a running attempt.
RANK_LAYOUT_LABEL = "trainguard.dev/ranks"
RANKS_BY_WORKER_INDEX = "worker-index"
#: The training container's port the training operator's per-replica Services expose, and its default.
RENDEZVOUS_PORT_NAME = "pytorchjob-port"
DEFAULT_RENDEZVOUS_PORT = 23456

SIDECAR_CONTAINER = "trainguard-sidecar"
SIDECAR_PORT_NAME = "tg-sidecar"
STATUS_VOLUME = "trainguard-status"
STATUS_DIR = "/var/run/trainguard"
STATUS_FILE = f"{STATUS_DIR}/status.json"
CHECKPOINT_VOLUME = "trainguard-checkpoints"

#: NCCL and torch.distributed fail-fast settings, applied only where the user's container does not set them.
NCCL_FAIL_FAST: Mapping[str, str] = {
    # The ProcessGroupNCCL watchdog's heartbeat monitor aborts a process whose watchdog is stuck this long
    # (300 s, the sidecar's default hang timeout), so a wedged NCCL call ends in an exit code, not a hang.
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "300",
    # InfiniBand local ack timeout, 4.096 us * 2^20 ~ 4.3 s per retransmission, ~30 s with NCCL's
    # default 7 retries: a link flap is ridden out, a dead link errors within half a minute.
    "NCCL_IB_TIMEOUT": "20",
    # Abort the communicator and the process on an NCCL error or timeout instead of leaving it hung.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}

#: The longest PyTorchJob name: the training operator names pods and services ``<job>-worker-<index>``,
#: which must be a DNS-1035 label (<= 63). ``replicas`` is at most 4096, so the index is at most 4095.
MAX_JOB_NAME = 63 - len("-worker-4095")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_HASH_CHARS = 8


class RenderError(ValueError):
    """The job's template cannot be combined with trainguard's pieces; the message names the field."""


@dataclass(frozen=True)
class Owner:
    """The GuardedTrainingJob an attempt belongs to (its uid is needed for the owner reference)."""

    name: str
    namespace: str
    uid: str


def owner_reference(owner: Owner) -> dict[str, Any]:
    """The owner reference of an attempt's object: the GuardedTrainingJob, its controller."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def is_dns1035_label(value: str) -> bool:
    """Whether ``value`` is a DNS-1035 label (what Service names must be)."""
    return len(value) <= 63 and bool(_DNS1035.match(value))


def rendered_world(pytorchjob: Mapping[str, Any]) -> dict[str, int] | None:
    """The world size a PyTorchJob was rendered for, as the spec fields that set it (``replicas``: the
    pods, over every replica type; ``nprocPerNode``), or None when its spec does not say."""
    spec = pytorchjob.get("spec")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("pytorchReplicaSpecs"), Mapping):
        return None
    try:
        replicas = sum(
            int(replica["replicas"])
            for replica in spec["pytorchReplicaSpecs"].values()
            if isinstance(replica, Mapping)
        )
        nproc = int(spec.get("nprocPerNode") or 1)
    except (KeyError, TypeError, ValueError):
        return None
    if replicas < 1 or nproc < 1:
        return None
    return {"replicas": replicas, "nprocPerNode": nproc}


def pytorchjob_name(job_name: str, attempt: int) -> str:
    """The PyTorchJob name of ``attempt`` of ``job_name``: ``<job>-<attempt>`` when that fits.

    The result, and the training operator's ``<result>-worker-N`` pod and service names, are DNS-1035
    labels for any job name of at most 63 characters. A name that is too long, or does not start with a
    letter, is shortened to a prefix plus a hash of the whole name, so distinct jobs keep distinct names.
    """
    if attempt < 1 or attempt >= 10**12:
        raise ValueError(f"attempt must be in [1, 10^12), got {attempt}")
    suffix = f"-{attempt}"
    plain = f"{job_name}{suffix}"
    if len(plain) <= MAX_JOB_NAME and is_dns1035_label(plain):
        return plain
    digest = hashlib.sha256(job_name.encode()).hexdigest()[:_HASH_CHARS]
    head = job_name if job_name[:1].isalpha() else f"tg-{job_name}"
    budget = MAX_JOB_NAME - len(suffix) - 1 - _HASH_CHARS
    head = head[:budget].rstrip("-")
    return f"{head}-{digest}{suffix}" if head else f"tg-{digest}{suffix}"


#: Seconds a worker killed by its failed liveness probe (a hang) gets between SIGTERM and SIGKILL: the
#: moment a broken gang's ranks get (``trainer_sidecar.contract.stopping``). A hung worker cannot act on
#: SIGTERM; what it can still finish, a checkpoint write in flight, holds the kill in the sidecar instead
#: (its probe passes until the write is expected to be durable), because this grace is fixed in the pod.
PROBE_KILL_GRACE_SECONDS = math.ceil(BROKEN_GANG_GRACE_SECONDS)
#: Seconds the pods of a gang given up on get, when an operator restarted in between finds them running.
GIVEN_UP_GANG_GRACE_SECONDS = 5
#: Label the Kubeflow training operator puts on a PyTorchJob's pods: the PyTorchJob's name.
PYTORCHJOB_NAME_LABEL = "training.kubeflow.org/job-name"

#: Kubernetes' default terminationMessagePath.
TERMINATION_MESSAGE_PATH = "/dev/termination-log"


def _env_map(env: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    return {str(item.get("name")): item for item in env or []}


def replacing_env(
    existing: Sequence[Mapping[str, Any]] | None, owned: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The user's env without the variables ``owned`` names, then ``owned`` (values or ``valueFrom``)."""
    names = {item["name"] for item in owned}
    return [dict(item) for item in existing or [] if item.get("name") not in names] + list(owned)


def _worker_env(
    existing: Sequence[Mapping[str, Any]] | None, owned: Mapping[str, str], defaults: Mapping[str, str]
) -> list[dict[str, Any]]:
    """The worker's env: the user's, trainguard's own variables replacing any of the same name (as the
    local runner does: the status path and settings must agree with the sidecar and the spec), then the
    NCCL defaults the user did not set."""
    result = replacing_env(existing, [{"name": name, "value": value} for name, value in owned.items()])
    user = _env_map(existing)
    result += [{"name": name, "value": value} for name, value in defaults.items() if name not in user]
    return result


def _sidecar(job: GuardedTrainingJob, settings: OperatorSettings) -> dict[str, Any]:
    return {
        "name": SIDECAR_CONTAINER,
        "image": settings.sidecar_image,
        "imagePullPolicy": settings.sidecar_image_pull_policy,
        "command": ["trainguard-sidecar"],
        # A native sidecar (an init container that always restarts, Kubernetes >= 1.29): it starts before
        # the worker, lives as long as the pod's main containers, and is stopped when they end. A regular
        # container would keep a finished pod Running, so the PyTorchJob would never succeed.
        "restartPolicy": "Always",
        "env": [
            {"name": name, "value": value}
            for name, value in sidecar_environment(
                job, status_file=STATUS_FILE, host=None, port=settings.sidecar_port
            )
            .variables()
            .items()
        ],
        "ports": [{"name": SIDECAR_PORT_NAME, "containerPort": settings.sidecar_port, "protocol": "TCP"}],
        "volumeMounts": [{"name": STATUS_VOLUME, "mountPath": STATUS_DIR, "readOnly": True}],
        "resources": copy.deepcopy(settings.sidecar_resources),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.sidecar_run_as_user,
            "runAsGroup": settings.sidecar_run_as_user,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }


def _probe(path: str, port: int, period: int, failure_threshold: int, timeout: int) -> dict[str, Any]:
    # The port is a number, not the sidecar's port name: a named probe port is looked up among the
    # probed container's own ports, and the probe runs against the pytorch container.
    return {
        "httpGet": {"path": path, "port": port, "scheme": "HTTP"},
        "periodSeconds": period,
        "failureThreshold": failure_threshold,
        "timeoutSeconds": timeout,
        "successThreshold": 1,
        # The sidecar fails liveness only after the hang timeout with no step and no busy section, so the
        # worker cannot act on SIGTERM: the pod's long stop grace (time for a checkpoint) would only delay
        # the gang's restart by that much. Kubernetes >= 1.28 lets the probe's kill have its own grace.
        "terminationGracePeriodSeconds": PROBE_KILL_GRACE_SECONDS,
    }


def _label_template(template: dict[str, Any], job: str, attempt: int) -> None:
    meta = template.setdefault("metadata", {})
    meta["labels"] = {**meta.get("labels", {}), JOB_LABEL: job, ATTEMPT_LABEL: str(attempt)}
    meta["annotations"] = {
        **meta.get("annotations", {}),
        "kubectl.kubernetes.io/default-container": WORKER_CONTAINER,
    }
    for key in ("name", "namespace"):
        meta.pop(key, None)


def _add_volumes(pod: dict[str, Any], claim_name: str) -> None:
    volumes = pod.setdefault("volumes", [])
    taken = {v.get("name") for v in volumes}
    for volume in (STATUS_VOLUME, CHECKPOINT_VOLUME):
        if volume in taken:
            raise RenderError(f"spec.template.spec.volumes: the name {volume} is reserved by trainguard")
    volumes.append({"name": STATUS_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}})
    volumes.append({"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": claim_name}})


def _add_mounts(worker: dict[str, Any], checkpoint_mount: str) -> None:
    mounts = worker.setdefault("volumeMounts", [])
    for path in (STATUS_DIR, checkpoint_mount):
        if any(m.get("mountPath") == path for m in mounts):
            raise RenderError(
                f"spec.template.spec.containers[{WORKER_CONTAINER}].volumeMounts: {path} is where "
                "trainguard mounts its own volume"
            )
    mounts.append({"name": STATUS_VOLUME, "mountPath": STATUS_DIR})
    mounts.append({"name": CHECKPOINT_VOLUME, "mountPath": checkpoint_mount})


def _owned_env(
    job: GuardedTrainingJob,
    attempt: int,
    remediation: RemediationOrder | None,
    worker: Mapping[str, Any],
    history: FailureHistory,
) -> dict[str, str]:
    """trainguard's own variables of the worker (they replace any the user set of the same name)."""
    return worker_environment(
        job,
        attempt=attempt,
        remediation=remediation,
        checkpoint_dir=job.spec.checkpoint.mount_path,
        status_file=STATUS_FILE,
        termination_message_path=worker.get("terminationMessagePath") or TERMINATION_MESSAGE_PATH,
        restarts=history.restarts,
        run_seconds=history.run_seconds,
    ).variables()


#: The stop grace of a pod before anything is known of its checkpoints (Kubernetes' default is 30 s).
BASE_STOP_GRACE_SECONDS = 60
MAX_STOP_GRACE_SECONDS = 3600


@dataclass(frozen=True)
class FailureHistory:
    """The job's gang restarts before an attempt and its run time until then (seconds): the failure rate
    ``everySteps: auto`` sizes its interval from."""

    restarts: int = 0
    run_seconds: float = 0.0


def stop_grace_seconds(user: int | None, checkpoint_seconds: float | None) -> int:
    """The pod's ``terminationGracePeriodSeconds``: time for a worker told to stop (an eviction, a drain,
    a preemption) to finish its step and write a checkpoint. Three times the longest checkpoint write
    seen so far (the state's size, on this volume) on top of the base, at most an hour; never less than
    the user's own."""
    grace = BASE_STOP_GRACE_SECONDS
    if checkpoint_seconds is not None:
        grace = min(MAX_STOP_GRACE_SECONDS, BASE_STOP_GRACE_SECONDS + math.ceil(3 * checkpoint_seconds))
    return max(grace, user or 0)


#: The node label a straggler's node is kept off by (every node has it).
HOSTNAME_LABEL = "kubernetes.io/hostname"


def _avoid_node(pod: dict[str, Any], node: str) -> None:
    """Keep the pod off ``node``: a required node affinity ``kubernetes.io/hostname NotIn [node]``, added
    to every one of the user's node selector terms (they are alternatives: each must exclude it), or as
    the one term when there are none."""
    affinity = pod.setdefault("affinity", {})
    required = affinity.setdefault("nodeAffinity", {}).setdefault(
        "requiredDuringSchedulingIgnoredDuringExecution", {}
    )
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:
        term.setdefault("matchExpressions", []).append(
            {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": [node]}
        )


def render_pod_template(
    job: GuardedTrainingJob,
    attempt: int,
    remediation: RemediationOrder | None,
    settings: OperatorSettings,
    checkpoint_seconds: float | None = None,
    history: FailureHistory | None = None,
    avoid_node: str | None = None,
) -> dict[str, Any]:
    """One replica's pod template: the user's template with trainguard's pieces added (module docstring);
    with ``avoid_node`` (a straggler's node, after ``health.straggler.action: restart``), kept off it."""
    spec = job.spec
    template = spec.template.model_dump(mode="json", by_alias=True, exclude_none=True)
    pod = template.setdefault("spec", {})
    if avoid_node:
        _avoid_node(pod, avoid_node)
    _label_template(template, job.metadata.name, attempt)
    pod["restartPolicy"] = "Never"
    pod["terminationGracePeriodSeconds"] = stop_grace_seconds(
        pod.get("terminationGracePeriodSeconds"), checkpoint_seconds
    )
    _add_volumes(pod, spec.checkpoint.claim_name)

    containers = pod["containers"]
    worker = next(c for c in containers if c.get("name") == WORKER_CONTAINER)
    if any(c.get("name") == SIDECAR_CONTAINER for c in [*containers, *pod.get("initContainers", [])]):
        raise RenderError(f"spec.template.spec: the container name {SIDECAR_CONTAINER} is reserved")
    _add_mounts(worker, spec.checkpoint.mount_path)
    if spec.nproc_per_node > 1:
        _run_under_torchrun(worker)
    owned = _owned_env(job, attempt, remediation, worker, history or FailureHistory())
    worker["env"] = _worker_env(worker.get("env"), owned, NCCL_FAIL_FAST)

    health = spec.health
    timing = probe_timing(health.probe_period_seconds)
    worker["livenessProbe"] = _probe(
        "/healthz",
        settings.sidecar_port,
        health.probe_period_seconds,
        timing["liveness_failure_threshold"],
        timing["timeout_seconds"],
    )
    # No startup probe, on purpose. One on /readyz (503 until the first step) would keep Worker 0's pod
    # unready until the gang steps, but the other ranks connect to Worker 0's headless Service name, and
    # cluster DNS publishes ready pods only: the gang would never start.
    # /healthz already grants the startup grace before the first step. A startup probe of the user's
    # would hold the liveness probe off beyond that grace, so it goes too.
    worker.pop("startupProbe", None)
    # Last among the init containers, so it starts right before the worker and its startup grace is not
    # spent on the user's own init containers.
    pod["initContainers"] = [*pod.get("initContainers", []), _sidecar(job, settings)]
    return template


def order_environment(
    job: GuardedTrainingJob,
    attempt: int,
    remediation: RemediationOrder | None,
    history: FailureHistory,
) -> dict[str, str]:
    """The worker variables an order for ``attempt`` sets in pods rendered for an earlier attempt: those
    of ``contract.inplace.ORDERABLE_VARIABLES``, as a new PyTorchJob of ``attempt`` would render them."""
    variables = worker_environment(
        job,
        attempt=attempt,
        remediation=remediation,
        checkpoint_dir=job.spec.checkpoint.mount_path,
        status_file=STATUS_FILE,
        termination_message_path=TERMINATION_MESSAGE_PATH,
        restarts=history.restarts,
        run_seconds=history.run_seconds,
    ).variables()
    return {name: value for name, value in variables.items() if name in ORDERABLE_VARIABLES}


#: torchrun's node arguments as the Kubeflow training operator's variables, which the container expands:
#: it sets them on every replica when the PyTorchJob has ``nprocPerNode``.
KUBEFLOW_NODE = NodeLaunch(
    nnodes="$(PET_NNODES)",
    nproc_per_node="$(PET_NPROC_PER_NODE)",
    node_rank="$(PET_NODE_RANK)",
    master_addr="$(MASTER_ADDR)",
    master_port="$(MASTER_PORT)",
)


def _rendezvous_port(worker: dict[str, Any]) -> int:
    """The training container's rendezvous port: the user's ``pytorchjob-port``, or the training
    operator's default, added to the container as its defaulting would."""
    ports = worker.setdefault("ports", [])
    if not isinstance(ports, list) or not all(isinstance(port, dict) for port in ports):
        raise RenderError(f"spec.template.spec.containers[{WORKER_CONTAINER}].ports: not a list of ports")
    for port in ports:
        if port.get("name") == RENDEZVOUS_PORT_NAME:
            number = port.get("containerPort")
            if not isinstance(number, int) or not 0 < number < 65536:
                raise RenderError(
                    f"spec.template.spec.containers[{WORKER_CONTAINER}].ports[{RENDEZVOUS_PORT_NAME}]"
                    f".containerPort: {number!r} is not a port number"
                )
            return number
    ports.append({"name": RENDEZVOUS_PORT_NAME, "containerPort": DEFAULT_RENDEZVOUS_PORT, "protocol": "TCP"})
    return DEFAULT_RENDEZVOUS_PORT


def _add_rendezvous(template: dict[str, Any], pytorchjob: str, world_size: int) -> None:
    """torch.distributed's variables on the training container, as the training operator sets them when
    there is a Master (module docstring), replacing any of the user's: the host is Worker 0's Service
    (``<pytorchjob>-worker-0``), the rank is the pod's replica index (read by the downward API: one
    template serves every Worker), and ``PET_*`` repeat them for a ``torchrun`` of the user's own."""
    template["metadata"]["labels"][RANK_LAYOUT_LABEL] = RANKS_BY_WORKER_INDEX
    worker = next(c for c in template["spec"]["containers"] if c.get("name") == WORKER_CONTAINER)
    host = f"{pytorchjob}-{REPLICA_TYPE.lower()}-0"
    port = str(_rendezvous_port(worker))
    rank = {"fieldRef": {"apiVersion": "v1", "fieldPath": f"metadata.labels['{REPLICA_INDEX_LABEL}']"}}
    owned: list[dict[str, Any]] = [
        {"name": "MASTER_ADDR", "value": host},
        {"name": "MASTER_PORT", "value": port},
        {"name": "PET_MASTER_ADDR", "value": host},
        {"name": "PET_MASTER_PORT", "value": port},
        {"name": "WORLD_SIZE", "value": str(world_size)},
        {"name": "RANK", "valueFrom": rank},
        {"name": "PET_NODE_RANK", "valueFrom": copy.deepcopy(rank)},
    ]
    worker["env"] = replacing_env(worker.get("env"), owned)


def add_launcher(
    template: dict[str, Any], job: GuardedTrainingJob, settings: OperatorSettings, signer: OrderSigner
) -> None:
    """Run the worker command under the launcher, and tell the sidecar the order token's digest, the key
    orders are signed with and its pod's name, so the gang can be restarted in place (``inplace``). A
    container without a command of its own (the image's entrypoint runs) cannot be wrapped: its pods
    restart as a new PyTorchJob, as before. Whether a warm spare fits under the container's memory limit
    the launcher judges from the container's own memory use (the spare counts against the limit)."""
    pod = template["spec"]
    worker = next(c for c in pod["containers"] if c.get("name") == WORKER_CONTAINER)
    command = [*worker.get("command", []), *worker.get("args", [])]
    if not worker.get("command"):
        return
    worker["command"] = launcher_command(
        command,
        order_wait_seconds=order_wait_seconds(job.spec.health.probe_period_seconds),
        warm=settings.warm_spares,
    )
    worker.pop("args", None)
    sidecar = next(c for c in pod["initContainers"] if c.get("name") == SIDECAR_CONTAINER)
    sidecar["env"] += [
        {"name": ORDER_TOKEN_DIGEST_ENV, "value": order_token_digest(signer.token)},
        {"name": ORDER_SIGNING_KEY_ENV, "value": signer.signing_key},
        {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}},
    ]
    # The sidecar writes the launcher's order into the status directory.
    for mount in sidecar["volumeMounts"]:
        if mount["name"] == STATUS_VOLUME:
            mount["readOnly"] = False


def _run_under_torchrun(worker: dict[str, Any]) -> None:
    """The worker's command and arguments as one command run by torchrun (``trainguard.core.torchrun``)."""
    command = [*worker.get("command", []), *worker.get("args", [])]
    try:
        worker["command"] = under_torchrun(command, KUBEFLOW_NODE)
    except NotPython as exc:
        raise RenderError(f"spec.template.spec.containers[{WORKER_CONTAINER}].command: {exc}") from exc
    worker.pop("args", None)


def render_pytorchjob(
    job: GuardedTrainingJob,
    owner: Owner,
    attempt: int,
    remediation: RemediationOrder | None,
    settings: OperatorSettings,
    checkpoint_seconds: float | None = None,
    history: FailureHistory | None = None,
    avoid_node: str | None = None,
) -> dict[str, Any]:
    """The PyTorchJob manifest of ``attempt`` of ``job`` (see the module docstring for what it holds;
    ``avoid_node``: see ``render_pod_template``).

    Raises RenderError when the user's template collides with trainguard's reserved names or paths.
    """
    name = pytorchjob_name(owner.name, attempt)
    labels = {JOB_LABEL: owner.name, ATTEMPT_LABEL: str(attempt), MANAGED_BY_LABEL: MANAGED_BY}
    template = render_pod_template(
        job, attempt, remediation, settings, checkpoint_seconds, history, avoid_node
    )

    _add_rendezvous(template, name, job.spec.replicas * job.spec.nproc_per_node)
    if settings.restarts_in_place:
        signer = order_signer(settings.order_key.get_secret_value(), owner.uid, owner.namespace, name)
        add_launcher(template, job, settings, signer)
    replicas = {REPLICA_TYPE: {"replicas": job.spec.replicas, "restartPolicy": "Never", "template": template}}
    return {
        "apiVersion": PYTORCHJOB_API_VERSION,
        "kind": PYTORCHJOB_KIND,
        "metadata": {
            "name": name,
            "namespace": owner.namespace,
            "labels": labels,
            "ownerReferences": [owner_reference(owner)],
        },
        "spec": {
            "pytorchReplicaSpecs": replicas,
            # The operator deletes old attempts itself (the pods go with them by garbage collection);
            # the training operator must not delete a finished attempt's pods under it.
            "runPolicy": {"cleanPodPolicy": "None"},
            **({"nprocPerNode": str(job.spec.nproc_per_node)} if job.spec.nproc_per_node > 1 else {}),
        },
    }

"""Kubeflow Trainer v2's TrainJob (``trainer.kubeflow.org/v1alpha1``) as a backend. Pure.

An attempt is a TrainJob on trainguard's ``ClusterTrainingRuntime`` (the chart's
``trainguard-torch-distributed``), owned by the GuardedTrainingJob. The runtime holds the pod's shape
every attempt shares: a JobSet of one replicated job ``node`` whose pods run the training container
``node`` with the liveness probe on trainguard's native sidecar, the status volume, restart policy
Never and no JobSet restarts (``failurePolicy.maxRestarts: 0``: trainguard alone restarts the gang).
What is per job goes into the TrainJob the way Trainer takes it:

- ``spec.trainer``: the image, the command (under torchrun above one process per node, and under
  trainguard's launcher with an order key, exactly as in a PyTorchJob), the arguments, the resources
  per node, ``numNodes`` (``replicas``), ``numProcPerNode``, and the worker's environment: the user's,
  the guardian's (``TRAINGUARD_*``, from the same function as a PyTorchJob's), the NCCL defaults and
  torch.distributed's rendezvous variables (Trainer sets the ``PET_*`` ones itself and refuses them
  here).
- ``spec.runtimePatches``, one entry of manager ``trainguard.dev/operator``: the pods' labels (the job,
  the attempt, the rank layout), the checkpoint claim and the user's volumes, the worker's mounts and
  security context, the sidecar's environment (the job's settings, the order token's digest and signing
  key), the scheduling fields, the service account, the pod security context, and the stop grace.

A template field Trainer cannot carry (another container, an init container, a port, a working
directory, ...) is refused with its name: the PyTorchJob backend carries any pod template.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from trainguard_operator.backends import ChildState, RenderRequest, state_by_conditions
from trainguard_operator.inplace import order_signer
from trainguard_operator.render import (
    ATTEMPT_LABEL,
    JOB_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    RANK_LAYOUT_LABEL,
    SIDECAR_CONTAINER,
    STATUS_VOLUME,
    RenderError,
    add_launcher,
    owner_reference,
    pytorchjob_name,
    render_pod_template,
    replacing_env,
)

from trainguard.core.spec import WORKER_CONTAINER

TRAINJOB_GROUP = "trainer.kubeflow.org"
TRAINJOB_VERSION = "v1alpha1"
TRAINJOB_PLURAL = "trainjobs"
TRAINJOB_KIND = "TrainJob"
#: trainguard's ClusterTrainingRuntime (the chart installs it; ``OperatorSettings.trainjob_runtime``).
DEFAULT_RUNTIME = "trainguard-torch-distributed"
#: The manager of trainguard's entry in ``spec.runtimePatches``.
PATCH_MANAGER = "trainguard.dev/operator"
#: Trainer's names in the runtime: the replicated job of the training nodes and its container.
NODE_JOB = "node"
NODE_CONTAINER = "node"
#: The port Trainer's torch plugin gives the training container and names in ``PET_MASTER_PORT``.
TRAINER_PORT = 29500
#: The label JobSet puts on the pods of a JobSet (named as its TrainJob).
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
#: Kubernetes' label (1.28+) and annotation on an Indexed Job's pods: the pod's completion index, which
#: is the node rank in Trainer's torch runtime (``PET_NODE_RANK`` is read from the annotation).
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
#: The value of ``render.RANK_LAYOUT_LABEL`` on a TrainJob's pods: the rank is the completion index.
RANKS_BY_COMPLETION_INDEX = "job-completion-index"
#: The label naming a pod's training container where it is not ``pytorch`` (``pods.worker_container``).
WORKER_CONTAINER_LABEL = "trainguard.dev/worker-container"

#: Fields of the training container a TrainJob carries (others are refused); the probes are trainguard's.
_WORKER_FIELDS = frozenset(
    {"name", "image", "command", "args", "env", "resources", "volumeMounts", "securityContext"}
)
_REPLACED_WORKER_FIELDS = frozenset({"livenessProbe", "startupProbe"})
#: The variables Trainer's torch plugin sets and refuses in ``spec.trainer.env``.
TRAINER_RESERVED_ENV = frozenset(
    {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
)
#: Pod spec fields a runtime patch carries (besides the containers, checked on their own).
_POD_FIELDS = frozenset(
    {
        "containers",
        "volumes",
        "serviceAccountName",
        "imagePullSecrets",
        "securityContext",
        "nodeSelector",
        "affinity",
        "tolerations",
        "schedulingGates",
        "terminationGracePeriodSeconds",
    }
)


def _refuse_uncarried(template: Mapping[str, Any]) -> None:
    """RenderError naming the first field of the user's template a TrainJob cannot carry."""
    pod = template.get("spec") or {}
    for key in sorted(set(pod) - _POD_FIELDS):
        raise RenderError(
            f"spec.template.spec.{key}: the TrainJob backend cannot carry it (trainguard's runtime holds "
            "the pod's shape); remove it, or set spec.backend: PyTorchJob"
        )
    for container in pod.get("containers") or []:
        name = container.get("name")
        if name != WORKER_CONTAINER:
            raise RenderError(
                f"spec.template.spec.containers[{name}]: the TrainJob backend runs the {WORKER_CONTAINER} "
                "container only; remove it, or set spec.backend: PyTorchJob"
            )
        for key in sorted(set(container) - _WORKER_FIELDS - _REPLACED_WORKER_FIELDS):
            raise RenderError(
                f"spec.template.spec.containers[{WORKER_CONTAINER}].{key}: the TrainJob backend cannot "
                "carry it; remove it, or set spec.backend: PyTorchJob"
            )
        reserved = sorted({str(e.get("name")) for e in container.get("env") or []} & TRAINER_RESERVED_ENV)
        if reserved:
            raise RenderError(
                f"spec.template.spec.containers[{WORKER_CONTAINER}].env: {', '.join(reserved)} are "
                "Trainer's own (it sets them for torchrun and refuses a TrainJob that sets them); remove them"
            )
        if not container.get("command"):
            raise RenderError(
                f"spec.template.spec.containers[{WORKER_CONTAINER}].command: the TrainJob backend needs "
                "the command (the runtime's entrypoint is trainguard's launcher, which runs it), not the "
                "image's entrypoint; set it, or set spec.backend: PyTorchJob"
            )


def _rendezvous(name: str, world_size: int) -> list[dict[str, Any]]:
    """torch.distributed's variables for a plain ``python`` worker, as a PyTorchJob's are set (Trainer
    sets only the ``PET_*`` ones torchrun reads): rank 0's pod through the JobSet's headless Service,
    Trainer's port, and the rank from the pod's completion index."""
    rank = {"fieldRef": {"apiVersion": "v1", "fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}
    return [
        {"name": "MASTER_ADDR", "value": f"{name}-{NODE_JOB}-0-0.{name}"},
        {"name": "MASTER_PORT", "value": str(TRAINER_PORT)},
        {"name": "WORLD_SIZE", "value": str(world_size)},
        {"name": "RANK", "valueFrom": rank},
    ]


def _trainer(worker: Mapping[str, Any], replicas: int, nproc: int) -> dict[str, Any]:
    """``spec.trainer`` from the rendered training container."""
    trainer: dict[str, Any] = {"numNodes": replicas, "numProcPerNode": nproc, "env": worker.get("env", [])}
    for key, field in (("image", "image"), ("command", "command"), ("args", "args")):
        if worker.get(key):
            trainer[field] = worker[key]
    if worker.get("resources"):
        trainer["resourcesPerNode"] = worker["resources"]
    return trainer


def _pod_patch(template: Mapping[str, Any], worker: Mapping[str, Any]) -> dict[str, Any]:
    """The pod template patch of trainguard's runtime patch, from the rendered pod template."""
    pod = template["spec"]
    sidecar = next(c for c in pod["initContainers"] if c.get("name") == SIDECAR_CONTAINER)
    node: dict[str, Any] = {
        "name": NODE_CONTAINER,
        # The status volume and its mount are the runtime's.
        "volumeMounts": [m for m in worker.get("volumeMounts", []) if m.get("name") != STATUS_VOLUME],
    }
    if worker.get("securityContext"):
        node["securityContext"] = worker["securityContext"]
    spec: dict[str, Any] = {
        "volumes": [v for v in pod.get("volumes", []) if v.get("name") != STATUS_VOLUME],
        "initContainers": [{"name": SIDECAR_CONTAINER, "env": sidecar["env"]}],
        "containers": [node],
    }
    for key in sorted(_POD_FIELDS - {"containers", "volumes"}):
        if key in pod:
            spec[key] = copy.deepcopy(pod[key])
    metadata = copy.deepcopy(template["metadata"])
    metadata["annotations"]["kubectl.kubernetes.io/default-container"] = NODE_CONTAINER
    metadata["labels"][WORKER_CONTAINER_LABEL] = NODE_CONTAINER
    return {"metadata": metadata, "spec": spec}


class TrainJobBackend:
    """An attempt as a TrainJob on trainguard's runtime (module docstring)."""

    kind = TRAINJOB_KIND
    group = TRAINJOB_GROUP
    version = TRAINJOB_VERSION
    plural = TRAINJOB_PLURAL
    needs = "Kubeflow Trainer v2 and trainguard's runtime (the chart's trainJobRuntime)"
    pod_owner_label = JOBSET_NAME_LABEL
    status_field = "train_job"
    restart_way = "new_trainjob"

    @property
    def api_version(self) -> str:
        """``trainer.kubeflow.org/v1alpha1``."""
        return f"{self.group}/{self.version}"

    def child_name(self, job_name: str, attempt: int) -> str:
        """``<job>-<attempt>``, shortened as a PyTorchJob's name is: JobSet names the pods
        ``<name>-node-0-<index>``, as short as the training operator's ``<name>-worker-<index>``."""
        return pytorchjob_name(job_name, attempt)

    def render(self, request: RenderRequest) -> dict[str, Any]:
        """The TrainJob of the attempt (module docstring); RenderError names a field it cannot carry."""
        job, settings, owner = request.job, request.settings, request.owner
        _refuse_uncarried(job.spec.template.model_dump(mode="json", by_alias=True, exclude_none=True))
        if job.spec.health.probe_period_seconds != settings.trainjob_probe_period_seconds:
            raise RenderError(
                f"spec.health.probePeriodSeconds: trainguard's TrainJob runtime probes every "
                f"{settings.trainjob_probe_period_seconds} s (its liveness probe is the runtime's); set "
                f"{settings.trainjob_probe_period_seconds}, or set spec.backend: PyTorchJob"
            )
        name = self.child_name(owner.name, request.attempt)
        template = render_pod_template(
            job,
            request.attempt,
            request.remediation,
            settings,
            request.checkpoint_seconds,
            request.history,
            request.avoid_node,
        )
        template["metadata"]["labels"][RANK_LAYOUT_LABEL] = RANKS_BY_COMPLETION_INDEX
        worker = next(c for c in template["spec"]["containers"] if c.get("name") == WORKER_CONTAINER)
        world_size = job.spec.replicas * job.spec.nproc_per_node
        worker["env"] = replacing_env(worker.get("env"), _rendezvous(name, world_size))
        if settings.restarts_in_place:
            signer = order_signer(settings.order_key.get_secret_value(), owner.uid, owner.namespace, name)
            add_launcher(template, job, settings, signer)
        node_job = {"name": NODE_JOB, "template": {"spec": {"template": _pod_patch(template, worker)}}}
        patch = {"template": {"spec": {"replicatedJobs": [node_job]}}}
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "metadata": {
                "name": name,
                "namespace": owner.namespace,
                "labels": {
                    JOB_LABEL: owner.name,
                    ATTEMPT_LABEL: str(request.attempt),
                    MANAGED_BY_LABEL: MANAGED_BY,
                },
                "ownerReferences": [owner_reference(owner)],
            },
            "spec": {
                "runtimeRef": {
                    "name": settings.trainjob_runtime,
                    "apiGroup": TRAINJOB_GROUP,
                    "kind": "ClusterTrainingRuntime",
                },
                "trainer": _trainer(worker, job.spec.replicas, job.spec.nproc_per_node),
                "runtimePatches": [{"manager": PATCH_MANAGER, "trainingRuntimeSpec": patch}],
            },
        }

    def rendered_world(self, child: Mapping[str, Any]) -> dict[str, int] | None:
        """``spec.trainer.numNodes`` and ``numProcPerNode`` (1 when unset), or None."""
        spec = child.get("spec")
        trainer = spec.get("trainer") if isinstance(spec, Mapping) else None
        if not isinstance(trainer, Mapping):
            return None
        try:
            replicas = int(trainer["numNodes"])
            nproc = int(trainer.get("numProcPerNode") or 1)
        except (KeyError, TypeError, ValueError):
            return None
        if replicas < 1 or nproc < 1:
            return None
        return {"replicas": replicas, "nprocPerNode": nproc}

    def state(self, child: Mapping[str, Any]) -> ChildState:
        """Succeeded or failed by Trainer's True ``Complete`` or ``Failed`` condition."""
        return state_by_conditions(child, "Complete")


TRAINJOB = TrainJobBackend()

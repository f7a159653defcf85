"""What differs between the objects a GuardedTrainingJob's attempts run as. Pure.

Policy, status, Events, metrics and restarts in place are the same whatever runs the gang; a backend
says only how one attempt becomes an API object and how that object reads back: the object rendered
for an attempt, its API group, version and plural, its name, the label its controller puts on the pods
it makes (which pods to stop before it goes), the world size it was rendered for, and whether it runs,
succeeded or failed by its own status. Every backend's pods carry trainguard's job and attempt labels
(``render.JOB_LABEL``, ``render.ATTEMPT_LABEL``) and the rank layout label the gang is read by
(``pods.pod_rank``), so finding and reading the gang is shared. A backend is deleted (and recreated for
the next attempt) by the same calls: foreground deletion, so the object stays listed until its pods
are gone, then a creation under the next attempt's name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from trainguard_operator.render import FailureHistory, Owner
from trainguard_operator.settings import OperatorSettings

from trainer_sidecar.contract.settings import RemediationOrder
from trainguard.core.spec import GuardedTrainingJob


class ChildPhase(StrEnum):
    """How an attempt's object stands by its own status."""

    RUNNING = "running"  # neither finished nor failed (pending and starting included)
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True)
class ChildState:
    """An attempt's object as its controller reports it: its phase and, when it failed, why."""

    phase: ChildPhase
    message: str = ""


def true_condition(obj: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    """``obj``'s status condition of ``type_`` when it is True, else None."""
    status = obj.get("status")
    conditions = status.get("conditions") if isinstance(status, Mapping) else None
    for condition in conditions or []:
        if (
            isinstance(condition, Mapping)
            and condition.get("type") == type_
            and condition.get("status") == "True"
        ):
            return condition
    return None


def state_by_conditions(child: Mapping[str, Any], succeeded: str) -> ChildState:
    """``child``'s phase by its controller's True condition: ``succeeded`` (that controller's name for
    it), else ``Failed`` (with its message, or its reason), else running."""
    if true_condition(child, succeeded) is not None:
        return ChildState(ChildPhase.SUCCEEDED)
    failed = true_condition(child, "Failed")
    if failed is not None:
        return ChildState(ChildPhase.FAILED, str(failed.get("message") or failed.get("reason")))
    return ChildState(ChildPhase.RUNNING)


@dataclass(frozen=True)
class RenderRequest:
    """What rendering one attempt needs: the job (with its pinned spec), its owner, the attempt, the
    remediation handed to it, the operator's settings, the longest checkpoint write seen (the stop
    grace), the failure history (``everySteps: auto``) and the node to keep off (a straggler's)."""

    job: GuardedTrainingJob
    owner: Owner
    attempt: int
    remediation: RemediationOrder | None
    settings: OperatorSettings
    checkpoint_seconds: float | None = None
    history: FailureHistory | None = None
    avoid_node: str | None = None


class Backend(Protocol):
    """One kind of object an attempt runs as (see the module docstring)."""

    #: The object's kind, API group, version and plural (``PyTorchJob``, ``kubeflow.org``, ``v1``, ...).
    kind: str
    group: str
    version: str
    plural: str
    #: What the cluster needs for this kind to be served, for the message of a missing CRD.
    needs: str
    #: The label the kind's controller puts on the pods it creates, whose value is the object's name.
    pod_owner_label: str
    #: The ``JobStatus`` field that names the current attempt's object.
    status_field: str
    #: The ``way`` label of the restarts counter for a restart as a new object (``metrics``).
    restart_way: str

    @property
    def api_version(self) -> str:
        """``group/version``."""
        ...

    def child_name(self, job_name: str, attempt: int) -> str:
        """The name of ``attempt``'s object of the job ``job_name`` (a DNS-1035 label)."""
        ...

    def render(self, request: RenderRequest) -> dict[str, Any]:
        """The object of the attempt; raises ``render.RenderError`` naming the field that cannot be
        rendered."""
        ...

    def rendered_world(self, child: Mapping[str, Any]) -> dict[str, int] | None:
        """The world size ``child`` was rendered for (``replicas``, ``nprocPerNode``), or None when its
        spec does not say."""
        ...

    def state(self, child: Mapping[str, Any]) -> ChildState:
        """``child``'s phase by its own status."""
        ...

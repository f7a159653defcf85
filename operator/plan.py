"""What one reconcile step looks at and what it decides: the ``World`` read just before it, and the
``Plan`` the executor (``handlers``) carries out, with its action and Events. Types only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from trainguard_operator.inplace import OrderTarget
from trainguard_operator.render import PYTORCHJOB_KIND
from trainguard_operator.status import JobStatus

from trainer_sidecar.contract.inplace import RestartOrder
from trainguard.core.observation import SidecarReport
from trainguard.core.policy import Decision

#: How soon to look again while waiting for an old attempt's PyTorchJob to go away.
STALE_POLL_SECONDS = 2.0
#: The shortest requeue: a wait that is nearly over must not become a hot loop.
MIN_REQUEUE_SECONDS = 0.2


class PlanAction(StrEnum):
    """What a reconcile step does."""

    CREATE = "create"  # create the current attempt's PyTorchJob now
    RESTART = "restart"  # delete the current attempt's PyTorchJob; the next attempt starts at nextAttemptAt
    RESTART_IN_PLACE = (
        "restart-in-place"  # order every pod's launcher: stop now, next attempt at nextAttemptAt
    )
    FALL_BACK = "fall-back"  # an attempt ordered in place did not take: delete its PyTorchJob, start anew
    SUCCEED = "succeed"  # the job succeeded: final
    FAIL = "fail"  # the policy gave up: final; the attempt's PyTorchJob is deleted
    WAIT = "wait"  # a restart is pending: wait for nextAttemptAt (and for the old attempt to be gone)
    NOTHING = "nothing"  # keep watching
    BLOCKED = "blocked"  # cannot act: the spec is invalid or the PyTorchJob CRD is missing


@dataclass(frozen=True)
class EventNote:
    """A Kubernetes Event to post on the GuardedTrainingJob."""

    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True)
class World:
    """Everything one reconcile step looks at, as read just before it.

    ``jobs`` are the PyTorchJobs labelled with this GuardedTrainingJob (None: the PyTorchJob CRD is not
    installed); ``children`` the objects of the other backends labelled with it, by kind (a kind absent
    or None: its CRD is not installed); ``pods`` the pods labelled with it (any attempt); ``sidecars``
    the ``/status`` answers of the current attempt's pods, by pod name.
    """

    body: Mapping[str, Any]
    jobs: Sequence[Mapping[str, Any]] | None
    pods: Sequence[Mapping[str, Any]]
    sidecars: Mapping[str, SidecarReport]
    now: datetime
    #: Pods whose sidecar refused or did not take the current attempt's order, with why (the executor's
    #: memory of its last orders; empty after an operator restart, when the order's timeout decides).
    order_refusals: Mapping[str, str] = field(default_factory=dict)
    children: Mapping[str, Sequence[Mapping[str, Any]] | None] = field(default_factory=dict)

    def objects(self, kind: str) -> Sequence[Mapping[str, Any]] | None:
        """The job's objects of the backend ``kind`` (None: its CRD is not installed)."""
        return self.jobs if kind == PYTORCHJOB_KIND else self.children.get(kind)


@dataclass(frozen=True)
class Plan:
    """The outcome of a reconcile step; see the module docstring.

    The executor carries it out in this order: the status patch first when ``write_status_first`` (a
    decision is recorded before it is acted on), the deletions, the creation, then the status patch
    (otherwise: a creation is recorded only once it happened), then the events.
    """

    action: PlanAction
    status: JobStatus
    patch: dict[str, Any]
    requeue_seconds: float
    #: The kind of the objects ``create`` and ``delete`` are (the backend's).
    backend: str = PYTORCHJOB_KIND
    create: dict[str, Any] | None = None
    delete: tuple[str, ...] = ()
    #: When set, the pods of the PyTorchJobs in ``delete`` are deleted first, with this grace. A broken
    #: gang (a hung rank, ranks waiting on a dead or hung peer) cannot reach a step boundary to
    #: checkpoint, so the pods' own long grace, meant for evictions in which every rank can, would only
    #: hold the restart up: a second, or what a checkpoint write in flight needs to finish
    #: (``contract.stopping``).
    stop_pods_within_seconds: int | None = None
    #: RESTART_IN_PLACE: the pods to order (every rank's), and the order, after the status write.
    orders: tuple[OrderTarget, ...] = ()
    order: RestartOrder | None = None
    events: tuple[EventNote, ...] = ()
    write_status_first: bool = False
    done: bool = False
    decision: Decision | None = None
    recovered_seconds: float | None = None
    #: Whether the next look is due by the clock (``requeue_seconds``): while pods run (their sidecars
    #: are polled) or a time is awaited (a backoff, the previous attempt's bounded wait, a retry). False:
    #: nothing can change but the objects themselves, so only a change of the job, its PyTorchJob or its
    #: pods calls for the next look.
    clock: bool = True

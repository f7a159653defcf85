"""Reading an attempt's gang from the API server's objects and the sidecars' answers. Pure.

What the state machine (``reconcile``) needs of the current attempt: which pod is which rank, how each
rank's process is doing (running, exited and how, lost to a disruption, restarted in place), what each
rank last reported (its sidecar's ``/status``, or once the worker ended, the final status the guardian
left in its container's termination message), and which sidecars to ask next. Nothing here decides:
the ranks are handed to ``trainguard.core.policy.decide`` as ``trainguard.core.observation`` builds them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from trainguard_operator.backends import Backend, ChildPhase
from trainguard_operator.backends.trainjob import (
    COMPLETION_INDEX,
    RANKS_BY_COMPLETION_INDEX,
    WORKER_CONTAINER_LABEL,
)
from trainguard_operator.inplace import OrderTarget
from trainguard_operator.render import (
    ATTEMPT_LABEL,
    JOB_LABEL,
    RANK_LAYOUT_LABEL,
    RANKS_BY_WORKER_INDEX,
    REPLICA_INDEX_LABEL,
    REPLICA_TYPE_LABEL,
)
from trainguard_operator.status import TERMINAL_PHASES, JobStatus, parse_time

from trainer_sidecar.contract.exitcodes import describe_exit
from trainer_sidecar.contract.inplace import LauncherPhase
from trainer_sidecar.contract.status import WorkerStatus, parse_status
from trainguard.core.observation import (
    GangView,
    ProcessState,
    RankState,
    SidecarReport,
    observe_gang,
    rank_observation,
)
from trainguard.core.policy import RankObservation, classify
from trainguard.core.spec import WORKER_CONTAINER

_POD_NAME = re.compile(r"-(master|worker)-(\d+)$")
#: The longest line of a plain-text termination message quoted in a failure's reason.
QUOTED_MESSAGE_CHARS = 300


# ------------------------------------------------------------------------------------ object helpers ---
def meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """An object's ``metadata`` (empty if missing or not an object)."""
    found = obj.get("metadata")
    return found if isinstance(found, Mapping) else {}


def labels(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """An object's labels (empty if missing or not an object)."""
    found = meta(obj).get("labels")
    return found if isinstance(found, Mapping) else {}


def status_of(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """An object's ``status`` (empty if missing or not an object)."""
    found = obj.get("status")
    return found if isinstance(found, Mapping) else {}


def as_int(value: Any) -> int | None:
    """``value`` as an integer, or None when it is none."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return None


# -------------------------------------------------------------------------------------------- pods ---
def pod_rank(pod: Mapping[str, Any]) -> int | None:
    """The node rank of an attempt's pod: its completion index in a TrainJob's (their
    ``RANK_LAYOUT_LABEL`` says so); Worker i is rank i in a Workers-only PyTorchJob (its pods carry
    ``RANK_LAYOUT_LABEL``, see ``render``); in one an earlier operator rendered, Master 0 is rank 0 and
    Worker i is rank i+1. None for a pod that is none of these."""
    found_labels = labels(pod)
    if found_labels.get(RANK_LAYOUT_LABEL) == RANKS_BY_COMPLETION_INDEX:
        return _completion_index(pod)
    kind = str(found_labels.get(REPLICA_TYPE_LABEL, "")).lower()
    index = as_int(found_labels.get(REPLICA_INDEX_LABEL))
    if kind not in ("master", "worker") or index is None:
        found = _POD_NAME.search(str(meta(pod).get("name", "")))
        if not found:
            return None
        kind, index = found.group(1), int(found.group(2))
    if index < 0:
        return None
    if found_labels.get(RANK_LAYOUT_LABEL) == RANKS_BY_WORKER_INDEX:
        return index if kind == "worker" else None
    return index if kind == "master" else index + 1


def _completion_index(pod: Mapping[str, Any]) -> int | None:
    """An Indexed Job's pod's completion index (its label, or on older clusters its annotation)."""
    annotations = meta(pod).get("annotations")
    found = labels(pod).get(COMPLETION_INDEX)
    if found is None and isinstance(annotations, Mapping):
        found = annotations.get(COMPLETION_INDEX)
    index = as_int(found)
    return index if index is not None and index >= 0 else None


def attempt_pods(pods: Iterable[Mapping[str, Any]], job: str, attempt: int) -> list[Mapping[str, Any]]:
    """The pods of ``attempt`` of the GuardedTrainingJob ``job``."""
    # Filtered here too: the label selector of the list call is the API server's job, but nothing is
    # decided on a pod of another job or attempt even if a list returned one.
    return [
        p
        for p in pods
        if labels(p).get(JOB_LABEL) == job and str(labels(p).get(ATTEMPT_LABEL)) == str(attempt)
    ]


def worker_container(pod: Mapping[str, Any]) -> str:
    """The name of ``pod``'s training container: the one its ``WORKER_CONTAINER_LABEL`` names (a
    TrainJob's pods: ``node``, Trainer's name), else ``pytorch``. A label, not the default-container
    annotation it repeats: the watches keep a pod's labels, not its annotations (``cache.kept``)."""
    named = labels(pod).get(WORKER_CONTAINER_LABEL)
    return named if isinstance(named, str) and named else WORKER_CONTAINER


def _container_status(pod: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    for item in status_of(pod).get("containerStatuses") or []:
        if isinstance(item, Mapping) and item.get("name") == name:
            return item
    return None


def container_terminated(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The worker container's ``state.terminated`` once it ended, else None."""
    container = _container_status(pod, worker_container(pod))
    state = container.get("state") if container else None
    terminated = state.get("terminated") if isinstance(state, Mapping) else None
    return terminated if isinstance(terminated, Mapping) else None


def _termination_message(pod: Mapping[str, Any]) -> str:
    terminated = container_terminated(pod)
    message = terminated.get("message") if terminated else None
    return message if isinstance(message, str) else ""


def final_status(pod: Mapping[str, Any]) -> WorkerStatus | None:
    """The worker's final status, from its container's termination message (the guardian writes it when
    the worker ends), or None: no message, or not a valid status. The sidecar is gone by then, so this
    is the only record of the last steps."""
    message = _termination_message(pod)
    if not message.lstrip().startswith("{"):
        return None
    return parse_status(message, f"the termination message of pod {meta(pod).get('name')}").status


def _quoted_message(pod: Mapping[str, Any]) -> str:
    """The last line of a termination message that is not a status (the user's own, or the log's tail
    the kubelet keeps under ``FallbackToLogsOnError``), shortened; "" if there is none."""
    message = _termination_message(pod)
    if message.lstrip().startswith("{"):
        return ""
    return last_line(message)


def last_line(text: str) -> str:
    """The last line of ``text`` that is not blank, shortened to ``QUOTED_MESSAGE_CHARS``; "" if none."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    last = lines[-1]
    return last if len(last) <= QUOTED_MESSAGE_CHARS else last[: QUOTED_MESSAGE_CHARS - 3] + "..."


def pod_disruption(pod: Mapping[str, Any]) -> str | None:
    """Why a pod is lost to its gang without an exit code of its own (deleted, evicted, preempted, its
    node lost), or None."""
    name = meta(pod).get("name", "?")
    status = status_of(pod)
    for condition in status.get("conditions") or []:
        if (
            isinstance(condition, Mapping)
            and condition.get("type") == "DisruptionTarget"
            and condition.get("status") == "True"
        ):
            # DeletionByTaintManager: its node became unreachable/not ready; also preemption, API
            # eviction, pod GC of a deleted node, kubelet node-pressure termination.
            why = condition.get("reason") or "DisruptionTarget"
            return f"pod {name} disrupted ({why}): {condition.get('message') or 'no message'}"
    reason = status.get("reason")
    if reason in ("Evicted", "NodeLost", "Preempting", "Shutdown", "NodeShutdown", "Terminated"):
        return f"pod {name} {str(reason).lower()}: {status.get('message') or 'no message'}"
    if meta(pod).get("deletionTimestamp"):
        return f"pod {name} is being deleted"
    return None


def _exit_reason(pod: Mapping[str, Any], code: int, report: SidecarReport | None) -> str:
    terminated = container_terminated(pod) or {}
    why = str(terminated.get("reason") or "")
    reason = describe_exit(code) + (f" ({why})" if why and why not in ("Error", "Completed") else "")
    quoted = _quoted_message(pod)
    if quoted:
        reason += f": {quoted}"
    if report is not None and report.alive is False and report.reason:
        # E.g. the kubelet's liveness kill: the exit code alone says only "signal 9".
        reason += f"; its sidecar reported: {report.reason}"
    return reason


def worker_restarts(pod: Mapping[str, Any]) -> int:
    """How often the kubelet restarted the worker container (0 when it never did)."""
    container = _container_status(pod, worker_container(pod)) or {}
    return max(0, as_int(container.get("restartCount")) or 0)


def launcher_process(report: SidecarReport, attempt: int) -> ProcessState | None:
    """The worker of ``attempt`` as the pod's launcher tells it, or None when the pod has no launcher:
    an exit the launcher holds (waiting for an order) is the worker's exit; an attempt ordered but not
    started yet (its launcher still stopping the old worker, or not reached by the order) is not known."""
    launcher = report.launcher
    if launcher is None:
        return None
    if launcher.attempt != attempt or launcher.phase is LauncherPhase.STOPPING:
        return ProcessState()
    if launcher.phase is LauncherPhase.EXITED:
        code = 1 if launcher.exit_code is None else launcher.exit_code
        if code == 0:
            return ProcessState(exit_code=0)
        # Quoted as a container's log fallback would be: the container itself has not ended.
        quoted = last_line(launcher.output_tail)
        reason = describe_exit(code) + (" (OOMKilled)" if launcher.oom_killed else "")
        reason += f": {quoted}" if quoted else ""
        return ProcessState(exit_code=code, exit_reason=reason, ended_at=launcher.since)
    return ProcessState(alive=report.alive, health_reason=report.reason)


def pod_process(pod: Mapping[str, Any], report: SidecarReport | None, attempt: int) -> ProcessState:
    """How one rank's worker process of ``attempt`` is doing, from its pod (the API server's view) and
    its sidecar (and the pod's launcher, where there is one)."""
    terminated = container_terminated(pod)
    code = as_int(terminated.get("exitCode")) if terminated else None
    if code == 0:
        return ProcessState(exit_code=0)
    lost = pod_disruption(pod)
    if lost:
        return ProcessState(lost=lost)
    if terminated is not None:
        code = 1 if code is None else code
        finished = parse_time(terminated.get("finishedAt"))
        return ProcessState(
            exit_code=code,
            exit_reason=_exit_reason(pod, code, report),
            ended_at=finished.timestamp() if finished is not None else None,
        )
    container = _container_status(pod, worker_container(pod)) or {}
    restarted = as_int(container.get("restartCount")) or 0
    if restarted > 0:
        last_state = container.get("lastState")
        previous = last_state.get("terminated") if isinstance(last_state, Mapping) else None
        code_before = previous.get("exitCode") if isinstance(previous, Mapping) else None
        return ProcessState(
            lost=f"container {worker_container(pod)} was restarted in place ({restarted}x, last exit "
            f"{code_before}); a lone rank cannot rejoin the gang"
        )
    phase = status_of(pod).get("phase")
    if phase == "Succeeded":
        return ProcessState(exit_code=0)
    if phase == "Failed":
        status = status_of(pod)
        why = status.get("reason") or "Failed"
        return ProcessState(lost=f"pod failed ({why}): {status.get('message') or ''}")
    if report is None or not report.reachable:
        return ProcessState()
    by_launcher = launcher_process(report, attempt)
    if by_launcher is not None:
        return by_launcher
    return ProcessState(alive=report.alive, health_reason=report.reason)


def pod_node(pod: Mapping[str, Any]) -> str:
    """The node a pod is scheduled on ("" before it is)."""
    spec = pod.get("spec")
    node = spec.get("nodeName") if isinstance(spec, Mapping) else None
    return node if isinstance(node, str) else ""


def pod_place(pod: Mapping[str, Any]) -> str:
    """Where a rank runs, as a reason names it: "pod p on node n" (the node once it is scheduled)."""
    node = pod_node(pod)
    place = f"pod {meta(pod).get('name', '?')}"
    return f"{place} on node {node}" if node else place


def _reported(pod: Mapping[str, Any], report: SidecarReport | None, attempt: int) -> WorkerStatus | None:
    """What the rank of ``pod`` last reported in ``attempt``: its final status once the worker ended, else
    its sidecar's; under a launcher, only a status the attempt's own worker wrote (the status file keeps
    an earlier attempt's until the new worker writes its first)."""
    final = final_status(pod)
    if final is not None:
        return final
    if report is None or not report.reachable or report.status is None:
        return None
    launcher = report.launcher
    if launcher is None:
        return report.status
    if launcher.attempt != attempt or launcher.started_at is None:
        return None
    return report.status if report.status.started_at >= launcher.started_at else None


# -------------------------------------------------------------------------------------------- gang ---
@dataclass(frozen=True)
class GangReading:
    """The current attempt as its object, pods and sidecars show it: the gang view of what the ranks
    reported, the policy's observation of each rank, and how many pods are running."""

    view: GangView
    ranks: tuple[RankObservation, ...]
    running: int
    #: Each rank's pod and node ("" until it is scheduled).
    pods: Mapping[int, tuple[str, str]] = field(default_factory=dict)


def read_gang(
    job: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
    sidecars: Mapping[str, SidecarReport],
    *,
    name: str,
    attempt: int,
    replicas: int,
    job_name: str,
    backend: Backend,
    host_attempt: int | None = None,
) -> GangReading:
    """Read ``attempt`` of the GuardedTrainingJob ``name`` (``job``: its ``backend`` object ``job_name``,
    None if absent), running in the pods of ``host_attempt`` when it was restarted in place.

    Two pods for one rank (a replacement beside a terminating one): the failing one counts. An object
    deleted by someone else is a lost gang; one its controller reports succeeded is a gang whose every
    rank exited 0; one it reports failed without a failing rank is a lost rank 0.
    """
    mine = attempt_pods(pods, name, host_attempt or attempt)
    chosen: dict[int, tuple[WorkerStatus | None, RankObservation]] = {}
    timeouts: dict[int, float | None] = {}
    places: dict[int, tuple[str, str]] = {}
    for pod in mine:
        rank = pod_rank(pod)
        if rank is None or not 0 <= rank < replicas:
            continue
        report = sidecars.get(str(meta(pod).get("name")))
        status = _reported(pod, report, attempt)
        state = RankState.of(rank, status) if status is not None else None
        process = replace(pod_process(pod, report, attempt), place=pod_place(pod))
        seen = rank_observation(rank, state, process)
        if rank not in chosen or classify(seen) is not None:
            chosen[rank] = (status, seen)
            timeouts[rank] = report.hang_timeout_seconds if report is not None else None
            places[rank] = (str(meta(pod).get("name", "")), pod_node(pod))
    view = observe_gang({rank: status for rank, (status, _) in chosen.items()}, replicas, timeouts)
    running = sum(1 for p in mine if status_of(p).get("phase") == "Running")
    return GangReading(view, _job_ranks(job, job_name, backend, chosen, replicas), running, places)


def _job_ranks(
    job: Mapping[str, Any] | None,
    job_name: str,
    backend: Backend,
    chosen: Mapping[int, tuple[WorkerStatus | None, RankObservation]],
    replicas: int,
) -> tuple[RankObservation, ...]:
    if job is None or meta(job).get("deletionTimestamp"):
        why = f"{backend.kind} {job_name} was deleted by someone else"
        return (RankObservation(rank=0, alive=None, lost=True, reason=why),)
    state = backend.state(job)
    if state.phase is ChildPhase.SUCCEEDED:
        return tuple(RankObservation(rank=r, exit_code=0, alive=None) for r in range(replicas))
    ranks = [chosen[r][1] if r in chosen else RankObservation(rank=r, alive=None) for r in range(replicas)]
    failed = state.phase is ChildPhase.FAILED
    succeeded = all(r.exit_code == 0 for r in ranks)  # a declared finish, then a teardown crash
    if failed and not succeeded and not any(classify(r) for r in ranks):
        why = f"{backend.kind} {job_name} failed: {state.message}"
        ranks[0] = RankObservation(rank=0, alive=None, lost=True, reason=why)
    return tuple(ranks)


def pods_to_poll(body: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(pod name, pod IP) of the current attempt's pods whose worker may be running: the sidecars to ask."""
    status = JobStatus.from_body(body)
    name = str(meta(body).get("name", ""))
    if status.attempt is None or status.phase in TERMINAL_PHASES:
        return []
    result = []
    for pod in attempt_pods(pods, name, status.host_attempt or status.attempt):
        ip = status_of(pod).get("podIP")
        if ip and status_of(pod).get("phase") == "Running" and container_terminated(pod) is None:
            result.append((str(meta(pod).get("name")), str(ip)))
    return result


@dataclass(frozen=True)
class HostReading:
    """How the pods of a host attempt stand for running an attempt in place.

    ``broken``: why the attempt cannot run in them any more (a pod missing, lost, failed, or its worker
    container ended), else "". ``pending``: the first pod whose launcher is not at the attempt yet (its
    order not taken, or its old worker still stopping), else "". ``targets``: every rank's pod, in rank
    order, unless broken.
    """

    targets: tuple[OrderTarget, ...]
    broken: str = ""
    pending: str = ""

    @property
    def orderable(self) -> tuple[OrderTarget, ...]:
        """Every rank's pod when each can take an order for the next attempt now, else ()."""
        return () if self.broken or self.pending else self.targets


def read_hosts(
    pods: Sequence[Mapping[str, Any]],
    sidecars: Mapping[str, SidecarReport],
    *,
    name: str,
    host_attempt: int,
    attempt: int,
    replicas: int,
) -> HostReading:
    """The pods of ``host_attempt`` of the job ``name``, read for running ``attempt`` in place (see
    ``HostReading``). A pod can host it when it runs (not deleted, disrupted or failed, its worker
    container not ended and never restarted by the kubelet) and has an IP; its launcher is at
    ``attempt`` when its sidecar reports one running or holding that attempt, not stopping a worker."""
    found = _rank_pods(pods, name, host_attempt, replicas)
    if isinstance(found, str):
        return HostReading((), broken=found)
    targets = []
    pending = ""
    for rank, pod in enumerate(found):
        pod_name = str(meta(pod).get("name", ""))
        where = f"pod {pod_name} (rank {rank})"
        broken = pod_cannot_host(pod)
        if broken:
            return HostReading((), broken=f"{where} {broken}")
        waiting = _launcher_not_at(sidecars.get(pod_name), attempt)
        if waiting and not pending:
            pending = f"{where} {waiting}"
        targets.append(OrderTarget(pod_name, str(status_of(pod).get("podIP"))))
    return HostReading(tuple(targets), pending=pending)


def _rank_pods(
    pods: Sequence[Mapping[str, Any]], name: str, attempt: int, replicas: int
) -> list[Mapping[str, Any]] | str:
    """The pod of each rank of ``attempt``, in rank order, or why there is not exactly one each (a pod
    of a rank beyond ``replicas`` too: its gang is of another size, and half a gang is never ordered)."""
    by_rank: dict[int, Mapping[str, Any]] = {}
    for pod in attempt_pods(pods, name, attempt):
        rank = pod_rank(pod)
        if rank is None:
            continue
        if not 0 <= rank < replicas:
            return f"pod {meta(pod).get('name', '')} is of rank {rank}, beyond a gang of {replicas}"
        if rank in by_rank:
            return f"rank {rank} has two pods"
        by_rank[rank] = pod
    missing = [r for r in range(replicas) if r not in by_rank]
    if missing:
        return f"no pod of rank {missing[0]}"
    return [by_rank[r] for r in range(replicas)]


def pod_cannot_host(pod: Mapping[str, Any]) -> str:
    """Why ``pod`` cannot run another attempt in place ("" when it can): it is lost, not running, has no
    IP, or its worker container ended or was restarted by the kubelet."""
    lost = pod_disruption(pod)
    if lost:
        return f"is lost: {lost}"
    if status_of(pod).get("phase") != "Running":
        return f"is {status_of(pod).get('phase') or 'not running'}"
    if container_terminated(pod) is not None:
        return "has a worker container that ended"
    if worker_restarts(pod):
        return "has a worker container the kubelet restarted"
    if not status_of(pod).get("podIP"):
        return "has no IP"
    return ""


def _launcher_not_at(report: SidecarReport | None, attempt: int) -> str:
    if report is None or not report.reachable:
        return "has a sidecar that does not answer" + (f" ({report.reason})" if report else "")
    launcher = report.launcher
    if launcher is None:
        return "runs its worker without a launcher"
    if launcher.attempt != attempt or launcher.phase is LauncherPhase.STOPPING:
        return f"has a launcher at attempt {launcher.attempt} ({launcher.phase.value}), not {attempt}"
    return ""

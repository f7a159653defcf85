"""A reconcile step's restart of the gang in place, and its fallback: whether a restart can keep the
gang's pods (``in_place_orders``), the plan that orders every pod's launcher (``restart_in_place``), and,
for an attempt ordered in place that will not start in its pods, the fallback to a new object
(``in_place_failure``, ``fall_back``). Mixed into ``reconcile._Step``, whose status draft, context and
plans they use (``_InPlaceStep``); the order itself and the token are ``inplace``'s."""

from __future__ import annotations

from datetime import datetime, timedelta
from functools import cached_property
from typing import Any, Protocol

from trainguard_operator.backends import Backend
from trainguard_operator.inplace import OrderTarget
from trainguard_operator.pinning import repin_world
from trainguard_operator.plan import STALE_POLL_SECONDS, Plan, PlanAction, World
from trainguard_operator.pods import HostReading, read_hosts
from trainguard_operator.render import FailureHistory, order_environment
from trainguard_operator.settings import OperatorSettings
from trainguard_operator.status import JobStatus, Phase, iso, iso_precise, parse_time

from trainer_sidecar.contract.inplace import RestartOrder, StopMode
from trainguard.core.policy import Decision, FailureKind
from trainguard.core.spec import GuardedTrainingJob


class _InPlaceStep(Protocol):
    """What the in-place logic reads and calls of the step it is mixed into."""

    @property
    def world(self) -> World: ...
    @property
    def settings(self) -> OperatorSettings: ...
    @property
    def now(self) -> datetime: ...
    @property
    def name(self) -> str: ...
    @property
    def st(self) -> JobStatus: ...
    @property
    def job(self) -> GuardedTrainingJob: ...
    @property
    def asked(self) -> GuardedTrainingJob: ...
    @property
    def period(self) -> float: ...
    @property
    def attempt(self) -> int: ...
    @property
    def host(self) -> int: ...
    @property
    def backend(self) -> Backend: ...
    @property
    def job_name(self) -> str: ...
    @property
    def stale_delete(self) -> tuple[str, ...]: ...
    @property
    def hosts(self) -> HostReading: ...
    def event(self, type_: str, reason: str, message: str) -> None: ...
    def plan(self, action: PlanAction, requeue: float, **extra: Any) -> Plan: ...
    def schedule_next(self, decision: Decision, how: str) -> tuple[datetime, str]: ...
    def failure_history(self) -> FailureHistory: ...


class InPlace:
    """The restart in place of a reconcile step, and its fallback (see the module docstring)."""

    @cached_property
    def hosts(self: _InPlaceStep) -> HostReading:
        """The pods of the host attempt, read once per step for running the current attempt in them."""
        return read_hosts(
            self.world.pods,
            self.world.sidecars,
            name=self.name,
            host_attempt=self.host,
            attempt=self.attempt,
            replicas=self.job.spec.replicas,
        )

    def in_place_orders(self: _InPlaceStep, decision: Decision) -> tuple[OrderTarget, ...]:
        """The pods to order when this restart can keep the gang's pods (``inplace``), else ()."""
        if not self.settings.restarts_in_place or decision.failure is FailureKind.STRAGGLER:
            return ()  # a straggler's restart wants another node
        if self.st.in_place_restarts >= self.settings.in_place_restarts:
            return ()  # fresh pods, fresh placement, now and then
        if self.st.pinned is not None and repin_world(self.st.pinned, self.asked.spec)[1]:
            return ()  # a new world size: new pods
        return self.hosts.orderable

    def restart_in_place(
        self: _InPlaceStep,
        decision: Decision,
        recovered: float | None,
        grace: int,
        targets: tuple[OrderTarget, ...],
    ) -> Plan:
        """Restart the gang in its pods: every launcher stops its worker now (a SIGTERM, then SIGKILL after
        ``grace``) and starts the next attempt when the backoff is over."""
        due, message = self.schedule_next(decision, "in place (pods kept)")
        st = self.st
        attempt = self.attempt + 1
        st.attempt_created = attempt
        st.attempt_started_at = iso_precise(due)
        st.host_attempt = self.host
        st.in_place_restarts += 1
        history = FailureHistory(decision.restarts, self.failure_history().run_seconds)
        order = RestartOrder(
            attempt=attempt,
            environment=order_environment(self.job, attempt, st.remediation, history),
            stop=StopMode.GRACEFUL,
            grace_seconds=grace,
            start_delay_seconds=decision.delay_seconds,
        )
        return self.plan(
            PlanAction.RESTART_IN_PLACE,
            min(self.period, decision.delay_seconds),
            delete=self.stale_delete,
            orders=targets,
            order=order,
            write_status_first=True,
            decision=decision,
            recovered_seconds=recovered,
            phase_reason="GangRestart",
            phase_message=f"{message}; attempt {attempt} starts at {iso(due)}",
        )

    def in_place_failure(self: _InPlaceStep) -> tuple[str, str]:
        """For an attempt ordered in place that has not stepped yet: why it will not start in its pods
        (an order refused, a pod that cannot host it, or a launcher that did not take the order within
        ``order_timeout_seconds`` of the attempt's start), and which pod's launcher has not started it
        yet; ("", "") otherwise."""
        if self.st.host_attempt is None or self.st.recovering_since is None:
            return "", ""
        if self.world.order_refusals:
            pod, why = sorted(self.world.order_refusals.items())[0]
            return f"pod {pod} did not take the order: {why}", ""
        broken, pending = self.hosts.broken, self.hosts.pending
        if broken:
            return broken, ""
        due = parse_time(self.st.next_attempt_at) or self.now
        if pending and self.now >= due + timedelta(seconds=self.settings.order_timeout_seconds):
            return f"{pending} {self.settings.order_timeout_seconds:g} s after the attempt was due", ""
        return "", pending

    def fall_back(self: _InPlaceStep, why: str, grace: int) -> Plan:
        """Give up the restart in place of the current attempt: its object goes, and the attempt starts
        as a new one (the restart was counted when it was decided)."""
        st = self.st
        self.event(
            "Warning",
            "InPlaceRestartFailed",
            f"attempt {self.attempt} cannot start in the pods of attempt {self.host} ({why}): "
            f"it starts as a new {self.backend.kind}",
        )
        st.host_attempt = None
        st.in_place_restarts = 0
        st.attempt_created = self.attempt - 1
        st.phase = Phase.RESTARTING.value
        return self.plan(
            PlanAction.FALL_BACK,
            STALE_POLL_SECONDS,
            delete=(*self.stale_delete, self.job_name),
            stop_pods_within_seconds=grace,
            write_status_first=True,
            phase_reason="InPlaceRestartFailed",
            phase_message=f"attempt {self.attempt} starts as a new {self.backend.kind}: {why}",
        )

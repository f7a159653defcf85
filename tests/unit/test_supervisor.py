"""The run loop's restart (``trainguard.local.supervisor``): the backoff and the old gang's stop, on a fake
clock, with a supervisor whose gang is a list of what happened to it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer_sidecar.contract.status import Phase, WorkerStatus
from trainguard.core.observation import GangView, observe_gang
from trainguard.core.policy import Action, Decision, FailureKind, Observation, RankObservation
from trainguard.core.spec import parse_job
from trainguard.local import supervisor
from trainguard.local.launch import StopSignals
from trainguard.local.supervisor import GangSupervisor, Look

JOB = parse_job(
    {
        "apiVersion": "trainguard.dev/v1alpha1",
        "kind": "GuardedTrainingJob",
        "metadata": {"name": "demo"},
        "spec": {
            "replicas": 2,
            "template": {"spec": {"containers": [{"name": "pytorch", "command": ["python", "train.py"]}]}},
            "checkpoint": {"claimName": "ckpt"},
        },
    },
    "job.yaml",
)


class FakeClock:
    """``time`` as the supervisor reads it: it moves only when something sleeps or takes time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


class RecordingSupervisor(GangSupervisor):
    """A gang that takes ``stop_takes`` seconds to stop and ``prepare_takes`` to prepare the next
    attempt; what happened, and when, in ``log``."""

    def __init__(self, clock: FakeClock, stop_takes: float, prepare_takes: float = 0.0) -> None:
        super().__init__(JOB)
        self.clock = clock
        self.stop_takes = stop_takes
        self.prepare_takes = prepare_takes
        self.log: list[tuple[str, float]] = []

    def _start_workers(self) -> None:
        self.log.append(("start", self.clock.now))

    def _stop_workers(self, grace_seconds: float | None = None) -> None:
        self.log.append(("stop begins", self.clock.now))
        self.clock.now += self.stop_takes
        self.log.append(("stopped", self.clock.now))

    def _prepare_next_attempt(self) -> None:
        self.log.append(("prepared", self.clock.now))
        self.clock.now += self.prepare_takes

    def _monitor_workers(self) -> Look:
        raise NotImplementedError

    def gang_view(self) -> GangView:
        return observe_gang({}, 2)

    def _prepare_attempt(self) -> None:
        pass

    def _read_final_statuses(self) -> None:
        pass


def restart_after(
    stop_takes: float, delay: float, monkeypatch: pytest.MonkeyPatch, prepare_takes: float = 0.0
) -> dict[str, Any]:
    """Carry out one RESTART decided at the fake clock's start; when the stop began, ended, the next
    attempt was prepared and started, relative to the decision."""
    clock = FakeClock()
    monkeypatch.setattr(supervisor, "time", clock)
    gang = RecordingSupervisor(clock, stop_takes, prepare_takes)
    gang.attempt = 1
    decided = clock.now
    decision = Decision(Action.RESTART, "rank 1 crashed", delay, failure=FailureKind.CRASH, restarts=1)
    look = Look(gang.gang_view(), Observation(attempt=1, ranks=[]))
    assert gang._recover(decision, look, decided, StopSignals())
    times = {what: when - decided for what, when in gang.log}
    return {"order": [what for what, _ in gang.log], **times, "backoff_total": gang.backoff_total}


def test_the_old_gangs_stop_runs_within_the_backoff_which_counts_from_the_decision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = restart_after(stop_takes=0.4, delay=1.0, monkeypatch=monkeypatch)
    assert seen["order"] == ["stop begins", "stopped", "prepared", "start"]
    assert seen["stop begins"] == 0.0
    assert seen["start"] == pytest.approx(1.0)  # not 1.4: the stop's 0.4 s were part of the backoff
    assert seen["backoff_total"] == 1.0


@given(stop_takes=st.floats(0.0, 30.0), delay=st.floats(1.0, 90.0))
def test_the_next_attempt_starts_after_both_the_backoff_and_the_stop_and_no_later(
    stop_takes: float, delay: float
) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        seen = restart_after(stop_takes, delay, monkeypatch)
    assert seen["order"] == ["stop begins", "stopped", "prepared", "start"]
    assert seen["start"] == pytest.approx(max(stop_takes, delay))


@given(stop_takes=st.floats(0.0, 5.0), prepare_takes=st.floats(0.0, 5.0), delay=st.floats(1.0, 90.0))
def test_the_next_attempt_is_prepared_after_the_stop_and_within_the_backoff(
    stop_takes: float, prepare_takes: float, delay: float
) -> None:
    # The next attempt's sidecars start once the old gang is gone, while the backoff runs: their start
    # costs the restart only what outlasts the backoff.
    with pytest.MonkeyPatch.context() as monkeypatch:
        seen = restart_after(stop_takes, delay, monkeypatch, prepare_takes)
    assert seen["order"] == ["stop begins", "stopped", "prepared", "start"]
    assert seen["prepared"] == pytest.approx(stop_takes)
    assert seen["start"] == pytest.approx(max(stop_takes + prepare_takes, delay))


class GraceRecordingSupervisor(RecordingSupervisor):
    """A gang that records the grace each stop was given."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock, stop_takes=0.0)
        self.graces: list[float | None] = []

    def _stop_workers(self, grace_seconds: float | None = None) -> None:
        self.graces.append(grace_seconds)


@pytest.mark.parametrize(
    ("action", "rank_1", "grace"),
    [
        (Action.RESTART, None, 1.0),  # no write in flight: a moment
        (Action.RESTART, 0, 1.0),  # only the dead rank's, which died with it
        (Action.RESTART, None, 8.0),  # rank 0 is writing (started 1 s ago, its last took 4 s)
        (Action.FAIL, None, 8.0),
    ],
    ids=["nothing in flight", "the dead rank's write", "a survivor's write", "a give-up"],
)
def test_a_broken_gangs_stop_waits_only_for_a_survivors_write_in_flight(
    monkeypatch: pytest.MonkeyPatch, action: Action, rank_1: int | None, grace: float
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(supervisor, "time", clock)
    gang = GraceRecordingSupervisor(clock)
    gang.attempt = 1
    writing = {"checkpoint_write_since": clock.now - 1, "checkpoint_seconds": 4.0}
    survivor_writes = grace > 1.0
    statuses = {
        0: WorkerStatus(phase=Phase.RUNNING, started_at=1.0, **(writing if survivor_writes else {})),
        1: WorkerStatus(phase=Phase.RUNNING, started_at=1.0, **(writing if rank_1 == 0 else {})),
    }
    ranks = [RankObservation(rank=0), RankObservation(rank=1, exit_code=-9, alive=None)]
    look = Look(observe_gang(statuses, 2), Observation(attempt=1, ranks=ranks))
    decision = Decision(action, "rank 1 crashed", 1.0, failure=FailureKind.CRASH, restarts=1)
    gang._recover(decision, look, clock.now, StopSignals())
    assert gang.graces == [pytest.approx(grace)]

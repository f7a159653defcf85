"""The gang view both runners share: aggregation rules, the policy's rank observation, parsing."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_sidecar.contract.exitcodes import ExitCode
from trainer_sidecar.contract.status import Activity, CheckpointRef, Phase, WorkerStatus
from trainguard.core.observation import ProcessState, SidecarReport, observe_gang
from trainguard.core.policy import FailureKind, classify


def status(step: int = 0, **fields: Any) -> WorkerStatus:
    """A running worker's status that has stepped (its last step is after its start)."""
    values: dict[str, Any] = {
        "phase": Phase.RUNNING,
        "step": step,
        "started_at": 100.0,
        "last_step_time": 150.0,
    }
    return WorkerStatus(**(values | fields))


# ------------------------------------------------------------------------------------ aggregation ---
def test_the_slowest_rank_is_the_gangs_step_and_the_fastest_is_named() -> None:
    view = observe_gang({0: status(10), 1: status(12), 2: status(10), 3: status(11)}, 4)
    assert view.progress is not None
    assert (view.progress.step, view.progress.fastest_step) == (10, 12)
    assert (view.progress.slowest_ranks, view.progress.fastest_ranks) == ((0, 2), (1,))


def test_ranks_that_did_not_report_are_missing_and_strangers_are_ignored() -> None:
    view = observe_gang({0: status(5), 2: None, 7: status(1), -1: status(1)}, 3)
    assert [r.rank for r in view.ranks] == [0]
    assert view.missing == (1, 2)
    assert view.progress is not None
    assert view.progress.step == 5
    empty = observe_gang({}, 2)
    assert (empty.progress, empty.resumed_step, empty.stepped, empty.drop_rate) == (None, None, False, None)
    assert (empty.rollbacks, empty.samples_seen, empty.checkpoint, empty.lead) == (None, None, None, None)
    assert empty.missing == (0, 1)


def test_the_resumed_step_is_known_once_a_rank_has_resumed() -> None:
    starting = status(0, phase=Phase.STARTING, resumed_step=0, last_step_time=None)
    assert observe_gang({0: starting}, 2).resumed_step is None  # not resumed yet: 0 is no answer
    resumed = status(400, resumed_step=400, last_step_time=None)
    view = observe_gang({0: starting, 1: resumed}, 2)
    assert view.resumed_step == 400
    assert not view.stepped  # resumed, but no step of this process yet


def test_a_rank_has_stepped_when_its_last_step_is_not_older_than_its_process() -> None:
    assert observe_gang({0: status(3, last_step_time=100.0)}, 1).stepped
    # A step time before the process started is the previous process's (a resumed counter).
    assert not observe_gang({0: status(3, last_step_time=99.0)}, 1).stepped
    assert not observe_gang({0: status(3, last_step_time=None)}, 1).stepped
    assert observe_gang({0: status(3, last_step_time=None), 1: status(3)}, 2).stepped


def test_collective_counters_take_the_newest_and_samples_are_summed() -> None:
    ref = CheckpointRef(step=300, path="/ckpt/step-300", sha256="ab" * 32, time=5.0)
    older = CheckpointRef(step=200, path="/ckpt/step-200")
    view = observe_gang(
        {
            0: status(300, rollbacks=2, skipped_steps=7, samples_seen=1000, samples_dropped=1,
                       last_clean_checkpoint=older),
            1: status(300, rollbacks=1, skipped_steps=6, samples_seen=1000, samples_dropped=3,
                       last_clean_checkpoint=ref),
        },
        2,
    )  # fmt: skip
    assert (view.rollbacks, view.skipped_steps) == (2, 7)
    assert (view.samples_seen, view.samples_dropped) == (2000, 4)
    assert view.drop_rate == pytest.approx(0.002)
    assert view.checkpoint is not None
    expected = {"step": 300, "path": "/ckpt/step-300", "sha256": "ab" * 32, "time": 5.0}
    assert view.checkpoint.as_dict() == expected
    assert observe_gang({0: status(0)}, 1).drop_rate == 0.0  # no sample yet: no drop


def test_samples_of_a_gang_that_stepped_without_counting_them_are_unknown_not_zero() -> None:
    # A loop that feeds itself (no guardian.run or guardian.loader): its guardian sees no batch, and
    # reports 0 samples after 50 steps. That is "not measured"; a sum of 0 would read as "none seen".
    uncounted = observe_gang({0: status(50), 1: status(50)}, 2)
    assert (uncounted.samples_seen, uncounted.samples_dropped, uncounted.drop_rate) == (None, None, None)
    # One rank that counts beside one that does not: a sum of half the shards would be wrong too.
    half = observe_gang({0: status(50, samples_seen=400), 1: status(50)}, 2)
    assert half.samples_seen is None
    counted = observe_gang({0: status(50, samples_seen=400), 1: status(50, samples_seen=400)}, 2)
    assert (counted.samples_seen, counted.drop_rate) == (800, 0.0)


def test_the_first_failing_rank_is_the_one_that_failed_at_the_lowest_step() -> None:
    view = observe_gang(
        {
            0: status(61),
            1: status(60, phase=Phase.DIVERGED),
            2: status(50, phase=Phase.FAILED),
            3: status(50, phase=Phase.FAILED),
        },
        4,
    )
    assert view.failing == (1, 2, 3)
    assert view.first_failing == 2
    assert view.phases == {0: Phase.RUNNING, 1: Phase.DIVERGED, 2: Phase.FAILED, 3: Phase.FAILED}
    assert observe_gang({0: status(1)}, 1).first_failing is None


def test_the_view_is_immutable_and_does_not_follow_later_changes_of_a_status() -> None:
    source = status(10, loss=2.0)
    view = observe_gang({0: source}, 1)
    source.step, source.loss = 99, 9.0
    assert view.progress is not None
    assert view.progress.step == 10
    assert view.lead is not None
    assert view.lead.loss == 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.stepped = False  # type: ignore[misc]


STATUSES = st.builds(
    status,
    step=st.integers(0, 10**6),
    rollbacks=st.integers(0, 50),
    skipped_steps=st.integers(0, 50),
    samples_seen=st.integers(0, 10**6),
    samples_dropped=st.integers(0, 1000),
    phase=st.sampled_from(list(Phase)),
    last_step_time=st.none() | st.floats(0, 200),
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(-2, 9), STATUSES | st.none(), max_size=8), st.integers(1, 8))
def test_aggregation_rules_hold_for_any_gang(statuses: dict[int, WorkerStatus | None], world: int) -> None:
    view = observe_gang(statuses, world)
    reported = {r: s for r, s in statuses.items() if s is not None and 0 <= r < world}
    assert [r.rank for r in view.ranks] == sorted(reported)
    assert set(view.missing) == set(range(world)) - set(reported)
    if not reported:
        assert view.progress is None
        return
    assert view.progress is not None
    assert view.progress.step == min(s.step for s in reported.values())
    assert view.progress.fastest_step == max(s.step for s in reported.values())
    assert all(reported[r].step == view.progress.step for r in view.progress.slowest_ranks)
    if all(s.samples_seen > 0 or s.step == 0 for s in reported.values()):
        assert view.samples_seen == sum(s.samples_seen for s in reported.values())
        assert view.samples_dropped == sum(s.samples_dropped for s in reported.values())
    else:  # a rank stepped without counting a sample: not measured, never a sum that reads as one
        assert (view.samples_seen, view.samples_dropped, view.drop_rate) == (None, None, None)
    assert view.last_step == view.progress.fastest_step
    assert view.rollbacks == max(s.rollbacks for s in reported.values())
    assert view.stepped == any(
        s.last_step_time is not None and s.last_step_time >= s.started_at for s in reported.values()
    )
    failing = [r for r, s in reported.items() if s.phase in (Phase.DIVERGED, Phase.FAILED)]
    assert view.failing == tuple(sorted(failing))
    assert (view.first_failing is None) == (not failing)


# ------------------------------------------------------------------------- the policy's observation ---
def expected_kind(phase: Phase | None, process: ProcessState) -> FailureKind | None:
    """The rule, written out case by case."""
    code = process.exit_code
    if code == 0:
        return None
    if phase is Phase.DIVERGED or code == ExitCode.DIVERGED:
        return FailureKind.DIVERGED
    if process.lost:
        return FailureKind.LOST
    if code == ExitCode.CONFIG_ERROR:
        return FailureKind.CONFIG
    if code is not None:
        return FailureKind.CRASH
    return FailureKind.HANG if process.alive is False else None


PROCESSES = st.builds(
    ProcessState,
    exit_code=st.sampled_from([None, 0, 1, 2, 134, 137, 200, -9]),
    alive=st.sampled_from([None, True, False]),
    health_reason=st.sampled_from(["", "no step for 30 s"]),
    exit_reason=st.sampled_from(["", "killed by signal 9 (OOMKilled)"]),
    lost=st.sampled_from(["", "pod x evicted: low on memory"]),
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([None, *Phase]), st.sampled_from(["", "6 rollbacks in 2000 steps"]), PROCESSES)
def test_a_diverged_report_counts_before_the_exit_code_and_every_case_is_classified(
    phase: Phase | None, message: str, process: ProcessState
) -> None:
    statuses = {} if phase is None else {1: status(5, phase=phase, message=message)}
    seen = observe_gang(statuses, 2).rank_observation(1, process)
    assert seen.rank == 1
    assert classify(seen) is expected_kind(phase, process)
    if process.exit_code is not None:
        assert seen.alive is None  # an exited process has no liveness
    if classify(seen) is FailureKind.DIVERGED and phase is Phase.DIVERGED and message:
        assert seen.reason == message  # the guardian's own account, not "liveness failed"
    if classify(seen) is FailureKind.HANG:
        assert seen.reason == process.health_reason


def test_a_failed_exit_carries_the_workers_own_reason() -> None:
    config = status(0, phase=Phase.FAILED, message="TRAINGUARD_SETTINGS: guard.maxGradNorm: must be > 0")
    seen = observe_gang({0: config}, 1).rank_observation(0, ProcessState(exit_code=2))
    assert classify(seen) is FailureKind.CONFIG
    assert (
        seen.reason == "configuration error (permanent): TRAINGUARD_SETTINGS: guard.maxGradNorm: must be > 0"
    )
    # An executor that already read the reason (from the termination message) does not get it twice.
    told = ProcessState(exit_code=2, exit_reason=f"configuration error (permanent): {config.message}")
    assert observe_gang({0: config}, 1).rank_observation(0, told).reason == told.exit_reason
    # A running worker's passing remark is no exit reason.
    remark = status(7, message="held-out loss after rollback: 2.3")
    crash = observe_gang({0: remark}, 1).rank_observation(0, ProcessState(exit_code=137, exit_reason="x"))
    assert crash.reason == "x"


# ------------------------------------------------------------------------------------ sidecar reports ---
def sidecar_document(worker: Any, alive: Any = True, reason: Any = "running") -> dict[str, Any]:
    """A sidecar's ``/status`` body around ``worker`` (the status part) and a health verdict."""
    return {
        "status": worker,
        "read_error": "",
        "health": {"alive": alive, "ready": alive, "reason": reason},
        "time": 10.0,
        "sidecar": {"started_at": 1.0, "hang_timeout_seconds": 30.0, "startup_grace_seconds": 60.0},
    }


def test_a_status_document_reads_typed_through_the_contracts_parser() -> None:
    worker = {"started_at": 1.0, "step": 9, "phase": "diverged", "drop_rate": 0.0}
    report = SidecarReport.from_document(sidecar_document(worker, False, "worker phase is diverged"))
    assert (report.reachable, report.alive, report.reason) == (True, False, "worker phase is diverged")
    assert report.status is not None
    assert (report.status.phase, report.status.step) == (Phase.DIVERGED, 9)
    # The same as JSON text or bytes, as a runner receives it.
    text = json.dumps(sidecar_document(worker, False, "worker phase is diverged"))
    assert SidecarReport.from_document(text) == report
    assert SidecarReport.from_document(text.encode()) == report
    unread = SidecarReport.from_document(sidecar_document(None, True, "no status yet"))
    assert (unread.reachable, unread.alive, unread.status) == (True, True, None)


def test_a_document_the_contract_refuses_is_an_unreachable_sidecar_with_the_reason() -> None:
    for document in ([1], "{", b"\xff", {"status": {"step": 1}}, sidecar_document({"step": "x"})):
        report = SidecarReport.from_document(document)
        assert (report.reachable, report.alive, report.status) == (False, None, None)
        assert report.reason  # says why


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)
STATUS_KEYS = st.sampled_from(["started_at", "step", "phase", "last_step_time", "rollbacks", "message"])


@settings(max_examples=300, deadline=None)
@given(JSON, st.dictionaries(STATUS_KEYS, JSON, max_size=6), JSON)
def test_any_status_document_reads_as_a_report_never_an_exception(
    document: Any, fields: dict[str, Any], health: Any
) -> None:
    for candidate in (document, sidecar_document(fields, health, "x"), json.dumps(document)):
        report = SidecarReport.from_document(candidate)
        assert report.alive in (None, True, False)
        assert report.status is None or isinstance(report.status, WorkerStatus)
        if not report.reachable:
            assert (report.alive, report.status) == (None, None)
        if report.status is not None:
            observe_gang({0: report.status}, 1)  # and any status the contract accepts makes a view


@pytest.mark.parametrize(
    ("declared", "kind"),
    [
        (ExitCode.CONFIG_ERROR, FailureKind.CONFIG),
        (ExitCode.FENCED, FailureKind.FENCED),
        (None, FailureKind.CRASH),
    ],
)
def test_a_launchers_generic_failure_is_judged_by_the_code_the_guardian_declared(
    declared: int | None, kind: FailureKind
) -> None:
    # torchrun exits 1 whatever its workers' codes were; the guardian's final report says which it was.
    final = status(
        phase=Phase.FAILED, message="configuration error: TRAINGUARD_SETTINGS: ...", exit_code=declared
    )
    view = observe_gang({0: final}, world_size=1)
    seen = view.rank_observation(0, ProcessState(exit_code=1))
    assert classify(seen) is kind


CRASHED_AT_55 = status(
    55, phase=Phase.FAILED, message="ValueError: mat1 and mat2 shapes (at train.py:12)", exit_code=1
)


@pytest.mark.parametrize(
    "process",
    [
        ProcessState(exit_code=1, exit_reason="exited with code 1", ended_at=3.0),
        ProcessState(
            exit_code=1, exit_reason="exited with code 1; its sidecar reported: stale", ended_at=3.0
        ),
        ProcessState(exit_code=-11, ended_at=3.0),  # the local runner: Python's signal number
        ProcessState(exit_code=139, exit_reason="killed by signal 11", ended_at=3.0),  # a container
        ProcessState(exit_code=134, exit_reason="killed by signal 6", ended_at=3.0),
    ],
    ids=[
        "exit 1",
        "exit 1 while its sidecar saw it stale",
        "SIGSEGV local",
        "SIGSEGV container",
        "SIGABRT container",
    ],
)
def test_a_declared_crash_is_the_same_failure_whether_or_not_the_teardown_then_crashed(
    process: ProcessState,
) -> None:
    # PyTorch's gloo threads can end the interpreter's teardown in std::terminate or SIGSEGV after the
    # script's exception; the deterministic-failure rule compares (kind, step, code, reason), which must
    # not tell these apart.
    seen = observe_gang({0: CRASHED_AT_55}, 1).rank_observation(0, process)
    assert classify(seen) is FailureKind.CRASH
    assert (seen.exit_code, seen.reason) == (
        1,
        "exited with code 1: ValueError: mat1 and mat2 shapes (at train.py:12)",
    )


def test_a_declared_finish_then_a_teardown_crash_is_a_success_and_nothing_else_is() -> None:
    finished = status(600, phase=Phase.FINISHED, exit_code=0)
    view = observe_gang({0: finished}, 1)
    for signal_code in (-6, -11, 134, 139):
        assert view.rank_observation(0, ProcessState(exit_code=signal_code)).exit_code == 0
    # Its own code after the finish (the script failed after training) is still a failure, and so is a
    # signal after a report that is not the final one.
    assert classify(view.rank_observation(0, ProcessState(exit_code=1))) is FailureKind.CRASH
    running = observe_gang({0: status(600, exit_code=0)}, 1)
    assert classify(running.rank_observation(0, ProcessState(exit_code=-11))) is FailureKind.CRASH
    undeclared = observe_gang({0: status(600, phase=Phase.FINISHED)}, 1)
    assert classify(undeclared.rank_observation(0, ProcessState(exit_code=-11))) is FailureKind.CRASH


def test_the_slowest_checkpoint_write_is_the_gangs() -> None:
    view = observe_gang(
        {0: status(checkpoint_seconds=2.5), 1: status(checkpoint_seconds=7.0), 2: status()}, 3
    )
    assert view.checkpoint_seconds == 7.0
    assert observe_gang({0: status()}, 1).checkpoint_seconds is None


def test_the_declared_end_is_the_largest_any_rank_declared() -> None:
    assert observe_gang({0: status(5), 1: status(5)}, 2).max_steps is None
    view = observe_gang({0: status(5, max_steps=1000), 1: status(5)}, 2)
    assert view.max_steps == 1000


def test_the_checkpoint_cadence_is_rank_zeros() -> None:
    """Under everySteps auto rank 0 chooses the interval: the gang view shows its choice and reason."""
    reason = "auto: every 120 steps (save 2 s, MTBF 3600 s assumed, step 1 s: ...)"
    view = observe_gang(
        {
            1: status(checkpoint_every_steps=7),
            0: status(checkpoint_every_steps=120, checkpoint_cadence=reason),
        },
        2,
    )
    assert (view.checkpoint_every_steps, view.checkpoint_cadence) == (120, reason)
    assert observe_gang({1: status(checkpoint_every_steps=7)}, 2).checkpoint_every_steps is None


def test_a_ranks_activity_step_and_place_reach_the_policy_and_an_older_workers_none_stays_none() -> None:
    newer = status(step=15, activity="collective", activity_since=140.0)
    older = status(step=15)
    view = observe_gang({0: newer, 1: older}, 2)
    hung = ProcessState(alive=False, health_reason="no step for 31 s", place="pod w-0 on node n1")
    seen = view.rank_observation(0, hung)
    assert (seen.step, seen.activity, seen.activity_since) == (15, Activity.COLLECTIVE, 140.0)
    assert seen.place == "pod w-0 on node n1"
    assert classify(seen) is FailureKind.HANG
    old = view.rank_observation(1, hung)
    assert (old.step, old.activity, old.activity_since) == (15, None, None)
    assert view.rank_observation(1, ProcessState(exit_code=1, ended_at=3.0)).activity is None
    # A newer worker's activity this reader does not know reads as unknown, not as an unreadable status.
    assert WorkerStatus.model_validate(newer.model_dump() | {"activity": "teleporting"}).activity is None


def test_the_gangs_hang_timeout_is_its_strictest_ranks_as_the_sidecars_said() -> None:
    document = {
        "status": None,
        "health": {"alive": True, "ready": False, "reason": "starting", "hang_timeout_seconds": 7.5},
        "time": 1.0,
        "sidecar": {"started_at": 1.0, "hang_timeout_seconds": 300.0, "startup_grace_seconds": 600.0},
    }
    assert SidecarReport.from_document(json.dumps(document)).hang_timeout_seconds == 7.5
    older = {**document, "health": {"alive": True, "ready": False}}
    assert SidecarReport.from_document(older).hang_timeout_seconds is None
    statuses = {0: status(5), 1: status(5)}
    view = observe_gang(statuses, 2, {0: 12.0, 1: 7.5, 5: 1.0})  # rank 5 is not of this gang
    assert view.hang_timeout_seconds == 7.5
    assert observe_gang(statuses, 2, {0: None}).hang_timeout_seconds is None
    assert observe_gang(statuses, 2).hang_timeout_seconds is None

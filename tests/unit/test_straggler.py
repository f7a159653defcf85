"""Straggler detection: the compute each rank measures, the scoring rule, the gang view, the policy."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer_sidecar.contract.compute import ComputeWindow
from trainer_sidecar.contract.status import Activity, Phase, WorkerStatus
from trainer_sidecar.guardian.activity import ActivityTracker
from trainer_sidecar.guardian.faults import FaultInjector, FaultKind, FaultSpecError, parse_faults
from trainguard.core.observation import observe_gang
from trainguard.core.policy import (
    Action,
    FailureKind,
    Observation,
    RankObservation,
    StragglerObservation,
    decide,
)
from trainguard.core.spec import GuardedTrainingJobSpec, RecoverySpec, StragglerSpec
from trainguard.core.straggler import RankPace, score_ranks, worst_straggler

paces = st.lists(st.floats(0.001, 100.0), min_size=2, max_size=16)
thresholds = st.floats(1.01, 10.0)


def _flags(computes: list[float], threshold: float) -> list[bool]:
    return [s.straggler for s in score_ranks([RankPace(r, c) for r, c in enumerate(computes)], threshold)]


def _near(computes: list[float], threshold: float) -> bool:
    """Whether some score lies within rounding of the threshold (a flag there may flip with rounding)."""
    scores = [s.score for s in score_ranks([RankPace(r, c) for r, c in enumerate(computes)], threshold)]
    return any(math.isclose(s, threshold, rel_tol=1e-9) for s in scores)


@given(st.integers(2, 16), st.floats(0.001, 100.0), thresholds)
def test_a_gang_at_one_pace_has_no_straggler(size: int, compute: float, threshold: float) -> None:
    assert _flags([compute] * size, threshold) == [False] * size


@given(paces, st.floats(0.01, 100.0), thresholds)
def test_scaling_every_rank_alike_changes_no_flag(
    computes: list[float], factor: float, threshold: float
) -> None:
    scaled = [c * factor for c in computes]
    if not (_near(computes, threshold) or _near(scaled, threshold)):
        assert _flags(scaled, threshold) == _flags(computes, threshold)


@given(st.integers(2, 16), st.data(), st.floats(0.001, 100.0), thresholds, st.floats(1.0, 50.0))
def test_one_rank_slower_than_the_threshold_is_the_one_flagged(
    size: int, data: st.DataObject, compute: float, threshold: float, margin: float
) -> None:
    slow = data.draw(st.integers(0, size - 1))
    factor = threshold * (1.0 + 1e-6) * margin
    computes = [compute * factor if r == slow else compute for r in range(size)]
    assert _flags(computes, threshold) == [r == slow for r in range(size)]
    worst = worst_straggler(score_ranks([RankPace(r, c) for r, c in enumerate(computes)], threshold))
    assert worst is not None
    assert worst.rank == slow


@given(paces, thresholds)
def test_the_fastest_rank_is_never_flagged(computes: list[float], threshold: float) -> None:
    scores = score_ranks([RankPace(r, c) for r, c in enumerate(computes)], threshold)
    fastest = min(range(len(computes)), key=lambda r: computes[r])
    assert scores[fastest].score <= 1.0
    assert not scores[fastest].straggler


def test_a_rank_alone_or_unmeasured_peers_are_not_scored() -> None:
    assert score_ranks([RankPace(0, 1.0)], 1.5) == ()
    assert score_ranks([RankPace(0, 1.0), RankPace(1, None), RankPace(2, 0.0)], 1.5) == ()
    scores = score_ranks([RankPace(0, 1.0), RankPace(1, 3.0, 1.5), RankPace(2, None)], 1.5)
    assert [(s.rank, s.score, s.own_score) for s in scores] == [(0, 1 / 3, None), (1, 3.0, 2.0)]
    assert "rank 1's compute per step is 3.00x the other ranks' median" in scores[1].describe()


def test_the_compute_window_reads_its_median_once_full_and_keeps_the_best() -> None:
    window = ComputeWindow(3)
    total = 0.0
    for seconds in (1.0, 2.0):
        total += seconds
        window.lap(total)
    assert window.reading() == (None, None)
    for seconds in (3.0, 0.5, 0.5):
        total += seconds
        window.lap(total)
        window.reading()
    assert window.reading() == (0.5, 0.5)  # the last three: 3.0, 0.5, 0.5
    for _ in range(3):
        total += 4.0
        window.lap(total)
    assert window.reading() == (4.0, 0.5)
    assert window.since_lap(total + 0.25) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="1 to 1000"):
        ComputeWindow(0)


def test_the_tracker_sums_own_work_and_not_the_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 1.0, 3.0, 10.0, 10.5, 12.0])
    monkeypatch.setattr(time, "time", lambda: next(clock))
    tracker = ActivityTracker(Activity.LOOP)  # t=0
    tracker.mark(Activity.BACKWARD)  # t=1: 1 s of the loop
    tracker.mark(Activity.COLLECTIVE)  # t=3: 2 s of backward
    tracker.mark(Activity.COLLECTIVE)  # no change, no clock reading
    tracker.mark(Activity.STEP)  # t=10: 7 s waiting, not counted
    tracker.mark(Activity.CHECKPOINT)  # t=10.5: 0.5 s of the step
    tracker.mark(Activity.LOOP)  # t=12: 1.5 s of a checkpoint, not counted
    assert tracker.own == pytest.approx(3.5)
    assert tracker.current == (Activity.LOOP, 12.0)


def test_the_slow_fault_parses_with_its_factor_and_is_a_condition_never_recorded(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (fault,) = parse_faults("slow*2.5@20:1").faults
    assert (fault.kind, fault.step, fault.rank, fault.factor) == (FaultKind.SLOW, 20, 1, 2.5)
    assert fault.covers(10**9)  # to the end
    assert not parse_faults("slow*2@20x5").faults[0].covers(25)
    for bad, words in [
        ("slow@20:1", "needs its factor"),
        ("crash*2@3", "only slow"),
        ("slow*101@1", "1 to 100"),
    ]:
        with pytest.raises(FaultSpecError, match=words):
            parse_faults(bad)
    injector = FaultInjector(parse_faults("slow*2@20:1"), 1, tmp_path)
    assert injector.active
    assert [injector.slow_factor(s) for s in (19, 20, 500)] == [1.0, 2.0, 2.0]
    assert not list(tmp_path.iterdir())  # no ledger: it holds again after a restart
    assert FaultInjector(parse_faults("slow*2@20:1"), 0, tmp_path).slow_factor(30) == 1.0


def _status(
    rank: int, compute: float | None, best: float | None = None, phase: Phase = Phase.RUNNING
) -> WorkerStatus:
    return WorkerStatus(
        rank=rank, world_size=3, started_at=1.0, phase=phase, step=40,
        compute_seconds=compute, best_compute_seconds=best,
    )  # fmt: skip


def test_the_gang_view_names_the_worst_running_straggler_with_its_place() -> None:
    view = observe_gang({0: _status(0, 0.1), 1: _status(1, 0.3, 0.1), 2: _status(2, 0.1)}, 3)
    found = view.straggler(1.5, {1: "pod job-worker-1 on node n1"})
    assert found is not None
    assert found.rank == 1
    assert found.score == pytest.approx(3.0)
    assert found.own_score == pytest.approx(3.0)
    assert found.place == "pod job-worker-1 on node n1"
    assert view.straggler(3.5) is None
    # A rank that is not running (its last steps before a failure, say) is not scored.
    stopped = observe_gang(
        {0: _status(0, 0.1), 1: _status(1, 0.3, phase=Phase.FAILED), 2: _status(2, 0.1)}, 3
    )
    assert stopped.straggler(1.5) is None
    # Older workers publish no compute: nothing to score.
    assert observe_gang({0: _status(0, None), 1: _status(1, None)}, 3).straggler(1.5) is None


RECOVERY = RecoverySpec(max_restarts=2, backoff_seconds=[7, 9])
STRAGGLER = StragglerObservation(rank=1, score=2.0, own_score=2.0, reason="2.00x", place="pod p1 on node n1")


def _observation(**extra: object) -> Observation:
    ranks = [RankObservation(rank=0), RankObservation(rank=1)]
    return Observation(attempt=1, ranks=ranks, step=30, straggler=STRAGGLER, **extra)  # type: ignore[arg-type]


def test_the_policy_restarts_a_straggler_gang_under_action_restart() -> None:
    decision = decide(RECOVERY, _observation(), StragglerSpec(action="restart"))
    assert decision.action is Action.RESTART
    assert (decision.failure, decision.rank, decision.restarts, decision.delay_seconds) == (
        FailureKind.STRAGGLER, 1, 1, 7.0,
    )  # fmt: skip
    assert "rank 1 (pod p1 on node n1) is a straggler at step 30" in decision.reason
    assert decision.signature is not None
    assert not decision.signature.repeatable


def test_the_policy_only_reports_a_straggler_otherwise() -> None:
    assert decide(RECOVERY, _observation()).action is Action.CONTINUE
    assert decide(RECOVERY, _observation(), StragglerSpec()).action is Action.CONTINUE
    exhausted = decide(RECOVERY, _observation(restarts=2), StragglerSpec(action="restart"))
    assert exhausted.action is Action.CONTINUE
    assert "restarts exhausted" in exhausted.reason
    handled = decide(RECOVERY, _observation(handled_attempt=1), StragglerSpec(action="restart"))
    assert handled.action is Action.WAIT
    # A failed rank comes first: the restart is the crash's.
    crashed = Observation(
        attempt=1, ranks=[RankObservation(rank=0, exit_code=1), RankObservation(rank=1)], straggler=STRAGGLER
    )
    decision = decide(RECOVERY, crashed, StragglerSpec(action="restart"))
    assert (decision.action, decision.failure, decision.rank) == (Action.RESTART, FailureKind.CRASH, 0)


def test_the_spec_hands_the_window_to_the_guardian() -> None:
    spec = GuardedTrainingJobSpec.model_validate(
        {
            "template": {"spec": {"containers": [{"name": "pytorch", "image": "x"}]}},
            "checkpoint": {"claimName": "c"},
            "health": {"straggler": {"action": "restart", "threshold": 2, "windowSteps": 12}},
        }
    )
    assert spec.health.straggler == StragglerSpec(action="restart", threshold=2.0, window_steps=12)
    assert spec.guardian_settings().compute_window_steps == 12
    with pytest.raises(ValueError, match="action"):
        StragglerSpec.model_validate({"action": "ignore"})

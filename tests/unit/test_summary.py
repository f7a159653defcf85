"""Goodput and recovery arithmetic on synthetic timelines."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_sidecar.contract.status import CheckpointRef, Phase, WorkerStatus
from trainguard.core.observation import GangView, observe_gang
from trainguard.core.policy import Action, Decision, FailureKind, Observation, RankObservation, decide
from trainguard.core.spec import RecoverySpec
from trainguard.core.summary import (
    Incident,
    Note,
    Pace,
    RunRecord,
    Sample,
    Stretch,
    fault_time,
    goodput,
    kept_time,
    pace,
    stretches,
)


def progress(attempt: int, t0: float, s0: int, s1: int, seconds_per_step: float = 1.0) -> list[Sample]:
    return [Sample(t0 + (s - s0) * seconds_per_step, attempt, s) for s in range(s0, s1 + 1)]


def test_an_uninterrupted_run_keeps_all_its_time() -> None:
    runs = stretches(progress(1, 0.0, 0, 100))
    assert kept_time(runs, 100) == pytest.approx(100.0)
    assert goodput(100.0, 110.0) == pytest.approx(100 / 110)


def test_work_after_the_resumed_checkpoint_is_lost() -> None:
    # Attempt 1 reaches step 60 at t=60 and dies; attempt 2 resumes from the checkpoint at 40 at t=80.
    samples = progress(1, 0.0, 0, 60) + progress(2, 80.0, 40, 100)
    runs = stretches(samples, {2: 40})
    assert kept_time(runs, 100) == pytest.approx(40 + 60)


def test_a_rollback_discards_the_rolled_back_steps() -> None:
    # Steps 0..30, then the counter goes back to 20 (a rollback) and continues to 50.
    samples = progress(1, 0.0, 0, 30) + progress(1, 31.0, 20, 50)
    runs = stretches(samples)
    assert len(runs) == 2
    assert kept_time(runs, 50) == pytest.approx(20 + 30)


def test_a_late_first_sample_is_extrapolated_back_to_the_resume_step() -> None:
    samples = progress(1, 0.0, 0, 40) + progress(2, 55.0, 45, 80)  # resumed at 40, first seen at 45
    runs = stretches(samples, {2: 40})
    assert runs[1].start_step == 40
    assert kept_time(runs, 80) == pytest.approx(40 + 40)


def test_incident_times() -> None:
    incident = Incident(
        1, "crash", fault_time=10.0, detected_time=10.5, backoff_seconds=2.0, first_new_step_time=17.0
    )
    assert incident.time_to_recover == pytest.approx(7.0)
    assert incident.time_to_recover_excluding_backoff == pytest.approx(5.0)
    assert Incident(1, "x", 1.0, 1.0, 0.0, None).time_to_recover is None


def test_goodput_excluding_backoff_and_degenerate_cases() -> None:
    assert goodput(90.0, 110.0, excluded_seconds=10.0) == pytest.approx(0.9)
    assert goodput(5.0, 0.0) == 0.0
    assert goodput(200.0, 100.0) == 1.0


# ------------------------------------------------------------------- what the job resumed from ---
def test_a_checkpoint_written_after_the_last_look_is_kept_when_the_next_attempt_resumes_from_it() -> None:
    # Attempt 1 (started t=0, 1 step/s) was last seen at step 80 (t=80): its status lagged, then it
    # hung at step 92 after writing the checkpoint at step 90. Attempt 2 starts at t=136, resumes from
    # 90, is first seen at step 100 (t=150) and ends at step 200 (t=250).
    samples = progress(1, 10.0, 10, 80) + progress(2, 150.0, 100, 200)
    runs = stretches(samples, {1: 0, 2: 90}, started={1: 0.0, 2: 136.0})
    # By hand: steps 0..90 took 90 s in attempt 1 (its own rate carried on from 80 to 90), and steps
    # 90..200 took 110 s in attempt 2 (back from 100 at t=150 to 90 at t=140): 200 s of 250.
    assert kept_time(runs, 200) == pytest.approx(200.0)
    assert goodput(kept_time(runs, 200), 250.0) == pytest.approx(0.8)


def test_carrying_an_attempt_on_stops_at_the_next_attempts_start() -> None:
    # Seen at 10 steps in 100 s, resumed by attempt 2 from step 30: at its rate that is t=300, but
    # attempt 2 started at t=150, so attempt 1 cannot have worked past t=150.
    samples = [Sample(0.0, 1, 0), Sample(100.0, 1, 10), Sample(160.0, 2, 40), Sample(170.0, 2, 50)]
    runs = stretches(samples, {1: 0, 2: 30}, started={1: 0.0, 2: 150.0})
    assert (runs[0].end_step, runs[0].end_time) == (30, 150.0)
    assert kept_time(runs, 50) == pytest.approx(150.0 + 20.0)


def test_an_attempt_is_never_extrapolated_back_to_before_it_started() -> None:
    # Attempt 2 started at t=140 and resumed from 90; seen at 100 (t=150) and 150 (t=250): at that rate
    # step 90 would be at t=130, before the attempt existed (during the backoff, or attempt 1's time).
    samples = [*progress(1, 0.0, 0, 90), Sample(150.0, 2, 100), Sample(250.0, 2, 150)]
    runs = stretches(samples, {1: 0, 2: 90}, started={1: 0.0, 2: 140.0})
    assert (runs[1].start_step, runs[1].start_time) == (90, 140.0)
    assert kept_time(runs, 150) == pytest.approx(90.0 + 110.0)


def test_an_attempt_seen_at_one_step_keeps_the_chain_connected_without_time() -> None:
    samples = [*progress(1, 0.0, 0, 50), Sample(80.0, 2, 60)]
    runs = stretches(samples, {2: 40})
    assert runs[-1] == Stretch(2, 80.0, 40, 80.0, 60)
    assert kept_time(runs, 60) == pytest.approx(40.0)


@st.composite
def timelines(draw: st.DrawFn) -> tuple[list[Sample], dict[int, int], dict[int, float], float, int]:
    """Attempts one after the other; each resumes from a step at most a little beyond what the attempt
    before was seen to reach (a checkpoint after the last look); steps go up, or back (rollbacks)."""
    samples: list[Sample] = []
    resumes: dict[int, int] = {}
    starts: dict[int, float] = {}
    clock, reached, step = 0.0, 0, 0
    for attempt in range(1, draw(st.integers(1, 4)) + 1):
        starts[attempt] = clock
        step = draw(st.integers(0, reached + 20))
        resumes[attempt] = step
        for _ in range(draw(st.integers(0, 6))):
            clock += draw(st.floats(0.0, 50.0))
            step = max(0, step + draw(st.integers(-10, 40)))
            samples.append(Sample(clock, attempt, step))
            reached = max(reached, step)
        clock += draw(st.floats(0.0, 30.0))  # until it failed, and the backoff
    return samples, resumes, starts, clock, step


@settings(max_examples=400, deadline=None)
@given(timelines())
def test_kept_time_is_never_more_than_wall_time(
    timeline: tuple[list[Sample], dict[int, int], dict[int, float], float, int],
) -> None:
    samples, resumes, starts, wall, final = timeline
    kept = kept_time(stretches(samples, resumes, started=starts), final)
    assert 0.0 <= kept <= wall + 1e-6


# ------------------------------------------------------------------------------ trainguard run's record ---
def gang(step: int, *, resumed: int = 0, stepped: bool = True, **fields: Any) -> GangView:
    """Two ranks at ``step`` (rank 1 one step ahead), resumed from ``resumed``."""
    common: dict[str, Any] = {"phase": Phase.RUNNING, "resumed_step": resumed, "started_at": 1.0}
    common["last_step_time"] = 2.0 if stepped else None
    ranks = {0: WorkerStatus(step=step, **common | fields), 1: WorkerStatus(step=step + 1, **common | fields)}
    return observe_gang(ranks, 2)


def test_the_run_record_of_a_hang_after_a_checkpoint_then_a_resume_matches_the_hand_computation() -> None:
    record = RunRecord(started=0.0)
    notes: list[Note] = []
    # Attempt 1 starts at t=0 and steps at 1 step/s; the runner looks every 10 s up to t=80.
    for t in range(10, 81, 10):
        notes += record.see(1, 0.0, gang(t, samples_seen=100 * t), float(t))
    # It hangs at step 92, after the clean checkpoint at 90; its status still says 80 (it lagged) while
    # the runner keeps looking, until the hang is detected at t=130.
    for t in range(90, 131, 10):
        notes += record.see(1, 0.0, gang(80, samples_seen=8000), float(t))
    hung = gang(80, samples_seen=8000, last_step_time=80.0)  # hung since t=80 by its own clock
    record.failed(restart_on(hung, rank=1), hung, attempt=1, attempt_started=0.0, now=130.0)
    # Attempt 2 starts at t=136: starting, then resumed from 90 without a step yet, then stepping.
    starting = gang(0, resumed=0, stepped=False, phase=Phase.STARTING)
    notes += record.see(2, 136.0, starting, 137.0)
    notes += record.see(2, 136.0, gang(90, resumed=90, stepped=False), 140.0)
    for t in range(150, 251, 10):
        notes += record.see(2, 136.0, gang(t - 50, resumed=90, samples_seen=10 * t), float(t))

    figures = record.figures(250.0, 5.0)
    # By hand: attempt 1 computed the kept steps 0..90 in 90 s (seen to 80 at 1 step/s, then carried on
    # to the checkpoint attempt 2 resumed from); attempt 2 computed 90..200 in 110 s (first seen at 100
    # at t=150, so 90 at t=140). Kept 200 s of 250 s of wall time; 200 of 245 without the backoff.
    assert figures.final_step == 200
    assert figures.kept_seconds == pytest.approx(200.0)
    assert figures.goodput == pytest.approx(0.8)
    assert figures.goodput_excluding_backoff == pytest.approx(round(200 / 245, 4))
    restart = figures.restarts[0]
    # The decision's view: rank 1 (one step ahead) reported 81, so the gang computed step 81.
    assert (restart["last_step"], restart["resumed_step"], restart["redone_steps"]) == (81, 90, 0)
    assert restart["time_to_recover_seconds"] == pytest.approx(150.0 - 80.0)
    assert [n.kind for n in notes] == ["recovered"]
    assert notes[0].message == "training progressed again at step 100, resumed from step 90"
    # One sample per new step seen: a gang that stands still adds none.
    assert [s.step for s in record.samples if s.attempt == 1] == list(range(10, 81, 10))
    assert figures.samples_seen == 2 * 2500  # both ranks' shards


def restart_on(view: GangView, *, rank: int, reason: str = "liveness probe failed") -> Decision:
    """The policy's restart for ``rank`` hanging, decided on ``view`` as ``trainguard run`` observes it."""
    hung = RankObservation(rank=rank, alive=False, reason=reason)
    ranks = [hung if r == rank else RankObservation(rank=r) for r in range(view.world_size)]
    observation = Observation(attempt=1, ranks=ranks, step=view.last_step)
    return decide(RecoverySpec(), observation)


def test_a_restarts_last_step_is_the_step_its_reason_names_from_the_view_it_was_decided_on() -> None:
    # The reported case: rank 1 hung after step 140; rank 0 completed 140 as well (its gradients were
    # reduced with rank 1's) but its status, written at most twice a second, still says 130. The next
    # attempt resumed from the checkpoint at 125: 15 steps were redone, not 5.
    record = RunRecord(started=0.0)
    common: dict[str, Any] = {"phase": Phase.RUNNING, "started_at": 1.0, "last_step_time": 2.0}
    for t, step in ((10.0, 120), (20.0, 130)):
        record.see(1, 0.0, observe_gang({r: WorkerStatus(step=step, **common) for r in (0, 1)}, 2), t)
    lagging = observe_gang({0: WorkerStatus(step=130, **common), 1: WorkerStatus(step=140, **common)}, 2)
    record.see(1, 0.0, lagging, 30.0)
    decision = restart_on(lagging, rank=1, reason="no step for 3.1 s (hang timeout 3 s), last step 140")
    assert decision.reason.startswith("rank 1 hung at step 140: ")
    record.failed(decision, lagging, attempt=1, attempt_started=0.0, now=31.0)
    record.see(2, 40.0, gang(125, resumed=125, stepped=False), 41.0)
    restart = record.figures(60.0, 1.0).restarts[0]
    assert (restart["last_step"], restart["resumed_step"], restart["redone_steps"]) == (140, 125, 15)
    assert restart["reason"] == decision.reason
    # The fault time comes from the same view: rank 1's last step (t=2) to the decision (t=31).
    assert restart["detect_seconds"] == pytest.approx(29.0)


def test_figures_that_were_never_reported_are_none_not_zero() -> None:
    nothing = RunRecord(started=0.0).figures(10.0, 0.0)
    assert nothing.final_step is None
    assert (nothing.rollbacks, nothing.skipped_steps) == (None, None)
    assert (nothing.samples_seen, nothing.samples_dropped, nothing.drop_rate) == (None, None, None)
    assert (nothing.kept_seconds, nothing.goodput, nothing.goodput_excluding_backoff) == (None, None, None)
    assert nothing.wall_seconds == 10.0  # the runner's own clock: always known
    # A gang whose loop feeds itself reports 0 samples after 30 steps: not measured, so null.
    uncounted = RunRecord(started=0.0)
    uncounted.see(1, 0.0, gang(30), 5.0)
    figures = uncounted.figures(10.0, 0.0)
    assert (figures.final_step, figures.rollbacks, figures.skipped_steps) == (30, 0, 0)
    assert (figures.samples_seen, figures.samples_dropped, figures.drop_rate) == (None, None, None)
    assert figures.goodput is not None


def test_the_figures_all_come_from_the_last_view_taken_in() -> None:
    record = RunRecord(started=0.0)
    record.see(1, 0.0, gang(150, samples_seen=1500, rollbacks=1, skipped_steps=2), 10.0)
    # The workers' final statuses after a stop: the stop checkpoint at 163, the counters as they ended.
    ref = CheckpointRef(step=163, path="/ckpt/step-163")
    final = gang(
        163,
        samples_seen=815,
        samples_dropped=2,
        rollbacks=1,
        skipped_steps=3,
        phase=Phase.STOPPED,
        last_clean_checkpoint=ref,
    )
    record.see(1, 0.0, final, 12.0)
    figures = record.figures(15.0, 0.0)
    assert figures.final_step == 163
    assert (figures.samples_seen, figures.samples_dropped, figures.skipped_steps) == (1630, 4, 3)
    assert figures.drop_rate == pytest.approx(4 / 1630)
    assert figures.kept_seconds == pytest.approx(12.0 * 163 / 164, abs=2.0)


def test_the_run_record_notes_counter_changes_but_not_counters_restored_by_a_resume() -> None:
    record = RunRecord(started=0.0)
    record.see(1, 0.0, gang(10, rollbacks=0, skipped_steps=0), 10.0)
    ref = CheckpointRef(step=20, path="/ckpt/step-20")
    notes = record.see(1, 0.0, gang(25, rollbacks=1, skipped_steps=2, last_clean_checkpoint=ref), 20.0)
    assert [(n.kind, n.step) for n in notes] == [("skip", 25), ("rollback", 25), ("checkpoint", 20)]
    assert notes[0].message == "2 step(s) skipped (non-finite or spike)"
    # Attempt 2 starts (nothing restored yet), then resumes with the counters and the checkpoint it
    # resumed from: nothing new happened.
    starting = gang(0, stepped=False, phase=Phase.STARTING)
    assert record.see(2, 30.0, starting, 35.0) == []
    restored = gang(20, resumed=20, rollbacks=1, skipped_steps=2, last_clean_checkpoint=ref)
    assert record.see(2, 30.0, restored, 40.0) == []
    assert record.figures(50.0, 0.0).rollbacks == 1


def test_a_hang_began_at_the_hung_ranks_last_step_within_the_attempt_and_the_present() -> None:
    def hung_at(last_step_time: float | None) -> float:
        # Unvalidated: the rule must hold even for a clock the status contract would refuse.
        status = WorkerStatus.model_construct(
            phase=Phase.RUNNING, step=9, started_at=1.0, last_step_time=last_step_time
        )
        view = observe_gang({1: status}, 2)
        decision = Decision(Action.RESTART, failure=FailureKind.HANG, rank=1)
        return fault_time(decision, view, attempt_started=100.0, now=200.0)

    assert hung_at(150.0) == 150.0
    assert hung_at(None) == 200.0  # never stepped: seen now
    assert hung_at(50.0) == 100.0  # a previous process's step: not before this attempt
    assert hung_at(1e300) == 200.0  # a clock in the future: not after now
    assert hung_at(float("nan")) == 200.0
    crash = Decision(Action.RESTART, failure=FailureKind.CRASH, rank=1)
    assert fault_time(crash, observe_gang({}, 2), attempt_started=100.0, now=200.0) == 200.0


# ------------------------------------------------------------------------------------------ pace ---
def test_pace_is_the_current_stretchs_rate_with_the_eta_to_max_steps_and_the_time_not_kept() -> None:
    stretch = Stretch(attempt=2, start_time=100.0, start_step=60, end_time=110.0, end_step=80)
    assert pace(stretch, 500, kept_seconds=65.0, wall_seconds=110.0) == Pace(2.0, 210.0, 45.0)
    assert pace(stretch, 80, kept_seconds=65.0, wall_seconds=110.0).eta_seconds == 0.0  # reached
    assert pace(stretch, None, kept_seconds=None, wall_seconds=110.0) == Pace(2.0, None, None)
    # Not stepping in this attempt, or one look only: no rate, so no ETA; the time lost is still known.
    assert pace(None, 500, kept_seconds=65.0, wall_seconds=110.0) == Pace(None, None, 45.0)
    still = Stretch(attempt=2, start_time=100.0, start_step=60, end_time=100.0, end_step=60)
    assert pace(still, 500, kept_seconds=0.0, wall_seconds=1.0).steps_per_second is None


def test_the_run_records_pace_follows_the_attempt_and_its_lost_time_is_goodputs_complement() -> None:
    record = RunRecord(started=0.0)
    for t in range(10, 81, 10):  # attempt 1: 1 step/s to step 80, loop declared max_steps 500
        record.see(1, 0.0, gang(t, max_steps=500), float(t))
    assert record.pace(80.0) == Pace(1.0, 420.0, 0.0)
    # Attempt 2 starts at t=90 and has not stepped: no rate, no ETA.
    record.see(2, 90.0, gang(0, resumed=0, stepped=False, phase=Phase.STARTING), 91.0)
    assert record.pace(91.0).steps_per_second is None
    assert record.pace(91.0).eta_seconds is None
    # It resumed from the checkpoint at 50 and steps at 2 steps/s.
    record.see(2, 90.0, gang(60, resumed=50, max_steps=500), 100.0)
    record.see(2, 90.0, gang(80, resumed=50, max_steps=500), 110.0)
    now = record.pace(110.0)
    assert (now.steps_per_second, now.eta_seconds) == (2.0, 210.0)
    # Kept: steps 0..50 of attempt 1 (50 s) and 50..80 of attempt 2 (15 s): 45 s of 110 s lost.
    kept = record.figures(110.0, 0.0).kept_seconds
    assert kept is not None
    assert now.lost_seconds == pytest.approx(110.0 - kept)
    assert now.lost_seconds == pytest.approx(45.0)

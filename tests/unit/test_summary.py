"""Goodput and recovery arithmetic on synthetic timelines."""

from __future__ import annotations

import pytest

from trainguard.summary import Incident, Sample, goodput, kept_time, stretches


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

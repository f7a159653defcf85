"""The learned hang timeout (``contract.hang``): the pure rule's properties, the writer's gap learner, and
the two together under the sidecar's health rule (a stretch of declared pauses is no false alarm)."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.support.health import WALL0, Sidecar
from trainer_sidecar.contract.hang import (
    CHECKPOINT_MARGIN,
    GAP_MARGIN,
    RESUMED_SETUP_GAPS,
    RESUMED_WARMUP_GAPS,
    WARMUP_GAPS,
    GapLearner,
    ProgressGaps,
    hang_deadline,
)
from trainer_sidecar.contract.status import BusySection, Phase, WorkerStatus
from trainer_sidecar.sidecar.health import HealthPolicy, hang_timeout

gap = st.floats(min_value=0.0, max_value=1e5, allow_nan=False)
gaps_list = st.lists(gap, max_size=3 * WARMUP_GAPS)
seconds = st.floats(min_value=1e-3, max_value=7 * 24 * 3600.0, allow_nan=False)
checkpoint = st.none() | st.floats(min_value=0.0, max_value=1e5, allow_nan=False)


def record(gaps: list[float], warmup: int = WARMUP_GAPS) -> ProgressGaps:
    """The record after observing ``gaps`` in order."""
    folded = ProgressGaps()
    for each in gaps:
        folded = folded.observe(each, warmup)
    return folded


@given(
    st.one_of(gaps_list, st.lists(gap, min_size=WARMUP_GAPS + 1, max_size=2 * WARMUP_GAPS)),
    seconds,
    seconds,
    checkpoint,
)
@example([1e4] * (WARMUP_GAPS + 1), 300.0, 10.0, None)
@example([0.1] * (WARMUP_GAPS + 1), 300.0, 10.0, 1e4)
def test_the_deadline_is_between_the_floor_and_the_ceiling(
    gaps: list[float], ceiling: float, floor: float, written: float | None
) -> None:
    deadline = hang_deadline(ceiling, floor, record(gaps), written)
    assert min(floor, ceiling) <= deadline <= ceiling


@given(st.lists(gap, max_size=WARMUP_GAPS - 1), seconds, seconds, checkpoint)
def test_nothing_is_learned_before_the_warm_up(
    gaps: list[float], ceiling: float, floor: float, written: float | None
) -> None:
    assert hang_deadline(ceiling, floor, record(gaps), written) == ceiling
    assert hang_deadline(ceiling, floor, None, written) == ceiling


@given(gaps_list, seconds, checkpoint)
def test_a_floor_at_the_ceiling_or_none_is_the_fixed_rule(
    gaps: list[float], ceiling: float, written: float | None
) -> None:
    assert hang_deadline(ceiling, ceiling, record(gaps), written) == ceiling
    assert hang_deadline(ceiling, 2 * ceiling, record(gaps), written) == ceiling
    assert hang_deadline(ceiling, None, record(gaps), written) == ceiling


@given(
    st.lists(st.tuples(gap, gap), min_size=WARMUP_GAPS, max_size=3 * WARMUP_GAPS),
    st.lists(gap, max_size=10),
    seconds,
    seconds,
    checkpoint,
    gap,
)
def test_the_deadline_is_monotone_in_the_gaps_and_the_checkpoint(
    pairs: list[tuple[float, float]],
    later: list[float],
    ceiling: float,
    floor: float,
    written: float | None,
    more: float,
) -> None:
    smaller = [min(a, b) for a, b in pairs]
    larger = [max(a, b) for a, b in pairs]
    low = hang_deadline(ceiling, floor, record(smaller), written)
    assert hang_deadline(ceiling, floor, record(larger), written) >= low
    # More gaps never lower it either: the record only grows during a run.
    assert hang_deadline(ceiling, floor, record(smaller + later), written) >= low
    if written is not None:
        assert hang_deadline(ceiling, floor, record(smaller), written + more) >= low


@given(st.lists(gap, min_size=WARMUP_GAPS + 1, max_size=3 * WARMUP_GAPS), seconds, seconds, checkpoint)
def test_a_pause_seen_once_never_ends_the_worker_when_it_recurs(
    gaps: list[float], ceiling: float, floor: float, written: float | None
) -> None:
    """Every gap kept (after the warm-up) and the checkpoint's write time lie below the deadline, unless
    the ceiling itself is lower: the same pause again is no hang."""
    deadline = hang_deadline(ceiling, floor, record(gaps), written)
    kept = gaps[WARMUP_GAPS:]
    if deadline < ceiling:
        assert all(each < deadline or each == 0 for each in kept)
        assert written is None or written < deadline or written == 0
        assert deadline >= GAP_MARGIN * max(kept)
        assert written is None or deadline >= CHECKPOINT_MARGIN * written


def test_the_warm_up_gaps_are_counted_but_not_kept() -> None:
    slow_start = [30.0] * WARMUP_GAPS + [0.5, 0.6, 0.4]
    learned = record(slow_start)
    assert learned == ProgressGaps(WARMUP_GAPS + 3, 0.6)
    assert hang_deadline(300.0, 1.0, learned) == pytest.approx(GAP_MARGIN * 0.6)
    assert hang_deadline(300.0, 10.0, learned) == 10.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_a_gap_that_is_no_duration_makes_the_deadline_the_ceiling(bad: float) -> None:
    learned = record([0.5] * WARMUP_GAPS + [bad])
    assert hang_deadline(300.0, 10.0, learned) == 300.0
    assert hang_deadline(300.0, 10.0, record([0.5] * (WARMUP_GAPS + 1)), math.nan) == 300.0


# --- a resumed run -------------------------------------------------------------------------------------


@given(
    st.lists(gap, min_size=WARMUP_GAPS + 1, max_size=3 * WARMUP_GAPS),
    st.lists(gap, min_size=RESUMED_WARMUP_GAPS, max_size=RESUMED_WARMUP_GAPS),
    st.lists(gap, max_size=WARMUP_GAPS),
    seconds,
    seconds,
)
def test_a_resumed_run_learns_again_after_its_own_short_warm_up(
    before: list[float], warmup: list[float], after: list[float], ceiling: float, floor: float
) -> None:
    carried = record(before)
    resumed = carried.resumed()
    # The new process's first gaps are judged by the ceiling, whatever they are; its set-up gaps
    # (compilation, a cold cache) are never kept, the rest of its warm-up is.
    for count, each in enumerate(warmup, start=1):
        resumed = resumed.observe(each)
        assert resumed.learned() == (count == RESUMED_WARMUP_GAPS)
    assert resumed.longest == max([carried.longest, *warmup[RESUMED_SETUP_GAPS:]])
    assert hang_deadline(ceiling, floor, resumed) >= hang_deadline(ceiling, floor, carried)
    for each in after:
        resumed = resumed.observe(each)
    assert resumed.longest == max([carried.longest, *warmup[RESUMED_SETUP_GAPS:], *after])


@given(
    st.lists(st.floats(min_value=0.01, max_value=10.0), min_size=WARMUP_GAPS + 1, max_size=2 * WARMUP_GAPS),
    st.floats(min_value=1.0, max_value=1000.0),
    st.floats(min_value=1.0, max_value=60.0),
)
def test_a_resumed_run_slower_than_the_saved_pace_is_no_false_alarm(
    before: list[float], slower: float, floor: float
) -> None:
    """A resumed run steps ``slower`` times slower than the run that saved the record (another node,
    another batch size): no gap of its own, once past its set-up, reaches the deadline it is judged by."""
    ceiling = 1e9
    resumed = record(before).resumed()
    pace = slower * max(before)
    for _ in range(3 * WARMUP_GAPS):
        assert not resumed.learned() or pace < hang_deadline(ceiling, floor, resumed)
        resumed = resumed.observe(pace)


@given(st.lists(gap, max_size=WARMUP_GAPS - 1))
def test_a_record_still_in_its_warm_up_carries_nothing(before: list[float]) -> None:
    assert record(before).resumed() == ProgressGaps()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_a_record_whose_longest_gap_is_no_duration_carries_nothing(bad: float) -> None:
    assert ProgressGaps(WARMUP_GAPS + 3, bad).resumed() == ProgressGaps()
    assert record([0.5] * WARMUP_GAPS + [bad]).resumed() == ProgressGaps()


# --- the writer's learner -------------------------------------------------------------------------------


def test_only_gaps_that_began_while_running_are_counted() -> None:
    learner = GapLearner(warmup=0)
    timeline = [
        (("starting", 0, 0), False, 0.0),
        (("running", 0, 0), True, 50.0),  # the start: no step gap
        (("running", 1, 1), True, 50.5),  # 0.5
        (("running", 1, 1), True, 99.0),  # the same progress rewritten: ends nothing
        (("busy", 1, 1), False, 100.0),  # 49.5 of running before the section: a gap
        (("running", 1, 1), True, 400.0),  # a 300 s evaluation inside guardian.busy: not a gap
        (("running", 2, 2), True, 400.7),  # 0.7
        (("rolling-back", 2, 2), False, 401.0),  # 0.3
        (("running", 1, 3), True, 900.0),  # the rollback: not a gap
    ]
    for progress, running, now in timeline:
        learner = learner.published(progress, running, now)
    assert learner.gaps.count == 4
    assert learner.gaps.longest == pytest.approx(49.5)


# --- together with the sidecar: declared pauses are no false alarm --------------------------------------

FLOOR = 2.0
CEILING = 300.0
LEARNING = HealthPolicy(
    hang_timeout_seconds=CEILING, startup_grace_seconds=600.0, hang_timeout_floor_seconds=FLOOR
)


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("step"), st.floats(min_value=0.01, max_value=0.5)),
            st.tuples(st.just("busy"), st.floats(min_value=0.01, max_value=100.0)),
            st.tuples(st.just("rollback"), st.floats(min_value=0.01, max_value=100.0)),
        ),
        min_size=WARMUP_GAPS,
        max_size=80,
    ),
    st.floats(min_value=0.25, max_value=1.0),
)
def test_busy_sections_and_rollbacks_of_any_length_are_no_false_alarm(
    events: list[tuple[str, float]], probe: float
) -> None:
    """A worker stepping every 0.01-0.5 s, with evaluations in busy sections and rollbacks of up to
    100 s (far beyond the learned deadline of about 2 s, within their own allowance), published as the
    guardian publishes (a learner at every status write), probed every ``probe`` seconds: alive at every
    probe."""
    sidecar = Sidecar(policy=LEARNING)
    learner = GapLearner()
    step = 0
    start = WALL0

    def publish(phase: Phase, last_step: float | None, busy_since: float | None = None) -> WorkerStatus:
        nonlocal learner
        learner = learner.published((phase.value, step, step), phase is Phase.RUNNING, sidecar.monotonic)
        sections = (
            [BusySection(reason="eval", since=busy_since)] if phase is Phase.BUSY and busy_since else []
        )
        return WorkerStatus(
            pid=7, phase=phase, started_at=start, step=step, steps_total=step, last_step_time=last_step,
            busy_since=busy_since, busy_sections=sections, progress_gaps=learner.gaps.count,
            longest_progress_gap_seconds=learner.gaps.longest,
        )  # fmt: skip

    def wait(seconds: float, status: WorkerStatus) -> None:
        left = seconds
        while left > 0:
            moved = min(probe, left)
            sidecar.advance(moved)
            left -= moved
            verdict = sidecar.read(status)
            assert verdict.alive, verdict.reason

    status = publish(Phase.RUNNING, None)
    sidecar.read(status)
    for kind, seconds in events:
        if kind == "step":
            wait(seconds, status)
            step += 1
            status = publish(Phase.RUNNING, sidecar.wall)
        else:
            phase = Phase.BUSY if kind == "busy" else Phase.ROLLING_BACK
            status = publish(phase, status.last_step_time, busy_since=sidecar.wall)
            sidecar.read(status)
            wait(seconds, status)
            status = publish(Phase.RUNNING, sidecar.wall)  # the end of a pause is progress
        sidecar.read(status)
    # And a hang after all that is caught at the learned deadline, far before the ceiling.
    deadline = hang_timeout(LEARNING, status)
    assert deadline < CEILING
    sidecar.advance(deadline + 0.01)
    assert not sidecar.read(status).alive

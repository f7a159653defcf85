"""The sidecar's health rules (``sidecar.health``), pure: readings and clock values in, verdicts out.

Most tests drive a sidecar that started at monotonic 0 and wall ``WALL0`` through a sequence of readings;
the properties hold for any timestamps a worker may write."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.health import GRACE, HANG, POLICY, WALL0, Sidecar
from trainer_sidecar.contract.inplace import MAX_START_DELAY_SECONDS, LauncherPhase, LauncherState
from trainer_sidecar.contract.status import Phase, WorkerStatus
from trainer_sidecar.sidecar.health import (
    OUTSIDE_STEPS_HINT,
    Clocks,
    Health,
    HealthPolicy,
    Tracking,
    assess_health,
    implausible_timestamps,
    judge,
    track,
    under_launcher,
)


def worker(**fields: Any) -> WorkerStatus:
    """A running worker (pid 7, started at ``WALL0``) at step 10, with ``fields`` on top."""
    values: dict[str, Any] = {
        "pid": 7,
        "phase": Phase.RUNNING,
        "started_at": WALL0,
        "step": 10,
        "steps_total": 10,
    }
    values.update(fields)
    return WorkerStatus(**values)


# --- the attacks: timestamps a worker may write -----------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"last_step_time": 1e308}, id="last-step-1e308"),
        pytest.param({"last_step_time": WALL0 + 3600}, id="last-step-an-hour-ahead"),
        pytest.param({"started_at": WALL0 + 3600, "last_step_time": WALL0 - 900}, id="started-in-the-future"),
        pytest.param(
            {"phase": Phase.ROLLING_BACK, "busy_since": WALL0 + 3600, "last_step_time": WALL0},
            id="rollback-busy-since-in-the-future",
        ),
        pytest.param({"updated_at": 1e300, "last_step_time": WALL0}, id="updated-in-the-future"),
        pytest.param(
            {"checkpoint_write_since": WALL0 + 3600, "last_step_time": WALL0}, id="write-in-the-future"
        ),
    ],
)
def test_future_timestamps_get_the_grace_then_are_not_alive(fields: dict[str, Any]) -> None:
    sidecar = Sidecar()
    status = worker(**fields)
    first = sidecar.read(status)
    assert first.alive
    assert not first.ready
    assert "implausible timestamps" in first.reason
    assert "ahead of the sidecar's clock" in first.reason
    sidecar.advance(GRACE)
    late = sidecar.read(status)
    assert not late.alive
    assert "implausible timestamps after the startup grace of 120 s" in late.reason
    # Forever: the clock catching up with an hour's lie is no pass either while the report stays the same.
    sidecar.advance(10 * GRACE)
    assert not sidecar.read(status).alive


def test_a_small_skew_is_tolerated() -> None:
    sidecar = Sidecar()
    status = worker(last_step_time=WALL0 + POLICY.clock_skew_seconds / 2)
    assert sidecar.read(status) == Health(alive=True, ready=True, reason=sidecar.read(status).reason)


def test_implausible_timestamps_names_each_and_counts_nan() -> None:
    # NaN cannot pass the model; the rule still treats anything that does not compare as implausible.
    status = worker().model_copy(update={"last_step_time": math.nan, "busy_since": WALL0 + 1000})
    found = implausible_timestamps(status, WALL0, 30.0)
    assert "last_step_time" in found
    assert "busy_since is 1000 s ahead" in found
    assert implausible_timestamps(worker(last_step_time=WALL0 + 30), WALL0, 30.0) == ""


def test_a_worker_that_rewrites_a_fresh_last_step_time_without_stepping_hangs() -> None:
    # The publisher keeps writing "I just stepped" but the step never moves: the sidecar's clock decides.
    sidecar = Sidecar()
    assert sidecar.read(worker(last_step_time=sidecar.wall)).alive
    for _ in range(3):
        sidecar.advance(HANG / 3)
        verdict = sidecar.read(worker(last_step_time=sidecar.wall, updated_at=sidecar.wall))
    assert verdict.alive  # exactly the hang timeout: not yet more than it
    sidecar.advance(0.5)
    verdict = sidecar.read(worker(last_step_time=sidecar.wall, updated_at=sidecar.wall))
    assert not verdict.alive
    assert verdict.reason == "no step for 30.5 s (hang timeout 30 s), last step 10" + OUTSIDE_STEPS_HINT


def test_a_hang_between_steps_names_guardian_busy_and_a_busy_worker_does_not() -> None:
    # A long evaluation without guardian.busy used to read "ranks 0, 1 hung" with no hint.
    sidecar = Sidecar()
    sidecar.read(worker(last_step_time=sidecar.wall))
    sidecar.advance(HANG + 1)
    verdict = sidecar.read(worker(last_step_time=WALL0))
    assert not verdict.alive
    assert verdict.reason.endswith('wrap that in guardian.busy("eval")')
    assert len(verdict.reason) < 200  # bounded: a fixed text after the numbers
    # An older worker that states its phase busy without a start is judged as stepping: not between steps.
    busy = Sidecar()
    busy.read(worker(last_step_time=busy.wall))
    busy.advance(HANG + 1)
    verdict = busy.read(worker(last_step_time=WALL0, phase=Phase.BUSY))
    assert not verdict.alive
    assert "guardian.busy" not in verdict.reason


def test_after_a_sidecar_restart_an_old_plausible_last_step_is_a_hang_at_once() -> None:
    sidecar = Sidecar()
    verdict = sidecar.read(worker(last_step_time=WALL0 - 2 * HANG, started_at=WALL0 - 1000))
    assert not verdict.alive
    assert "no step for 60.0 s" in verdict.reason


def test_a_stepping_worker_stays_alive_and_ready() -> None:
    sidecar = Sidecar()
    for step in range(11, 40):
        sidecar.advance(HANG * 0.9)
        verdict = sidecar.read(worker(step=step, steps_total=step, last_step_time=sidecar.wall - 1))
        assert verdict.alive, verdict.reason
        assert verdict.ready


def test_a_slow_step_after_a_sidecar_restart_is_judged_by_the_hang_timeout_not_the_grace() -> None:
    # The sidecar restarts while a worker makes one step per 100 s (hang 150, grace 60): the worker's
    # claim of a step of this run keeps it out of the "starting" grace.
    sidecar = Sidecar(HealthPolicy(hang_timeout_seconds=150.0, startup_grace_seconds=60.0))
    status = worker(started_at=WALL0 - 5000, last_step_time=WALL0 - 10)
    assert sidecar.read(status).alive
    sidecar.advance(100)
    assert sidecar.read(status).alive


def test_a_restarted_worker_gets_a_fresh_grace_from_when_the_sidecar_saw_it() -> None:
    sidecar = Sidecar()
    assert sidecar.read(worker(last_step_time=sidecar.wall)).alive
    sidecar.advance(10 * GRACE)
    assert not sidecar.read(worker(last_step_time=WALL0)).alive
    # The worker restarted beside the sidecar: a new pid and start, the last step of the run before.
    restarted = worker(pid=8, started_at=sidecar.wall, step=10, last_step_time=WALL0)
    fresh = sidecar.read(restarted)
    assert fresh.alive
    assert not fresh.ready
    assert fresh.reason.startswith("starting: no step yet")
    sidecar.advance(GRACE - 1)
    assert sidecar.read(restarted).alive
    sidecar.advance(1)
    late = sidecar.read(restarted)
    assert not late.alive
    assert late.reason == "no step within startup grace of 120 s (worker started 120 s ago)"


def test_the_first_worker_s_grace_counts_from_the_sidecar_start() -> None:
    sidecar = Sidecar()
    sidecar.advance(GRACE - 10)
    assert sidecar.read(None, "status file s does not exist yet").alive
    sidecar.advance(5)
    starting = worker(started_at=sidecar.wall, last_step_time=None)
    assert sidecar.read(starting).alive
    sidecar.advance(5)
    assert not sidecar.read(starting).alive


def test_an_unreadable_status_is_no_progress() -> None:
    sidecar = Sidecar()
    status = worker(last_step_time=sidecar.wall)
    assert sidecar.read(status).alive
    sidecar.advance(1)
    assert sidecar.read(worker(step=11, steps_total=11, last_step_time=sidecar.wall)).alive
    sidecar.advance(HANG / 2)
    fifo = "status file s is a FIFO, not a regular file"
    assert sidecar.read(None, fifo).alive  # within the grace and the hang timeout
    sidecar.advance(HANG / 2 + 1)
    verdict = sidecar.read(None, fifo)
    assert not verdict.alive
    assert verdict.reason == f"no readable worker status and no step for 31.0 s (hang timeout 30 s): {fifo}"
    # The file coming back unchanged is no progress either.
    assert not sidecar.read(worker(step=11, steps_total=11, last_step_time=WALL0 + 1)).alive


def test_an_unreadable_status_of_a_worker_not_yet_stepping_gets_the_grace() -> None:
    sidecar = Sidecar()
    assert sidecar.read(worker(last_step_time=None)).alive
    sidecar.advance(GRACE - 1)
    assert sidecar.read(None, "garbage").alive
    sidecar.advance(1)
    verdict = sidecar.read(None, "garbage")
    assert not verdict.alive
    assert verdict.reason == "no readable worker status after the startup grace of 120 s: garbage"


def test_a_rollback_is_timed_on_the_sidecar_clock() -> None:
    sidecar = Sidecar()
    assert sidecar.read(worker(last_step_time=sidecar.wall)).ready
    sidecar.advance(HANG / 2)
    # busy_since claims the rollback began just now, every time: the sidecar counts from when it saw it.
    for _ in range(int(GRACE // HANG)):
        rolling = worker(phase=Phase.ROLLING_BACK, busy_since=sidecar.wall, last_step_time=WALL0)
        verdict = sidecar.read(rolling)
        assert verdict.alive
        assert not verdict.ready
        assert verdict.reason.startswith("rolling back at step 10")
        sidecar.advance(HANG)
    rolling = worker(phase=Phase.ROLLING_BACK, busy_since=sidecar.wall, last_step_time=WALL0)
    verdict = sidecar.read(rolling)
    assert not verdict.alive
    assert verdict.reason == "rollback at step 10 not done within the startup grace of 120 s (120 s)"


def test_the_end_of_a_rollback_restarts_the_hang_clock() -> None:
    sidecar = Sidecar()
    sidecar.read(worker(last_step_time=sidecar.wall))
    sidecar.read(worker(phase=Phase.ROLLING_BACK, busy_since=sidecar.wall, last_step_time=sidecar.wall))
    sidecar.advance(GRACE - 1)  # far beyond the hang timeout, within the grace
    # Back to running at the same step (the snapshot was of this very step): the phase change is progress.
    verdict = sidecar.read(worker(step=10, last_step_time=sidecar.wall))
    assert verdict.alive
    assert verdict.ready


@pytest.mark.parametrize("phase", [Phase.DIVERGED, Phase.FAILED])
def test_a_diverged_or_failed_worker_is_not_alive_whatever_its_timestamps(phase: Phase) -> None:
    sidecar = Sidecar()
    verdict = sidecar.read(worker(phase=phase, last_step_time=1e308, message="too many rollbacks"))
    assert verdict == Health(
        alive=False, ready=False, reason=f"worker phase is {phase.value}: too many rollbacks"
    )


def test_a_finished_worker_stays_alive_without_steps() -> None:
    sidecar = Sidecar()
    done = worker(phase=Phase.FINISHED, last_step_time=WALL0 - 10_000)
    for _ in range(5):
        assert sidecar.read(done) == Health(alive=True, ready=True, reason="worker finished at step 10")
        sidecar.advance(GRACE + HANG)


def test_tracking_ignores_what_is_not_progress() -> None:
    tracking = Tracking.begin(0.0)
    first = track(tracking, worker(loss=1.0, updated_at=WALL0), 1.0)
    again = track(first, worker(loss=2.0, updated_at=WALL0 + 5, last_step_time=WALL0 + 5), 2.0)
    assert again == first
    assert not first.stepped
    stepped = track(again, worker(step=11, steps_total=11), 3.0)
    assert (stepped.progress_since, stepped.stepped) == (3.0, True)
    assert track(stepped, None, 4.0) == stepped


# --- the kubelet's kill of a hung worker waits for its checkpoint write in flight ----------------------


def hung(sidecar: Sidecar, **fields: Any) -> Health:
    """The verdict on a worker that stepped at the sidecar's start and not since, ``HANG + 1`` s later."""
    sidecar.read(worker(last_step_time=sidecar.wall))
    sidecar.advance(HANG + 1)
    return sidecar.read(worker(last_step_time=WALL0, **fields))


def test_a_hung_workers_kill_waits_while_its_write_is_expected_to_finish_and_not_longer() -> None:
    sidecar = Sidecar()
    # Its last write took 4 s; this one started 1 s before the hang was seen: expected within 8 s.
    verdict = hung(sidecar, checkpoint_write_since=WALL0 + HANG, checkpoint_seconds=4.0)
    assert not verdict.alive  # the verdict the operator acts on is unchanged
    assert verdict.kill_held
    assert verdict.liveness_passes
    assert verdict.reason.startswith("no step for 31.0 s")
    assert verdict.reason.endswith(
        "the kill waits for its checkpoint write in flight for 1 s (expected within 8 s)"
    )
    sidecar.advance(6.5)
    assert sidecar.read(
        worker(last_step_time=WALL0, checkpoint_write_since=WALL0 + HANG, checkpoint_seconds=4.0)
    ).kill_held
    sidecar.advance(1.0)
    late = sidecar.read(
        worker(last_step_time=WALL0, checkpoint_write_since=WALL0 + HANG, checkpoint_seconds=4.0)
    )
    assert not late.kill_held
    assert not late.liveness_passes
    assert "the kill waits" not in late.reason


def test_without_a_write_in_flight_a_hung_worker_fails_liveness_at_once() -> None:
    verdict = hung(Sidecar(), checkpoint_seconds=4.0)
    assert not verdict.alive
    assert not verdict.kill_held
    assert not verdict.liveness_passes


def test_a_write_that_should_have_ended_holds_nothing() -> None:
    # A hang that began after a write the status still shows (a hung main thread publishes nothing new).
    verdict = hung(Sidecar(), checkpoint_write_since=WALL0 - 100, checkpoint_seconds=4.0)
    assert not verdict.liveness_passes


def test_a_first_write_holds_the_kill_for_at_most_the_startup_grace() -> None:
    sidecar = Sidecar()
    since = WALL0 + 1  # a write began a second after the last step, then the worker hung
    assert hung(sidecar, checkpoint_write_since=since).kill_held  # no write finished yet: nothing known
    sidecar.advance(GRACE - HANG - 3)
    assert sidecar.read(worker(last_step_time=WALL0, checkpoint_write_since=since)).kill_held
    sidecar.advance(3)
    assert not sidecar.read(worker(last_step_time=WALL0, checkpoint_write_since=since)).liveness_passes


def test_a_worker_renewing_its_write_cannot_hold_its_kill_past_the_sidecars_bound() -> None:
    # Every reading claims a write started just now: held until the hang ceiling plus the startup grace
    # after its last progress, whatever it claims.
    sidecar = Sidecar()
    hung(sidecar)
    held_until = 0.0
    for _ in range(int(GRACE + HANG) + 10):
        verdict = sidecar.read(
            worker(last_step_time=WALL0, checkpoint_write_since=sidecar.wall - 0.5, checkpoint_seconds=60.0)
        )
        assert not verdict.alive
        if verdict.kill_held:
            held_until = sidecar.monotonic
        sidecar.advance(1.0)
    assert GRACE + HANG - 1 <= held_until < GRACE + HANG


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"phase": Phase.DIVERGED, "message": "NaN loss"}, id="diverged"),
        pytest.param({"phase": Phase.FAILED, "message": "config"}, id="failed"),
    ],
)
def test_a_worker_that_failed_by_its_own_account_is_never_held(fields: dict[str, Any]) -> None:
    sidecar = Sidecar()
    sidecar.read(worker(last_step_time=sidecar.wall))
    verdict = sidecar.read(worker(checkpoint_write_since=sidecar.wall, checkpoint_seconds=4.0, **fields))
    assert not verdict.liveness_passes


@given(
    policy=st.builds(
        HealthPolicy,
        hang_timeout_seconds=st.floats(min_value=0.01, max_value=1e5, allow_nan=False),
        startup_grace_seconds=st.floats(min_value=0.0, max_value=1e5, allow_nan=False),
    ),
    write_age=st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    last_write=st.none() | st.floats(min_value=0.0, max_value=1e308, allow_nan=False, allow_infinity=False),
    stalled=st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
    wall_offset=st.floats(min_value=-1e4, max_value=1e4, allow_nan=False),
    phase=st.sampled_from([Phase.STARTING, Phase.RUNNING, Phase.ROLLING_BACK, Phase.BUSY]),
)
def test_a_held_kill_is_bounded_by_the_write_and_by_the_sidecars_own_limits(
    policy: HealthPolicy,
    write_age: float,
    last_write: float | None,
    stalled: float,
    wall_offset: float,
    phase: Phase,
) -> None:
    # The sidecar first sees the worker (its last progress) at monotonic 0, then ``stalled`` s later.
    clocks = Clocks(monotonic=stalled, wall=WALL0 + stalled + wall_offset)
    status = worker(
        phase=phase,
        last_step_time=WALL0,
        busy_since=WALL0 if phase in (Phase.ROLLING_BACK, Phase.BUSY) else None,
        checkpoint_write_since=clocks.wall - write_age,
        checkpoint_seconds=last_write,
    )
    _, tracking = assess_health(Tracking.begin(0.0), status, "unreadable", Clocks(0.0, WALL0), policy)
    health, _ = assess_health(tracking, status, "unreadable", clocks, policy)
    assert status.checkpoint_write_since is not None
    write_age = clocks.wall - status.checkpoint_write_since  # as rounded in the status
    if health.kill_held:
        assert not health.alive
        assert health.liveness_passes
        assert write_age < policy.startup_grace_seconds
        assert stalled < policy.hang_timeout_seconds + policy.startup_grace_seconds
        if last_write is not None:
            assert write_age < 2 * last_write
        assert "the kill waits for its checkpoint write in flight" in health.reason
    else:
        assert health.liveness_passes == health.alive


# --- properties ----------------------------------------------------------------------------------------

any_timestamp = st.none() | st.floats(min_value=0.0, max_value=1e308, allow_nan=False, allow_infinity=False)
near_timestamp = st.none() | st.floats(min_value=-1e6, max_value=1e6, allow_nan=False).map(
    lambda d: WALL0 + d
)
live_phases = st.sampled_from([Phase.STARTING, Phase.RUNNING, Phase.ROLLING_BACK])
timestamps = st.one_of(any_timestamp, near_timestamp)
policies = st.builds(
    HealthPolicy,
    hang_timeout_seconds=st.floats(min_value=0.01, max_value=1e5, allow_nan=False),
    startup_grace_seconds=st.floats(min_value=0.0, max_value=1e5, allow_nan=False),
    clock_skew_seconds=st.floats(min_value=0.0, max_value=120.0, allow_nan=False),
)


@st.composite
def frozen_worker_readings(draw: st.DrawFn) -> list[WorkerStatus | None]:
    """Readings of one worker whose progress never changes (same pid, start, phase, step, step count)
    while its other fields, timestamps included, say anything; some readings fail."""
    identity = {
        "pid": draw(st.integers(0, 2**22)),
        "started_at": draw(st.floats(min_value=0.0, max_value=WALL0 + 1e6, allow_nan=False)),
        "phase": draw(live_phases),
        "step": draw(st.integers(0, 10**9)),
        "steps_total": draw(st.integers(0, 10**9)),
    }
    readings: list[WorkerStatus | None] = []
    for _ in range(draw(st.integers(1, 12))):
        if draw(st.booleans()) and draw(st.booleans()):
            readings.append(None)
            continue
        readings.append(
            WorkerStatus(
                **identity,
                last_step_time=draw(timestamps),
                busy_since=draw(timestamps),
                updated_at=draw(timestamps) or 0.0,
                loss=draw(st.none() | st.floats(allow_nan=False, allow_infinity=False)),
            )
        )
    return readings


@given(
    readings=frozen_worker_readings(),
    policy=policies,
    gaps=st.lists(st.floats(min_value=0.0, max_value=1e5, allow_nan=False), min_size=12, max_size=12),
    wall_offsets=st.lists(
        st.floats(min_value=-1e7, max_value=1e7, allow_nan=False), min_size=12, max_size=12
    ),
    probe_period=st.floats(min_value=0.01, max_value=1e4, allow_nan=False),
)
def test_a_worker_whose_progress_does_not_change_is_declared_dead_after_grace_and_hang(
    readings: Sequence[WorkerStatus | None],
    policy: HealthPolicy,
    gaps: Sequence[float],
    wall_offsets: Sequence[float],
    probe_period: float,
) -> None:
    tracking = Tracking.begin(0.0)
    monotonic, first_seen = 0.0, 0.0
    for reading, gap, offset in zip(readings, gaps, wall_offsets, strict=False):
        monotonic += gap
        if reading is not None and tracking.identity is None:
            first_seen = monotonic
        clocks = Clocks(monotonic=monotonic, wall=WALL0 + offset)
        _, tracking = assess_health(tracking, reading, "unreadable", clocks, policy)
    # One probe period past the grace and the hang timeout after the sidecar first saw the worker (a
    # rollback's allowance counts from when it was seen to begin), whatever the wall clock reads, the
    # verdict is "not alive" (and stays so).
    deadline = first_seen + policy.startup_grace_seconds + policy.hang_timeout_seconds + probe_period
    last = readings[-1]
    for offset in (0.0, -1e9, 1e9):
        clocks = Clocks(monotonic=max(monotonic, deadline), wall=WALL0 + offset)
        health = judge(track(tracking, last, clocks.monotonic), last, "unreadable", clocks, policy)
        assert not health.alive, health.reason
        assert not health.ready
        assert health.reason


@st.composite
def any_readings(draw: st.DrawFn) -> list[tuple[WorkerStatus | None, float, float]]:
    """A sequence of arbitrary statuses (or none) with arbitrary, even backwards, clock readings."""
    out = []
    for _ in range(draw(st.integers(1, 10))):
        status = draw(
            st.none()
            | st.builds(
                WorkerStatus,
                pid=st.integers(0, 3),
                started_at=st.floats(min_value=0.0, max_value=1e308, allow_nan=False, allow_infinity=False),
                phase=st.sampled_from(list(Phase)),
                step=st.integers(0, 3),
                steps_total=st.integers(0, 3),
                last_step_time=any_timestamp,
                busy_since=any_timestamp,
                message=st.text(max_size=20),
            )
        )
        clocks = draw(st.tuples(st.floats(-1e12, 1e12), st.floats(0.0, 1e12)))
        out.append((status, *clocks))
    return out


@given(readings=any_readings(), policy=policies)
def test_any_sequence_of_readings_and_clocks_gives_a_verdict(
    readings: list[tuple[WorkerStatus | None, float, float]], policy: HealthPolicy
) -> None:
    tracking = Tracking.begin(0.0)
    for status, monotonic, wall in readings:
        health, tracking = assess_health(tracking, status, "why", Clocks(monotonic, wall), policy)
        assert isinstance(health.alive, bool)
        assert health.reason
        assert not (health.ready and not health.alive)


# Ported from the wall-clock rules: the same promises hold for a sidecar that has just started.

times = st.floats(min_value=1e9, max_value=2e9, allow_nan=False)
durations = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
positive_durations = st.floats(min_value=0.01, max_value=1e6, allow_nan=False)


def _fresh(now: float, status: WorkerStatus | None, hang: float, grace: float) -> Health:
    """The verdict of a sidecar started at this moment, on its first reading."""
    return assess_health(Tracking.begin(0.0), status, "", Clocks(0.0, now), HealthPolicy(hang, grace))[0]


@given(
    started=times,
    step_offset=st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    hang=positive_durations,
    grace=durations,
    over=positive_durations,
    phase=live_phases,
)
def test_a_step_older_than_the_hang_timeout_past_grace_is_never_alive(
    started: float, step_offset: float, hang: float, grace: float, over: float, phase: Phase
) -> None:
    last_step = started + step_offset
    now = max(last_step + hang, started + grace) + over
    status = WorkerStatus(phase=phase, started_at=started, last_step_time=last_step, step=5)
    health = _fresh(now, status, hang, grace)
    assert not health.alive
    assert not health.ready
    assert health.reason


@given(
    started=times,
    stepped_after=durations,
    hang=positive_durations,
    fraction=st.floats(min_value=0.0, max_value=0.99, allow_nan=False),
    grace=durations,
    phase=live_phases,
)
def test_a_recent_step_is_alive_and_ready(
    started: float, stepped_after: float, hang: float, fraction: float, grace: float, phase: Phase
) -> None:
    last_step = started + stepped_after
    status = WorkerStatus(phase=phase, started_at=started, last_step_time=last_step)
    health = _fresh(last_step + hang * fraction, status, hang, grace)
    assert health.alive
    assert health.ready


@given(
    started=times,
    elapsed_fraction=st.floats(min_value=0.0, max_value=0.99, allow_nan=False),
    grace=st.floats(min_value=0.1, max_value=1e6, allow_nan=False),
    previous_step=st.none() | st.floats(min_value=1.0, max_value=1e6, allow_nan=False),
    hang=positive_durations,
    phase=live_phases,
)
def test_a_worker_without_a_step_in_this_run_gets_its_grace(
    started: float,
    elapsed_fraction: float,
    grace: float,
    previous_step: float | None,
    hang: float,
    phase: Phase,
) -> None:
    last_step = None if previous_step is None else started - previous_step
    status = WorkerStatus(phase=phase, started_at=started, last_step_time=last_step)
    health = _fresh(started + grace * elapsed_fraction, status, hang, grace)
    assert health.alive
    assert not health.ready
    assert "starting" in health.reason


@given(
    started=times,
    last_step_age=st.floats(min_value=0.0, max_value=10.0, allow_nan=False),
    hang=positive_durations,
    grace=positive_durations,
    busy_fraction=st.floats(min_value=0.0, max_value=3.0, allow_nan=False),
)
def test_a_rollback_gets_the_startup_grace_not_the_hang_timeout(
    started: float, last_step_age: float, hang: float, grace: float, busy_fraction: float
) -> None:
    busy_since = started + 10.0
    now = busy_since + grace * busy_fraction
    status = WorkerStatus(
        phase=Phase.ROLLING_BACK,
        started_at=started,
        last_step_time=busy_since - last_step_age,
        busy_since=busy_since,
        step=7,
    )
    health = _fresh(now, status, hang, grace)
    assert not health.ready
    assert health.alive == (now - busy_since < grace)
    assert "step 7" in health.reason
    # Without the marker (an older worker), the hang timeout applies as before.
    legacy = status.model_copy(update={"busy_since": None})
    last_step = busy_since - last_step_age
    assert _fresh(now, legacy, hang, grace).alive == (now - last_step <= hang)


@given(
    waited_fraction=st.floats(min_value=0.0, max_value=0.99, allow_nan=False),
    grace=st.floats(min_value=0.1, max_value=1e6, allow_nan=False),
    over=positive_durations,
    read_error=st.text(min_size=1, max_size=40),
)
def test_no_status_gets_the_grace_from_the_sidecar_start_then_is_not_alive(
    waited_fraction: float, grace: float, over: float, read_error: str
) -> None:
    policy = HealthPolicy(hang_timeout_seconds=1.0, startup_grace_seconds=grace)
    tracking = Tracking.begin(100.0)
    within = judge(tracking, None, read_error, Clocks(100.0 + grace * waited_fraction, WALL0), policy)
    assert within.alive
    assert not within.ready
    assert read_error in within.reason
    after = judge(tracking, None, read_error, Clocks(100.0 + grace + over, WALL0), policy)
    assert not after.alive
    assert read_error in after.reason


def test_reasons_name_the_numbers() -> None:
    status = WorkerStatus(started_at=1000.0, last_step_time=2000.0, step=17)
    assert _fresh(2010.5, status, 5.0, 600.0).reason == "no step for 10.5 s (hang timeout 5 s), last step 17"
    late = WorkerStatus(started_at=1000.0)
    assert "no step within startup grace of 600 s" in _fresh(1700.0, late, 5.0, 600.0).reason


@pytest.mark.parametrize(
    ("asked", "allowed"),
    [(None, GRACE), (50.0, 50.0), (10 * GRACE, GRACE)],  # the grace by default; never more than the grace
)
def test_a_busy_section_is_allowed_what_it_asked_on_the_sidecar_clock(
    asked: float | None, allowed: float
) -> None:
    sidecar = Sidecar()
    assert sidecar.read(worker(last_step_time=sidecar.wall)).ready
    sidecar.advance(1)

    def busy() -> WorkerStatus:  # busy_since claims "just now" every time: the sidecar counts for itself
        return worker(
            phase=Phase.BUSY,
            busy_since=sidecar.wall,
            busy_reason="eval",
            busy_seconds=asked,
            last_step_time=WALL0,
        )

    elapsed = 0.0
    while elapsed + HANG / 2 < allowed:
        verdict = sidecar.read(busy())
        assert verdict.alive, verdict.reason
        assert "eval" in verdict.reason
        sidecar.advance(HANG / 2)
        elapsed += HANG / 2
    sidecar.advance(allowed - elapsed + 1)
    verdict = sidecar.read(busy())
    assert not verdict.alive
    assert f"longer than the {allowed:g} s allowed" in verdict.reason


def test_a_stopped_worker_is_alive_while_it_exits() -> None:
    sidecar = Sidecar()
    sidecar.read(worker(last_step_time=sidecar.wall))
    sidecar.advance(10 * GRACE)
    verdict = sidecar.read(worker(phase=Phase.STOPPED, message="stopped by SIGTERM at step 10"))
    assert verdict.alive
    assert not verdict.ready
    assert "SIGTERM" in verdict.reason


def test_a_worker_failing_with_its_exit_code_is_alive_while_it_ends_then_not() -> None:
    # The guardian publishes failed with the code it exits with as its process ends: a crash in progress,
    # not a hang (until the exit, the executor would otherwise blame it before the peer that caused it).
    sidecar = Sidecar()
    assert sidecar.read(worker(step=10, last_step_time=sidecar.wall)).alive
    failing = worker(phase=Phase.FAILED, step=10, exit_code=1, message="RuntimeError: peer gone")
    verdict = sidecar.read(failing)
    assert verdict == Health(
        alive=True,
        ready=False,
        reason="worker failed at step 10: RuntimeError: peer gone; its process is ending",
    )
    sidecar.advance(HANG + 1)  # it never ended: not alive, so the executor acts
    verdict = sidecar.read(failing)
    assert not verdict.alive
    assert "its process did not end within" in verdict.reason


# --- under the launcher (trainguard-launch restarts the worker in place) ---------------------------------


def launched(phase: LauncherPhase, since: float, attempt: int = 2, **fields: Any) -> LauncherState:
    return LauncherState(attempt=attempt, phase=phase, since=since, updated_at=since, **fields)


def test_without_a_launcher_the_status_files_verdict_stands() -> None:
    health = Health(alive=False, ready=False, reason="hung")
    clocks = Clocks(monotonic=5.0, wall=WALL0 + 5)
    assert under_launcher(health, None, worker(), clocks, POLICY) is health


def test_an_exited_worker_is_not_alive_at_once_and_its_kill_waits_for_an_order_within_the_grace() -> None:
    alive = Health(alive=True, ready=True, reason="stepping")  # its last status still looks fine
    exited = launched(LauncherPhase.EXITED, WALL0, exit_code=137)
    early = under_launcher(alive, exited, worker(), Clocks(1.0, WALL0 + 1), POLICY)
    assert (early.alive, early.kill_held, early.liveness_passes) == (False, True, True)
    assert "exited with code 137" in early.reason
    assert "waits for an order" in early.reason
    late = under_launcher(alive, exited, worker(), Clocks(GRACE, WALL0 + GRACE), POLICY)
    assert (late.alive, late.kill_held) == (False, False)


def test_a_launcher_claiming_a_start_in_the_future_holds_nothing_and_excuses_nothing() -> None:
    now = Clocks(0.0, WALL0)
    exited = launched(LauncherPhase.EXITED, WALL0 + 3600, exit_code=1)
    verdict = under_launcher(Health(True, True, "ok"), exited, None, now, POLICY)
    assert (verdict.alive, verdict.kill_held) == (False, False)
    assert "ahead of the sidecar's clock" in verdict.reason
    # A running state that would excuse a stale status forever is ignored: the file's verdict stands.
    hung = Health(alive=False, ready=False, reason="no progress")
    running = launched(LauncherPhase.RUNNING, WALL0 + 3600)
    assert under_launcher(hung, running, worker(), now, POLICY) is hung


def test_a_worker_being_stopped_for_an_ordered_attempt_is_not_alive_with_its_kill_held() -> None:
    stopping = launched(LauncherPhase.STOPPING, WALL0)
    health = under_launcher(Health(False, False, "hung"), stopping, worker(), Clocks(2.0, WALL0 + 2), POLICY)
    assert (health.alive, health.kill_held) == (False, True)
    assert "stopping the worker for attempt 2" in health.reason


def test_a_delayed_start_holds_the_kill_through_the_backoff_then_for_the_grace() -> None:
    # An order with the gang's backoff: the worker is stopped at once, the attempt starts 30 s later.
    waiting = launched(LauncherPhase.STOPPING, WALL0, starts_at=WALL0 + 30)
    file = Health(False, False, "hung")

    def at(seconds: float) -> Health:
        return under_launcher(file, waiting, worker(), Clocks(seconds, WALL0 + seconds), POLICY)

    assert (at(20).alive, at(20).kill_held) == (False, True)
    assert "starts in 10 s" in at(20).reason
    assert at(30 + GRACE - 1).kill_held
    assert not at(30 + GRACE).kill_held
    # A start claimed beyond the longest delay an order may ask holds no longer than that delay allows.
    far = launched(LauncherPhase.STOPPING, WALL0, starts_at=WALL0 + 10 * MAX_START_DELAY_SECONDS)
    late = WALL0 + MAX_START_DELAY_SECONDS + GRACE
    assert not under_launcher(file, far, worker(), Clocks(0.0, late), POLICY).kill_held


def test_the_previous_attempts_status_is_a_start_in_place_with_a_fresh_grace() -> None:
    hung = Health(alive=False, ready=False, reason="no progress for 40 s")
    running = launched(LauncherPhase.RUNNING, WALL0 + 100)
    old = worker(started_at=WALL0)
    start = under_launcher(hung, running, old, Clocks(101.0, WALL0 + 101), POLICY)
    assert (start.alive, start.ready) == (True, False)
    assert "attempt 2 started in place" in start.reason
    over = under_launcher(hung, running, old, Clocks(100.0 + GRACE, WALL0 + 100 + GRACE), POLICY)
    assert not over.alive
    assert "no status within the startup grace" in over.reason
    # The new worker's own status is judged by the status file's rules again.
    new = worker(started_at=WALL0 + 100.5)
    assert under_launcher(hung, running, new, Clocks(101.0, WALL0 + 101), POLICY) is hung


@given(
    phase=st.sampled_from(list(LauncherPhase)),
    started=st.floats(min_value=0, max_value=2 * WALL0),
    now=st.floats(min_value=0, max_value=1e6),
    alive=st.booleans(),
    status_started=st.none() | st.floats(min_value=0, max_value=2 * WALL0),
)
def test_the_launcher_never_makes_a_verdict_inconsistent_or_holds_past_the_grace(
    phase: LauncherPhase, started: float, now: float, alive: bool, status_started: float | None
) -> None:
    health = Health(alive=alive, ready=alive, reason="file")
    status = None if status_started is None else worker(started_at=status_started)
    wall = WALL0 + now
    verdict = under_launcher(health, launched(phase, started), status, Clocks(now, wall), POLICY)
    assert not (verdict.alive and verdict.kill_held)
    assert not (verdict.ready and not verdict.alive)
    if verdict.kill_held:
        assert started <= wall + POLICY.clock_skew_seconds
        assert wall - min(started, wall) < GRACE
    if verdict.alive and not health.alive:  # excused as a start in place: only within the grace
        assert wall - POLICY.clock_skew_seconds <= started + GRACE
    if phase is not LauncherPhase.RUNNING:
        assert not verdict.alive

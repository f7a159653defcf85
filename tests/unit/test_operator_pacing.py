"""When a job's daemon steps next (``operator/pacing.py``)."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st
from trainguard_operator.pacing import LastStep, Outcome, wait_before_step

times = st.floats(min_value=0, max_value=1e6, allow_nan=False)
requeues = st.floats(min_value=0, max_value=3600, allow_nan=False)


@given(requeue=requeues, clock=st.booleans(), finished=times, elapsed=times)
def test_a_change_or_no_step_yet_calls_for_a_step_now(
    requeue: float, clock: bool, finished: float, elapsed: float
) -> None:
    last = LastStep(finished, Outcome(requeue, done=False, clock=clock))
    assert wait_before_step(None, False, finished + elapsed) == 0.0
    assert wait_before_step(last, True, finished + elapsed) == 0.0


@given(requeue=requeues, finished=times, elapsed=times)
@example(requeue=10.0, finished=100.0, elapsed=10.0)  # exactly due
def test_by_the_clock_the_wait_is_what_is_left_of_the_requeue(
    requeue: float, finished: float, elapsed: float
) -> None:
    last = LastStep(finished, Outcome(requeue, done=False))
    now = finished + elapsed
    elapsed = now - finished  # as the clock's floats see it
    wait = wait_before_step(last, False, now)
    assert wait is not None
    assert 0.0 <= wait <= requeue
    if elapsed >= requeue:
        assert wait == 0.0  # due: step now
    else:
        assert wait == requeue - elapsed
    # Later is never further from the step.
    later = wait_before_step(last, False, now + 1.0)
    assert later is not None
    assert later <= wait


@given(requeue=requeues, finished=times, elapsed=times)
def test_a_step_without_a_clock_waits_only_for_a_change(
    requeue: float, finished: float, elapsed: float
) -> None:
    last = LastStep(finished, Outcome(requeue, done=False, clock=False))
    assert wait_before_step(last, False, finished + elapsed) is None
    assert Outcome(requeue, done=False, clock=False).wait_seconds() is None
    assert Outcome(requeue, done=False).wait_seconds() == requeue

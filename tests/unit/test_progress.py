"""The progress clock: steps set progress time; the end of a pause does so only once there was progress."""

from __future__ import annotations

import time

from trainer_sidecar.guardian.progress import ProgressClock


def test_no_progress_before_the_first_step_even_when_a_pause_ends() -> None:
    clock = ProgressClock()
    clock.pause_ended(100.0)
    assert clock.last is None


def test_a_step_is_progress_and_so_is_the_end_of_a_pause_after_it() -> None:
    clock = ProgressClock()
    clock.stepped(100.0)
    assert clock.last == 100.0
    clock.pause_ended(250.0)
    assert clock.last == 250.0


def test_without_a_time_the_clock_reads_the_current_one() -> None:
    clock = ProgressClock()
    before = time.time()
    clock.stepped()
    assert clock.last is not None
    assert before <= clock.last <= time.time()

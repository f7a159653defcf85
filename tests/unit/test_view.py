"""The live table and the plain event lines of ``trainguard run``."""

from __future__ import annotations

import io
import time
from types import SimpleNamespace
from typing import Any

from rich.console import Console

from trainer_sidecar.contract.status import Phase, WorkerStatus
from trainguard.core.observation import observe_gang
from trainguard.core.summary import Pace, duration_text
from trainguard.local.supervisor import Event
from trainguard.local.view import LiveView, PlainView, state_text, step_text


def fake_runner(step: int) -> Any:
    status = WorkerStatus(phase=Phase.RUNNING, step=step, loss=2.5, skipped_steps=3, rollbacks=1,
                          samples_seen=1000, samples_dropped=2, started_at=1.0)  # fmt: skip
    view = observe_gang({0: status}, 1)
    pace = Pace(steps_per_second=2.5, eta_seconds=3725.0, lost_seconds=42.0)
    return SimpleNamespace(
        gang_view=lambda: view, job=SimpleNamespace(metadata=SimpleNamespace(name="demo")),
        attempt=2, restarts=1, record=SimpleNamespace(pace=lambda now: pace),
    )  # fmt: skip


def test_live_view_draws_the_gang_state_and_prints_events() -> None:
    buffer = io.StringIO()
    view = LiveView(Console(file=buffer, force_terminal=True, width=140, color_system=None))
    view.event(Event(time.time(), "rollback", "rolled back to the last clean snapshot", 2, 120))
    view.update(fake_runner(120))
    view.close()
    text = buffer.getvalue()
    assert "rolled back to the last clean snapshot" in text
    for column in (
        "attempt",
        "state",
        "step",
        "loss",
        "steps/s",
        "eta",
        "lost",
        "skipped",
        "rollbacks",
        "restarts",
        "drop rate",
    ):
        assert column in text
    assert "running" in text
    assert "0.2000%" in text  # 2 of 1000 samples dropped
    # The run record's pace: 2.5 steps/s, 1h02m to max steps, 42 s lost to recoveries.
    assert "2.50" in text
    assert "1h02m" in text
    assert "42s" in text


def test_durations_read_as_a_person_would_say_them() -> None:
    assert [duration_text(s) for s in (None, 0.4, 59.6, 425, 3600 + 125)] == [
        "-",
        "0s",
        "1m00s",
        "7m05s",
        "1h02m",
    ]


def test_plain_view_prints_one_line_per_event() -> None:
    stream = io.StringIO()
    view = PlainView(stream)
    view.event(Event(view.origin + 1.5, "failure", "rank 1 hung: no step for 5 s", 1))
    view.update(fake_runner(10))
    assert stream.getvalue() == "[    1.5s] failure    attempt 1: rank 1 hung: no step for 5 s\n"


def test_the_table_shows_the_gangs_step_and_each_ranks_phase_when_they_differ() -> None:
    def ranked(step: int, phase: Phase) -> WorkerStatus:
        return WorkerStatus(phase=phase, step=step, started_at=1.0)

    agreed = observe_gang({0: ranked(7, Phase.RUNNING), 1: ranked(7, Phase.RUNNING)}, 2)
    assert (state_text(agreed), step_text(agreed)) == ("running", "7")
    split = observe_gang(
        {0: ranked(41, Phase.RUNNING), 1: ranked(40, Phase.DIVERGED), 2: ranked(42, Phase.RUNNING)}, 4
    )
    assert state_text(split) == "1:diverged, 0:running, 2:running (no report: rank 3)"
    assert step_text(split) == "40 (rank 2 at 42)"  # the slowest rank's step is the gang's
    assert (state_text(observe_gang({}, 2)), step_text(observe_gang({}, 2))) == ("starting", "0")

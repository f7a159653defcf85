"""From a run's recorded timeline to its summary: goodput, time lost to each incident, the figures.

Pure functions over plain records, so the same arithmetic serves ``trainguard run`` and tests.

Goodput is the share of wall time spent computing steps that the final model kept. The final
model's history is rebuilt backwards: the last attempt's progress from its resume step to the end
was kept; the steps before its resume step were kept from the latest earlier stretch of progress
that reached that step; and so on. Stretches end where an attempt ended or where the step counter
went backwards (an in-process rollback): time spent on steps that were thrown away is not goodput.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """One observation of rank 0's progress: wall time, attempt, and the step it had completed."""

    time: float
    attempt: int
    step: int


@dataclass(frozen=True)
class Stretch:
    """Uninterrupted forward progress: ``start_step`` at ``start_time`` to ``end_step`` at ``end_time``."""

    attempt: int
    start_time: float
    start_step: int
    end_time: float
    end_step: int

    def time_at(self, step: int) -> float:
        """Linear interpolation of when this stretch reached ``step``."""
        if self.end_step == self.start_step:
            return self.start_time
        fraction = (step - self.start_step) / (self.end_step - self.start_step)
        return self.start_time + fraction * (self.end_time - self.start_time)


def stretches(samples: Sequence[Sample], resume_steps: dict[int, int] | None = None) -> list[Stretch]:
    """Split samples into stretches of forward progress.

    ``resume_steps`` maps an attempt to the step it resumed from (when known): the stretch then
    starts there, extrapolated back at the stretch's own rate, so the first steps of an attempt
    count even though the first sample came a moment after them.
    """
    resume_steps = resume_steps or {}
    result: list[Stretch] = []
    current: list[Sample] = []

    def close() -> None:
        if len(current) < 2 and not (current and current[0].attempt in resume_steps):
            current.clear()
            return
        first, last = current[0], current[-1]
        start_time, start_step = first.time, first.step
        resumed = resume_steps.get(first.attempt)
        is_attempt_start = not result or result[-1].attempt != first.attempt
        if is_attempt_start and resumed is not None and resumed < first.step and last.step > first.step:
            rate = (last.time - first.time) / (last.step - first.step)
            start_time, start_step = first.time - rate * (first.step - resumed), resumed
        if last.step > start_step:
            result.append(Stretch(first.attempt, start_time, start_step, last.time, last.step))
        current.clear()

    for sample in samples:
        if current and (sample.attempt != current[-1].attempt or sample.step < current[-1].step):
            close()
        current.append(sample)
    close()
    return result


def kept_time(runs: Sequence[Stretch], final_step: int) -> float:
    """Wall time spent on the steps the final model kept (see the module docstring)."""
    need = final_step
    total = 0.0
    index = len(runs) - 1
    while need > 0 and index >= 0:
        stretch = runs[index]
        if stretch.start_step < need <= stretch.end_step:
            total += stretch.time_at(need) - stretch.start_time
            need = stretch.start_step
        index -= 1
    return total


@dataclass(frozen=True)
class Incident:
    """A gang restart: when the fault happened, when it was acted on, when training progressed again."""

    attempt: int
    reason: str
    fault_time: float
    detected_time: float
    backoff_seconds: float
    first_new_step_time: float | None

    @property
    def time_to_recover(self) -> float | None:
        """Fault to the first new step of the next attempt (None if training never progressed again)."""
        return None if self.first_new_step_time is None else self.first_new_step_time - self.fault_time

    @property
    def time_to_recover_excluding_backoff(self) -> float | None:
        """The same, less the configured backoff wait."""
        ttr = self.time_to_recover
        return None if ttr is None else ttr - self.backoff_seconds


def goodput(kept_seconds: float, wall_seconds: float, excluded_seconds: float = 0.0) -> float:
    """Kept time over wall time (optionally with some wall time, such as backoff, excluded)."""
    denominator = wall_seconds - excluded_seconds
    return 0.0 if denominator <= 0 else min(1.0, kept_seconds / denominator)

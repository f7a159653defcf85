"""From a run's recorded timeline to its summary: goodput, time lost to each incident, the figures.

Pure functions over plain records, so the same arithmetic serves ``trainguard run``, the operator
(``trainguard_operator.goodput``) and tests; ``RunRecord`` is what ``trainguard run`` keeps of what it
saw (gang views and its own clock in, samples, incidents and timeline notes out), with no I/O.

One source: every figure of the summary comes from the last gang view the record took in (the final
step, the counters, the samples) and every restart's ``last_step`` from the view its decision was made
on (the step its reason names). A figure that was never measured is None (``null`` in the summary),
never 0.

Goodput is the share of wall time spent computing steps that the final model kept. The final
model's history is rebuilt backwards: the last attempt's progress from its resume step to the end
was kept; the steps before its resume step were kept from the latest earlier stretch of progress
that reached that step; and so on. Stretches end where an attempt ended or where the step counter
went backwards (an in-process rollback): time spent on steps that were thrown away is not goodput.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from trainer_sidecar.contract.fields import Value, summary_values
from trainguard.core.observation import GangView
from trainguard.core.policy import Decision, FailureKind


@dataclass(frozen=True)
class Sample:
    """One observation of the gang's progress: wall time, attempt, and the step the gang had completed
    (its slowest rank's)."""

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

    def reaching(self, step: int, not_after: float | None) -> Stretch:
        """This stretch carried on to ``step`` at its own rate (in no time when its rate is unknown),
        ending no later than ``not_after``; itself when it already reached ``step``."""
        if step <= self.end_step:
            return self
        span = self.end_step - self.start_step
        rate = (self.end_time - self.start_time) / span if span > 0 else 0.0
        end_time = self.end_time + rate * (step - self.end_step)
        if not_after is not None:
            end_time = min(end_time, max(not_after, self.end_time))
        return replace(self, end_time=end_time, end_step=step)

    def time_at(self, step: int) -> float:
        """Linear interpolation of when this stretch reached ``step``."""
        if self.end_step == self.start_step:
            return self.start_time
        fraction = (step - self.start_step) / (self.end_step - self.start_step)
        return self.start_time + fraction * (self.end_time - self.start_time)


def _groups(samples: Sequence[Sample]) -> list[list[Sample]]:
    """Samples split where the attempt changes or the step goes backwards (a rollback)."""
    groups: list[list[Sample]] = []
    for sample in samples:
        last = groups[-1][-1] if groups else None
        if last is None or sample.attempt != last.attempt or sample.step < last.step:
            groups.append([])
        groups[-1].append(sample)
    return groups


def _stretch(group: Sequence[Sample], resumed: int | None, not_before: float | None) -> Stretch:
    """One group's stretch; the first group of an attempt that resumed from ``resumed`` starts there."""
    first, last = group[0], group[-1]
    start_time, start_step = first.time, first.step
    if resumed is not None and resumed < first.step:
        if last.step > first.step:
            rate = (last.time - first.time) / (last.step - first.step)
            start_time = first.time - rate * (first.step - resumed)
            if not_before is not None:
                start_time = max(start_time, min(not_before, first.time))
        start_step = resumed  # seen at one step only: no rate, no time, but the chain stays connected
    return Stretch(first.attempt, start_time, start_step, last.time, last.step)


def _later_resume(attempt: int, resume_steps: Mapping[int, int]) -> tuple[int, int] | None:
    later = [a for a in resume_steps if a > attempt]
    return (min(later), resume_steps[min(later)]) if later else None


def stretches(
    samples: Sequence[Sample],
    resume_steps: Mapping[int, int] | None = None,
    *,
    started: Mapping[int, float] | None = None,
) -> list[Stretch]:
    """Split samples into stretches of forward progress.

    ``resume_steps`` maps an attempt to the step it resumed from (when known), ``started`` an attempt to
    when it started. The first stretch of a resumed attempt starts at its resume step, extrapolated back
    at the stretch's own rate (never before the attempt started), so the first steps of an attempt count
    even though the first sample came a moment after them. The last stretch of an attempt is carried on
    to the resume step of the next attempt when that is beyond its last sample, at its own rate (never
    past the next attempt's start): the next attempt resumed from a checkpoint written after the last
    look, so those steps were made and kept. A stretch whose rate is unknown (one sample) counts no time
    but keeps the chain of kept steps connected.
    """
    resume_steps = resume_steps or {}
    started = started or {}
    runs: list[Stretch] = []
    for group in _groups(samples):
        attempt = group[0].attempt
        first_of_attempt = not runs or runs[-1].attempt != attempt
        resumed = resume_steps.get(attempt) if first_of_attempt else None
        runs.append(_stretch(group, resumed, started.get(attempt)))
    for index, run in enumerate(runs):
        if index + 1 < len(runs) and runs[index + 1].attempt == run.attempt:
            continue  # not the attempt's last stretch
        later = _later_resume(run.attempt, resume_steps)
        if later is not None:
            runs[index] = run.reaching(later[1], started.get(later[0]))
    return [run for run in runs if run.end_step > run.start_step]


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
    #: The failed attempt's last step in the view the decision was made on (the step the reason names),
    #: and the step the next attempt resumed from.
    last_step: int | None = None
    resumed_step: int | None = None

    @property
    def redone_steps(self) -> int | None:
        """Steps the failed attempt was seen to reach that the next attempt had to compute again (None:
        not known yet). Zero when the next attempt resumed beyond the last step seen."""
        if self.last_step is None or self.resumed_step is None:
            return None
        return max(0, self.last_step - self.resumed_step)

    @property
    def time_to_recover(self) -> float | None:
        """Fault to the first new step of the next attempt (None if training never progressed again)."""
        return None if self.first_new_step_time is None else self.first_new_step_time - self.fault_time

    @property
    def time_to_recover_excluding_backoff(self) -> float | None:
        """The same, less the configured backoff wait."""
        ttr = self.time_to_recover
        return None if ttr is None else ttr - self.backoff_seconds


@dataclass(frozen=True)
class Pace:
    """Progress a user can plan with; None: not known.

    ``steps_per_second``: the rate of the current stretch of progress (this attempt's steps since it
    started or last rolled back). ``eta_seconds``: the time to the declared ``max_steps`` at that rate
    (0 once reached). ``lost_seconds``: the wall time not spent on steps the final model kept (recoveries:
    detection, backoff, restart and redone steps; rollbacks; the start), the complement of goodput's
    kept time.
    """

    steps_per_second: float | None
    eta_seconds: float | None
    lost_seconds: float | None


def pace(
    current: Stretch | None,
    max_steps: int | None,
    *,
    kept_seconds: float | None,
    wall_seconds: float,
) -> Pace:
    """The pace of a job whose current stretch of progress is ``current`` (None: not stepping in this
    attempt yet), with ``kept_seconds`` of ``wall_seconds`` spent on kept steps. Both runners report
    these numbers from here; the operator's and ``trainguard run``'s kept time come from ``kept_time``."""
    rate = None
    if (
        current is not None
        and current.end_step > current.start_step
        and current.end_time > current.start_time
    ):
        rate = (current.end_step - current.start_step) / (current.end_time - current.start_time)
    eta = None
    if rate is not None and max_steps is not None and current is not None:
        eta = max(0, max_steps - current.end_step) / rate
    lost = None if kept_seconds is None else max(0.0, wall_seconds - kept_seconds)
    return Pace(rate, eta, lost)


def current_stretch(samples: Sequence[Sample], attempt: int) -> Stretch | None:
    """The newest stretch of progress of ``attempt`` as sampled (not extrapolated), or None."""
    groups = _groups(samples)
    if not groups or groups[-1][0].attempt != attempt:
        return None
    return _stretch(groups[-1], None, None)


def goodput(kept_seconds: float, wall_seconds: float, excluded_seconds: float = 0.0) -> float:
    """Kept time over wall time (optionally with some wall time, such as backoff, excluded)."""
    denominator = wall_seconds - excluded_seconds
    return 0.0 if denominator <= 0 else min(1.0, kept_seconds / denominator)


def fault_time(decision: Decision, view: GangView, *, attempt_started: float, now: float) -> float:
    """When the fault behind ``decision`` happened: a hang began when the hung rank last made progress
    (by its own clock, kept within this attempt and the present: a worker's clock is not trusted);
    anything else when it was seen (``now``)."""
    if decision.failure is not FailureKind.HANG or decision.rank is None:
        return now
    state = view.rank(decision.rank)
    last = state.last_step_time if state is not None else None
    if last is None or not math.isfinite(last):
        return now
    return min(max(last, attempt_started), now)


@dataclass(frozen=True)
class Note:
    """A line for the run's timeline that ``RunRecord`` found in what it saw."""

    kind: str
    message: str
    step: int | None = None


class RunRecord:
    """What ``trainguard run`` keeps of a job's progress: fed with gang views and its own clock
    (``see``), it keeps the samples of the gang's step, each attempt's start and resume step, the
    incidents (``failed`` adds one per gang restart, from the view the decision was made on; their
    recovery and resume are filled in here), the loss series, and it says what changed (skips,
    rollbacks, checkpoints, recoveries)."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.samples: list[Sample] = []
        self.resume_steps: dict[int, int] = {}
        self.attempt_starts: dict[int, float] = {}
        self.incidents: list[Incident] = []
        self.series: list[dict[str, Any]] = []
        self.view: GangView | None = None
        self._attempt = 0
        self._counts: dict[str, int] = {}

    def see(self, attempt: int, attempt_started: float, view: GangView, now: float) -> list[Note]:
        """Take in the gang of ``attempt`` (started at ``attempt_started``) as seen at ``now``."""
        if attempt != self._attempt:
            self._attempt = attempt
            self.attempt_starts[attempt] = attempt_started
            self._counts.clear()  # counters restored from a checkpoint are not new events
        if view.progress is None:
            return []
        self.view = view
        if view.resumed_step is not None and attempt not in self.resume_steps:
            self._resumed(attempt, view.resumed_step)
        notes: list[Note] = []
        if view.stepped:
            notes += self._stepped(attempt, view, now)
        if view.resumed_step is None:
            return notes  # still starting: the counters its checkpoint holds are not restored yet
        return notes + self._counted(view)

    def failed(
        self, decision: Decision, view: GangView, *, attempt: int, attempt_started: float, now: float
    ) -> Incident:
        """Add the incident of ``decision`` (a restart of ``attempt``), made at ``now`` on ``view``: its
        fault time, and its last step, which is the step the decision's reason names (the decision's
        own when it carries one, else the view's last step: both from the same look)."""
        incident = Incident(
            attempt,
            decision.reason,
            fault_time(decision, view, attempt_started=attempt_started, now=now),
            now,
            decision.delay_seconds,
            None,
            last_step=decision.step if decision.step is not None else view.last_step,
        )
        self.incidents.append(incident)
        return incident

    def _resumed(self, attempt: int, step: int) -> None:
        self.resume_steps[attempt] = step
        if self.incidents and self.incidents[-1].attempt < attempt:
            self.incidents[-1] = replace(self.incidents[-1], resumed_step=step)

    def _stepped(self, attempt: int, view: GangView, now: float) -> list[Note]:
        assert view.progress is not None
        step = view.progress.step
        last = self.samples[-1] if self.samples else None
        if last is None or (last.attempt, last.step) != (attempt, step):
            # A sample when the step changes, at the time it was first seen: a gang that stands still
            # (a hang) adds no time to the stretch it ended.
            self.samples.append(Sample(now, attempt, step))
            lead = view.lead
            self.series.append(
                {
                    "t": round(now - self.started, 3),
                    "attempt": attempt,
                    "step": step,
                    "loss": lead.loss if lead else None,
                    "grad_norm": lead.grad_norm if lead else None,
                }
            )
        incident = self.incidents[-1] if self.incidents else None
        if incident is None or incident.first_new_step_time is not None or incident.attempt >= attempt:
            return []
        self.incidents[-1] = replace(incident, first_new_step_time=now)
        resumed = self.resume_steps.get(attempt)
        since = f", resumed from step {resumed}" if resumed is not None else ""
        return [Note("recovered", f"training progressed again at step {step}{since}", step)]

    def _counted(self, view: GangView) -> list[Note]:
        assert view.progress is not None
        step = view.progress.step
        counts = {
            "skipped_steps": view.skipped_steps,
            "rollbacks": view.rollbacks,
            "checkpoint": view.checkpoint.step if view.checkpoint is not None else -1,
        }
        notes: list[Note] = []
        for key, value in counts.items():
            if value is None:
                continue
            previous = self._counts.get(key)
            self._counts[key] = value
            if previous is not None and value > previous:
                notes.append(_count_note(key, value, previous, step))
        return notes

    @property
    def final_step(self) -> int | None:
        """The gang's step when last seen (None before any report)."""
        return self.view.progress.step if self.view is not None and self.view.progress is not None else None

    def kept_seconds(self, final_step: int) -> float:
        """Wall time spent on the steps ``final_step`` builds on (see the module docstring)."""
        runs = stretches(self.samples, self.resume_steps, started=self.attempt_starts)
        return kept_time(runs, final_step)

    def pace(self, now: float) -> Pace:
        """The job's pace at ``now`` (see ``Pace``), from the samples and the last view taken in."""
        final_step = self.final_step
        kept = self.kept_seconds(final_step) if final_step is not None else None
        return pace(
            current_stretch(self.samples, self._attempt),
            self.view.max_steps if self.view is not None else None,
            kept_seconds=kept,
            wall_seconds=now - self.started,
        )

    def figures(self, wall_seconds: float, backoff_seconds: float) -> RunFigures:
        """The summary's figures for a run of ``wall_seconds`` that waited ``backoff_seconds`` in
        backoffs: the final step, the counters and the samples from the last view taken in (one look),
        the restarts, and goodput from the kept time. Whatever that view does not know is None; the
        kept time and goodput are None when the final step is."""
        view = self.view
        final_step = self.final_step
        kept = self.kept_seconds(final_step) if final_step is not None else None
        return RunFigures(
            final_step=final_step,
            restarts=[_restart(incident) for incident in self.incidents],
            reported=summary_values(view.reported if view is not None else None),
            wall_seconds=round(wall_seconds, 3),
            backoff_seconds=backoff_seconds,
            kept_seconds=_round(kept),
            goodput=None if kept is None else round(goodput(kept, wall_seconds), 4),
            goodput_excluding_backoff=None
            if kept is None
            else round(goodput(kept, wall_seconds, backoff_seconds), 4),
        )


@dataclass(frozen=True)
class RunFigures:
    """A run's figures, as the summary reports them (the README's summary reference names each); None:
    not known (never reported, or not measured)."""

    final_step: int | None
    restarts: list[dict[str, Any]]
    #: The reported fields' figures by summary key (``trainer_sidecar.contract.fields.summary_values``):
    #: rollbacks, skipped_steps, samples_seen, samples_dropped, drop_rate.
    reported: Mapping[str, Value]
    wall_seconds: float
    backoff_seconds: float
    kept_seconds: float | None
    goodput: float | None
    goodput_excluding_backoff: float | None

    def __getattr__(self, name: str) -> Value:
        """A reported field's figure by its summary key, as an attribute (``figures.rollbacks``)."""
        reported = self.__dict__.get("reported", {})
        if name in reported:
            return reported[name]  # type: ignore[no-any-return]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def as_dict(self) -> dict[str, Any]:
        """The figures as the summary's JSON keys, in the summary's order (the reported fields' in
        place of ``reported``)."""
        figures: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            figures.update(self.reported if name == "reported" else {name: getattr(self, name)})
        return figures


def _count_note(key: str, value: int, previous: int, step: int) -> Note:
    if key == "skipped_steps":
        return Note("skip", f"{value - previous} step(s) skipped (non-finite or spike)", step)
    if key == "rollbacks":
        return Note("rollback", f"rolled back to the last clean snapshot (rollback #{value})", step)
    return Note("checkpoint", f"clean checkpoint at step {value}", value)


def _restart(incident: Incident) -> dict[str, Any]:
    return {
        "attempt": incident.attempt,
        "reason": incident.reason,
        "backoff_seconds": incident.backoff_seconds,
        "detect_seconds": round(incident.detected_time - incident.fault_time, 3),
        "time_to_recover_seconds": _round(incident.time_to_recover),
        "time_to_recover_excluding_backoff_seconds": _round(incident.time_to_recover_excluding_backoff),
        "last_step": incident.last_step,
        "resumed_step": incident.resumed_step,
        "redone_steps": incident.redone_steps,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def duration_text(seconds: float | None) -> str:
    """A duration for a person: ``42s``, ``7m05s``, ``3h02m``; "-" when not known."""
    if seconds is None:
        return "-"
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"

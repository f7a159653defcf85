"""A job's goodput from the bounded step history the operator keeps in its status. Pure: no I/O, no clock.

Goodput is the share of wall time, since the job's first attempt was created (``status.jobStartedAt``),
spent computing steps that the final model kept: the definition of ``trainguard run``, computed with
the same arithmetic (``trainguard.core.summary``: ``stretches``, ``kept_time``, ``goodput``). Work that a
later attempt redid because it resumed from an older checkpoint, steps undone by an in-process
rollback, backoffs, pod start-up and checkpoint loading all count as wall time but not as kept time.

What the status keeps, per stretch of forward progress the operator saw (``status.stepHistory``): the
attempt, when the attempt was created, the checkpoint step it resumed from (as its workers report it),
the first and the last step seen and when they were first seen (the operator's clock, one look every
``probePeriodSeconds``). A new record starts with each attempt, and within an attempt when the step went
backwards (a rollback). Each record becomes the samples of its first and last step for
``trainguard.core.summary.stretches``, which ``trainguard run`` uses too: when the next attempt resumed from a
step beyond the last one seen, the record is carried on to that step at its own rate (bounded by the
next attempt's creation), so progress made after the last look is not lost; the first stretch of an
attempt is extrapolated back to its resume step (bounded by the attempt's creation, so no time is
counted twice). A record seen at one step only (its rate unknown) counts no time but keeps the chain of
kept steps connected.

Bounded: at most ``MAX_RECORDS`` (20) records. When a 21st arrives, the oldest is folded into
``status.stepHistoryFolded`` (``fromStep``, ``toStep``, ``keptSeconds``: the kept history up to that
record's end took that much time), which takes part in later computations as one stretch. A later
attempt that resumes inside the folded history is credited pro rata, linearly in steps: the one
approximation, reached only after 20 attempts or rollbacks seen.

Known limits: a rollback undone between two looks is not seen (its discarded steps count as kept); the
work after the last checkpoint of a failed attempt counts as kept until the next attempt reports its
resume step; a job whose first attempt predates this field takes the object's creation as its start.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from trainguard_operator.status import FoldedHistory, StepRecord, iso_precise, parse_time

from trainguard.core.summary import Pace, Sample, Stretch, goodput, kept_time, pace, stretches

#: Records kept in ``status.stepHistory``; older ones are folded into ``status.stepHistoryFolded``.
MAX_RECORDS = 20


def _seconds(text: str | None) -> float | None:
    moment = parse_time(text)
    return None if moment is None else moment.timestamp()


def record_progress(
    history: Sequence[StepRecord],
    folded: FoldedHistory | None,
    *,
    attempt: int,
    started_at: str | None,
    resumed_step: int | None,
    step: int,
    now: datetime,
) -> tuple[list[StepRecord], FoldedHistory | None]:
    """The history after seeing ``attempt`` stepping at ``step`` at ``now`` (unchanged if nothing is new)."""
    at = iso_precise(now)
    records = list(history)
    last = records[-1] if records else None
    if last is not None and last.attempt == attempt:
        if step == last.last_step:
            return records, folded
        if step > last.last_step:
            records[-1] = last.model_copy(update={"last_step": step, "last_step_at": at})
            return records, folded
        # The step went backwards within the attempt: a rollback. The new stretch has no resume step.
        resumed_step = None
    records.append(
        StepRecord(
            attempt=attempt,
            started_at=started_at,
            resumed_step=resumed_step,
            first_step=step,
            first_step_at=at,
            last_step=step,
            last_step_at=at,
        )
    )
    while len(records) > MAX_RECORDS:
        folded = _fold(folded, records[0], records[1])
        records = records[1:]
    return records, folded


def _record_runs(record: StepRecord, following: StepRecord | None) -> list[Stretch]:
    """The stretches of one record (see the module docstring), by ``trainguard.core.summary.stretches``:
    extrapolated back to the attempt's resume step (not before the attempt's creation), and on to the
    next attempt's resume step (not past that attempt's creation)."""
    first_t = _seconds(record.first_step_at) or 0.0
    last_t = _seconds(record.last_step_at) or first_t
    samples = [Sample(first_t, record.attempt, record.first_step)]
    if record.last_step > record.first_step:
        samples.append(Sample(last_t, record.attempt, record.last_step))
    resume_steps: dict[int, int] = {}
    started: dict[int, float] = {}
    if record.resumed_step is not None:
        resume_steps[record.attempt] = record.resumed_step
    created = _seconds(record.started_at)
    if created is not None:
        started[record.attempt] = created
    if following is not None and following.attempt > record.attempt and following.resumed_step is not None:
        resume_steps[following.attempt] = following.resumed_step
        bound = _seconds(following.started_at) or _seconds(following.first_step_at)
        if bound is not None:
            started[following.attempt] = bound
    return stretches(samples, resume_steps, started=started)


def _folded_run(folded: FoldedHistory | None) -> list[Stretch]:
    if folded is None or folded.to_step <= folded.from_step:
        return []
    return [Stretch(0, 0.0, folded.from_step, folded.kept_seconds, folded.to_step)]


def _fold(folded: FoldedHistory | None, oldest: StepRecord, following: StepRecord) -> FoldedHistory | None:
    own = _record_runs(oldest, following)
    if not own:
        return folded
    runs = _folded_run(folded) + own
    top = own[-1].end_step
    kept = max(0.0, kept_time(runs, top))
    return FoldedHistory(from_step=min(r.start_step for r in runs), to_step=top, kept_seconds=kept)


def kept_seconds(history: Sequence[StepRecord], folded: FoldedHistory | None) -> float:
    """Wall time spent on the steps the newest record's last step builds on."""
    runs = _folded_run(folded)
    for index, record in enumerate(history):
        following = history[index + 1] if index + 1 < len(history) else None
        runs += _record_runs(record, following)
    if history:
        final = history[-1].last_step
    elif folded is not None:
        final = folded.to_step
    else:
        return 0.0
    return max(0.0, kept_time(runs, final))


def job_goodput(
    history: Sequence[StepRecord], folded: FoldedHistory | None, started_at: str | None, now: datetime
) -> float | None:
    """Goodput (0..1, four decimals) at ``now``; None before the job's first attempt was created."""
    start = _seconds(started_at)
    if start is None:
        return None
    wall = now.timestamp() - start
    return round(goodput(kept_seconds(history, folded), wall), 4)


def job_pace(
    history: Sequence[StepRecord],
    folded: FoldedHistory | None,
    started_at: str | None,
    attempt: int | None,
    max_steps: int | None,
    now: datetime,
) -> Pace | None:
    """The job's pace at ``now`` (``trainguard.core.summary.pace``): the rate of the current attempt's
    newest step record, the ETA to ``max_steps`` and the time lost; None before the job's first attempt
    was created."""
    start = _seconds(started_at)
    if start is None:
        return None
    newest = history[-1] if history else None
    current = None
    if newest is not None and newest.attempt == attempt:
        first = _seconds(newest.first_step_at)
        last = _seconds(newest.last_step_at)
        if first is not None and last is not None:
            current = Stretch(newest.attempt, first, newest.first_step, last, newest.last_step)
    return pace(
        current,
        max_steps,
        kept_seconds=kept_seconds(history, folded),
        wall_seconds=now.timestamp() - start,
    )

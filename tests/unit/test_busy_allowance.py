"""Nested busy sections: the pure allowance rule (``contract.allowance``), the sidecar's judgement of
nested sections on its own clock, and the status fields older sidecars read.

The regression: ``busy("save", seconds=4)`` entered 5 s into ``busy("eval")`` was measured from the
eval's start, so the sidecar answered 503 at once."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.health import GRACE, WALL0, Sidecar
from trainer_sidecar.contract.allowance import OpenSection, busy_allowance, section_allowance
from trainer_sidecar.contract.status import BusySection, Phase, WorkerStatus, parse_status
from trainer_sidecar.guardian.busy import legacy_seconds

# Times are whole or quarter seconds, so that the reference's comparisons are exact.
starts = st.integers(min_value=0, max_value=4000).map(lambda q: q / 4)
limits = st.one_of(st.none(), st.integers(min_value=1, max_value=4000).map(lambda q: q / 4))
caps = st.one_of(st.none(), st.integers(min_value=0, max_value=4000).map(lambda q: q / 4))
sections_lists = st.lists(st.builds(OpenSection, starts, limits, st.sampled_from(["eval", "save", ""])))


def own_deadline(section: OpenSection, cap: float | None) -> float | None:
    """Reference: a section's deadline on its own, from its own start."""
    allowed = section_allowance(section, cap)
    return None if allowed is None else section.start + allowed


# --- the pure rule ----------------------------------------------------------------------------------------


@settings(max_examples=1000)
@given(sections=sections_lists, cap=caps, now=starts)
def test_the_open_sections_end_with_the_earliest_of_their_own_deadlines(
    sections: list[OpenSection], cap: float | None, now: float
) -> None:
    allowance = busy_allowance(sections, now, cap)
    deadlines = [d for d in (own_deadline(s, cap) for s in sections) if d is not None]
    if not deadlines:
        assert allowance is None
        return
    assert allowance is not None
    deadline = allowance.section.start + allowance.allowed
    assert deadline == min(deadlines)  # every section's own bound holds, and no stricter one is invented
    assert allowance.section is sections[allowance.index]
    assert allowance.elapsed == now - allowance.section.start
    assert allowance.within == (now < min(deadlines))
    if cap is not None:  # the whole stretch never outlasts the cap from its first start
        assert deadline <= min(s.start for s in sections) + cap


@settings(max_examples=500)
@given(sections=sections_lists, cap=caps, now=starts, data=st.data())
def test_the_deadline_does_not_depend_on_the_order_or_depth_of_the_sections(
    sections: list[OpenSection], cap: float | None, now: float, data: st.DataObject
) -> None:
    shuffled = data.draw(st.permutations(sections))
    one, other = busy_allowance(sections, now, cap), busy_allowance(shuffled, now, cap)
    assert (one is None) == (other is None)
    if one is not None and other is not None:
        assert one.remaining == other.remaining
        assert one.within == other.within


@settings(max_examples=500)
@given(sections=sections_lists, extra=st.builds(OpenSection, starts, limits), cap=caps, now=starts)
def test_opening_another_section_never_extends_the_allowance(
    sections: list[OpenSection], extra: OpenSection, cap: float | None, now: float
) -> None:
    before, after = busy_allowance(sections, now, cap), busy_allowance([*sections, extra], now, cap)
    if before is not None:
        assert after is not None
        assert after.remaining <= before.remaining


@settings(max_examples=500)
@given(
    outer=st.lists(st.builds(OpenSection, starts, limits), max_size=5),
    entered_after=st.integers(min_value=0, max_value=400).map(lambda q: q / 4),
    asked=st.integers(min_value=1, max_value=400).map(lambda q: q / 4),
    into=st.integers(min_value=0, max_value=1600).map(lambda q: q / 4),
)
def test_a_bounded_section_gets_its_whole_bound_from_its_own_start_unless_an_outer_one_ends_first(
    outer: list[OpenSection], entered_after: float, asked: float, into: float
) -> None:
    start = max((s.start for s in outer), default=0.0) + entered_after
    inner = OpenSection(start, asked, "save")
    now = start + into
    allowance = busy_allowance([*outer, inner], now, GRACE)
    assert allowance is not None
    outer_deadline = min((d for s in outer if (d := own_deadline(s, GRACE)) is not None), default=math.inf)
    if start + min(asked, GRACE) <= outer_deadline:
        assert allowance.within == (into < min(asked, GRACE))  # measured from its own start
    else:
        assert allowance.within == (now < outer_deadline)  # the outer bound still ends everything


def test_an_outer_bounded_section_bounds_an_unbounded_one_inside_it() -> None:
    save, evaluation = OpenSection(0.0, 10.0, "save"), OpenSection(5.0, None, "eval")
    allowance = busy_allowance([save, evaluation], 9.0, GRACE)
    assert allowance is not None
    assert (allowance.section, allowance.remaining) == (save, 1.0)
    late = busy_allowance([save, evaluation], 10.0, GRACE)
    assert late is not None
    assert not late.within


def test_nonsense_limits_count_as_nothing_allowed() -> None:
    for limit in (0.0, -1.0, math.nan, math.inf):
        allowance = busy_allowance([OpenSection(0.0, limit)], 0.0, GRACE)
        assert allowance is not None
        assert not allowance.within
    assert busy_allowance([], 0.0, GRACE) is None


# --- the sidecar's judgement --------------------------------------------------------------------------


@dataclass
class Worker:
    """A worker's busy sections as the guardian publishes them, on a wall clock shared with the sidecar."""

    sections: list[BusySection] = field(default_factory=list)
    since: float | None = None  # when the busy stretch began

    def status(self, legacy: bool = False, **fields: Any) -> WorkerStatus:
        opened = tuple(self.sections)
        values: dict[str, Any] = {
            "pid": 7,
            "phase": Phase.BUSY if opened else Phase.RUNNING,
            "started_at": WALL0,
            "step": 10,
            "steps_total": 10,
            "last_step_time": WALL0,
        }
        if opened:
            since = min(s.since for s in opened) if self.since is None else self.since
            values.update(
                busy_since=since,
                busy_reason=opened[-1].reason,
                busy_seconds=legacy_seconds(opened, since),
                busy_sections=[] if legacy else list(opened),
            )
        values.update(fields)
        return WorkerStatus(**values)


def stepping_sidecar() -> tuple[Sidecar, Worker]:
    sidecar, worker = Sidecar(), Worker()
    assert sidecar.read(worker.status(last_step_time=sidecar.wall)).ready
    return sidecar, worker


def test_a_bounded_section_inside_an_unbounded_one_counts_from_its_own_start() -> None:
    sidecar, worker = stepping_sidecar()
    worker.sections.append(BusySection(reason="eval", since=sidecar.wall))
    assert sidecar.read(worker.status()).alive
    sidecar.advance(5)
    worker.sections.append(BusySection(reason="save", since=sidecar.wall, seconds=4.0))
    verdict = sidecar.read(worker.status())
    assert verdict.alive, verdict.reason  # was: 503 at once, the save measured from the eval's start
    assert verdict.reason == "busy at step 10 (save) for 0 s (allowed: 4 s)"
    sidecar.advance(3.5)
    assert sidecar.read(worker.status()).alive
    sidecar.advance(1)
    verdict = sidecar.read(worker.status())
    assert not verdict.alive
    assert verdict.reason == "busy at step 10 (save) for 4 s, longer than the 4 s allowed"


def test_an_older_sidecar_judges_a_newer_worker_s_nesting_alike_from_the_legacy_fields() -> None:
    # An older sidecar reads busy_since/busy_seconds only: the guardian states the nested deadline there.
    sidecar, worker = stepping_sidecar()
    worker.sections.append(BusySection(reason="eval", since=sidecar.wall))
    sidecar.read(worker.status(legacy=True))
    sidecar.advance(5)
    worker.sections.append(BusySection(reason="save", since=sidecar.wall, seconds=4.0))
    status = worker.status(legacy=True)
    assert (status.busy_since, status.busy_seconds) == (WALL0, 9.0)
    assert sidecar.read(status).alive
    sidecar.advance(3.5)
    assert sidecar.read(worker.status(legacy=True)).alive
    sidecar.advance(1)
    assert not sidecar.read(worker.status(legacy=True)).alive


def test_an_old_worker_s_status_without_sections_is_still_read_and_judged() -> None:
    document = (
        '{"schema_version": 1, "pid": 7, "phase": "busy", "started_at": 1700000000.0, "step": 3, '
        '"busy_since": 1700000000.0, "busy_reason": "eval", "busy_seconds": 50.0}'
    )
    status, why = parse_status(document)
    assert status is not None, why
    assert (status.busy_sections, status.local_rank, status.local_world_size) == ([], 0, 1)
    sidecar = Sidecar()
    assert sidecar.read(status).alive
    sidecar.advance(49)
    assert sidecar.read(status).alive
    sidecar.advance(2)
    verdict = sidecar.read(status)
    assert not verdict.alive
    assert "longer than the 50 s allowed" in verdict.reason


def test_a_worker_that_restarts_its_sections_clocks_is_still_bounded_by_the_grace() -> None:
    # Every write claims the sections began just now: the sidecar measures the whole stretch itself.
    sidecar, _ = stepping_sidecar()
    for _ in range(int(GRACE // 10)):
        now = [BusySection(reason="eval", since=sidecar.wall), BusySection(reason="save", since=sidecar.wall)]
        assert sidecar.read(Worker(now).status()).alive
        sidecar.advance(10)
    sidecar.advance(1)
    now = [BusySection(reason="eval", since=sidecar.wall)]
    verdict = sidecar.read(Worker(now).status())
    assert not verdict.alive
    assert f"longer than the {GRACE:g} s allowed" in verdict.reason


def test_a_section_claimed_to_have_begun_earlier_is_judged_from_the_earlier_time() -> None:
    sidecar, _ = stepping_sidecar()
    sidecar.advance(100)
    early = [BusySection(reason="save", since=sidecar.wall - 10, seconds=4.0)]
    assert not sidecar.read(Worker(early).status()).alive  # a worker's timestamp only makes it stricter


def test_a_section_in_the_future_is_an_implausible_timestamp() -> None:
    sidecar, _ = stepping_sidecar()
    future = [
        BusySection(reason="eval", since=sidecar.wall),
        BusySection(reason="x", since=sidecar.wall + 3600),
    ]
    verdict = sidecar.read(Worker(future).status(busy_since=sidecar.wall))
    assert not verdict.ready
    assert "busy_sections[1].since is 3600 s ahead" in verdict.reason


Event = tuple[str, Any]
events = st.lists(
    st.one_of(
        st.tuples(st.just("enter"), limits),
        st.tuples(st.just("leave"), st.integers(min_value=0, max_value=10)),
        st.tuples(st.just("advance"), st.integers(min_value=1, max_value=200).map(lambda q: q / 4)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(events=events, legacy=st.booleans())
def test_any_nesting_of_sections_is_judged_as_each_measured_from_its_own_start(
    events: list[Event], legacy: bool
) -> None:
    """A model of the rule: while busy, alive exactly when every open section is inside its own bound
    (from its own start, at most the grace) and the whole stretch inside the grace. Sections open and
    close in any order; the sidecar reads after every event. ``legacy``: the worker states only the
    fields older sidecars read (one bound from the stretch's start), which must give the same verdicts."""
    sidecar, worker = stepping_sidecar()
    stretch_start: float | None = None
    names, steps = itertools.count(), itertools.count(11)
    for kind, value in events:
        if kind == "enter":
            if not worker.sections:
                stretch_start = worker.since = sidecar.wall
            worker.sections.append(BusySection(reason=f"s{next(names)}", since=sidecar.wall, seconds=value))
        elif kind == "leave" and worker.sections:
            del worker.sections[value % len(worker.sections)]
            if not worker.sections:  # the end of the stretch is progress (the guardian says so)
                stretch_start = worker.since = None
                sidecar.read(worker.status(last_step_time=sidecar.wall, step=next(steps)))
                continue
        elif kind == "advance":
            sidecar.advance(value)
        if not worker.sections:
            continue
        assert stretch_start is not None
        verdict = sidecar.read(worker.status(legacy=legacy))
        now = sidecar.wall
        expected = now - stretch_start < GRACE and all(
            now - s.since < min(s.seconds if s.seconds is not None else GRACE, GRACE) for s in worker.sections
        )
        assert verdict.alive == expected, (verdict.reason, worker.sections, now - WALL0)
        assert not verdict.ready

"""The stop grace of a gang that lost a rank (``trainer_sidecar.contract.stopping``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer_sidecar.contract.stopping import (
    BROKEN_GANG_GRACE_SECONDS,
    WriteInFlight,
    broken_gang_grace_seconds,
)

NOW = 10_000.0
WRITES = st.lists(
    st.builds(
        WriteInFlight,
        since=st.floats(NOW - 600, NOW + 60),  # a skewed worker clock may be ahead
        last_write_seconds=st.one_of(st.none(), st.floats(0.0, 600.0)),
    ),
    max_size=4,
)


def test_no_write_in_flight_gets_a_moment_and_one_that_needs_more_gets_its_time() -> None:
    assert broken_gang_grace_seconds([], NOW, ceiling=60.0) == BROKEN_GANG_GRACE_SECONDS
    # Started 1 s ago; the last write took 4 s: expected done in 2 x 4 - 1 = 7 s, plus the moment.
    assert broken_gang_grace_seconds([WriteInFlight(NOW - 1, 4.0)], NOW, ceiling=60.0) == pytest.approx(8.0)
    # Long overdue: only the moment (the write is stuck, or finished after the status said it ran).
    assert broken_gang_grace_seconds([WriteInFlight(NOW - 100, 4.0)], NOW, ceiling=60.0) == 1.0
    # Nothing known of how long a write takes (the first one): the ceiling.
    assert broken_gang_grace_seconds([WriteInFlight(NOW - 1, None)], NOW, ceiling=60.0) == 60.0
    assert broken_gang_grace_seconds([WriteInFlight(NOW - 1, 500.0)], NOW, ceiling=60.0) == 60.0


@given(WRITES, st.floats(0.0, 3600.0))
def test_the_grace_stays_within_its_bounds_and_waits_for_every_write_it_can(
    writes: list[WriteInFlight], ceiling: float
) -> None:
    grace = broken_gang_grace_seconds(writes, NOW, ceiling)
    floor = BROKEN_GANG_GRACE_SECONDS
    assert floor <= grace <= max(floor, ceiling)
    if not writes:
        assert grace == floor
    for write in writes:
        if write.last_write_seconds is None:
            assert grace == max(floor, ceiling)
        else:  # each write's expected end is covered, unless the ceiling cuts it
            expected_end = write.since + 2 * write.last_write_seconds + floor
            assert NOW + grace >= min(expected_end, NOW + max(floor, ceiling)) - 1e-6


@given(WRITES, WRITES, st.floats(0.0, 3600.0))
def test_another_write_in_flight_never_shortens_the_grace(
    writes: list[WriteInFlight], more: list[WriteInFlight], ceiling: float
) -> None:
    assert broken_gang_grace_seconds(writes + more, NOW, ceiling) >= broken_gang_grace_seconds(
        writes, NOW, ceiling
    )

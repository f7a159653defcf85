"""The loop's own torch.distributed collectives mark their waits (``trainer_sidecar.guardian.collectives``).

Real gloo: two process groups of one store in this process, rank 0 on the test's thread (the guardian's
training thread) and rank 1 on a thread of its own, so a collective blocks for real until the peer joins.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from trainer_sidecar import Guardian
from trainer_sidecar.contract.status import Activity, read_status
from trainer_sidecar.guardian import collectives
from trainer_sidecar.guardian.activity import ActivityTracker
from trainer_sidecar.guardian.collectives import unwatch, watch, watching

ORIGINAL_WAIT = dist.Work.wait
PEER_TIMEOUT = 30.0
#: A gloo group made by hand (a ``ProcessGroupGloo``, which the collectives take as a group).
Group = Any


@pytest.fixture(autouse=True)
def no_other_watch() -> None:
    """Guardians other tests of this process left open (never finished nor closed) stop being watched, so
    that these tests see their own watches alone."""
    for token, _, _ in list(collectives._WATCHES.entries):
        collectives.unwatch(token)
    assert dist.Work.wait is ORIGINAL_WAIT


@pytest.fixture
def pair() -> Iterator[tuple[Group, Group]]:
    """Rank 0's and rank 1's gloo groups of a world of two, made together."""
    store = HashStore()
    groups: list[Group | None] = [None, None]

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))

    makers = [threading.Thread(target=make, args=(rank,)) for rank in range(2)]
    for maker in makers:
        maker.start()
    for maker in makers:
        maker.join(60)
    assert groups[0] is not None
    assert groups[1] is not None
    yield groups[0], groups[1]
    assert dist.Work.wait is ORIGINAL_WAIT, "a watch was left on"


def peer_joins_when(
    group: Group, ready: Callable[[], bool], then_sleep: float = 0.0
) -> tuple[threading.Thread, list[bool]]:
    """Rank 1 joins one all-reduce once ``ready()`` holds (or after PEER_TIMEOUT, so that a test without the
    behaviour fails rather than hangs), ``then_sleep`` seconds later; the list says whether it was ready."""
    seen: list[bool] = []

    def run() -> None:
        deadline = time.monotonic() + PEER_TIMEOUT
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.02)
        seen.append(ready())
        time.sleep(then_sleep)
        dist.all_reduce(torch.ones(2), group=group)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, seen


class Recording(ActivityTracker):
    """A tracker that records each mark with the thread that made it."""

    __slots__ = ("marks",)

    def __init__(self, activity: Activity = Activity.LOOP) -> None:
        super().__init__(activity)
        self.marks: list[tuple[Activity, int]] = []

    def mark(self, activity: Activity) -> Activity:
        self.marks.append((activity, threading.get_ident()))
        return super().mark(activity)


def test_a_loop_blocked_in_its_own_all_reduce_has_published_that_it_waits(
    tmp_path: Path, pair: tuple[Group, Group]
) -> None:
    """Issue 42: the loop all-reduces its sample count before its forward pass and the peer does not
    come. Its status file says it waits in a collective of the loop's while it is blocked there, and
    once the collective returns the loop's code goes on from where it was."""
    status_file = tmp_path / "status.json"
    model = torch.nn.Linear(4, 1)
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1), status_file=status_file)
    try:
        guardian.step(model(torch.ones(2, 4)).pow(2).mean())
        loop, loop_since = guardian.status().activity, guardian.status().activity_since

        def published_waiting() -> bool:
            status = read_status(status_file).status
            return status is not None and status.activity is Activity.LOOP_COLLECTIVE

        peer, seen = peer_joins_when(pair[1], published_waiting)
        count = torch.tensor([2.0, 2.0])
        dist.all_reduce(count, group=pair[0])  # the loop's own, synchronous
        peer.join(PEER_TIMEOUT + 10)
        assert seen == [True], "the status never said the rank waits in the loop's collective"
        assert count.tolist() == [3.0, 3.0]
        after = guardian.status()
        assert (loop, after.activity) == (Activity.LOOP, Activity.LOOP)
        assert after.activity_since == loop_since  # the loop's code goes on from its own start
    finally:
        guardian.close()
    assert not watching()


def test_only_the_guardians_thread_is_marked_and_its_own_marks_are_left_alone(
    pair: tuple[Group, Group],
) -> None:
    tracker = Recording()
    token = watch(tracker)
    try:
        me = threading.get_ident()

        def in_wait() -> bool:
            return tracker.activity is Activity.LOOP_COLLECTIVE

        peer, seen = peer_joins_when(pair[1], in_wait)
        dist.all_reduce(torch.ones(2), group=pair[0])
        peer.join(PEER_TIMEOUT + 10)
        assert seen == [True]
        # Marked on this thread only: the peer's thread waited too, unmarked.
        assert tracker.marks == [(Activity.LOOP_COLLECTIVE, me)]
        assert tracker.activity is Activity.LOOP
        for own in (Activity.COLLECTIVE, Activity.CHECKPOINT):
            tracker.mark(own)
            tracker.marks.clear()
            peer, _ = peer_joins_when(pair[1], lambda: True)
            dist.all_reduce(torch.ones(2), group=pair[0])
            peer.join(PEER_TIMEOUT + 10)
            assert tracker.marks == []
            assert tracker.activity is own
    finally:
        unwatch(token)


def test_an_async_collective_is_marked_at_its_wait_not_at_its_issue(
    pair: tuple[Group, Group],
) -> None:
    tracker = Recording()
    token = watch(tracker)
    try:
        work = dist.all_reduce(torch.ones(2), group=pair[0], async_op=True)
        assert work is not None
        assert tracker.marks == []
        assert tracker.activity is Activity.LOOP
        peer, seen = peer_joins_when(pair[1], lambda: tracker.activity is Activity.LOOP_COLLECTIVE)
        work.wait()
        peer.join(PEER_TIMEOUT + 10)
        assert seen == [True]
        assert [activity for activity, _ in tracker.marks] == [Activity.LOOP_COLLECTIVE]
    finally:
        unwatch(token)


def test_a_wait_in_the_loops_collective_is_not_counted_as_its_own_work(
    pair: tuple[Group, Group],
) -> None:
    """The straggler score reads a rank's own work per step: a wait for a peer in the loop's collective
    is not its compute, though the loop's code goes on from its old start."""
    tracker = ActivityTracker(Activity.STEP)
    token = watch(tracker)
    try:
        began = time.time()
        tracker.mark(Activity.LOOP)
        own = tracker.own
        waited = 0.5
        peer, _ = peer_joins_when(pair[1], lambda: tracker.activity is Activity.LOOP_COLLECTIVE, waited)
        dist.all_reduce(torch.ones(2), group=pair[0])
        peer.join(PEER_TIMEOUT + 10)
        tracker.mark(Activity.STEP)
        spent = time.time() - began
        assert 0 <= tracker.own - own <= spent - waited
    finally:
        unwatch(token)


def test_two_watches_wrap_once_mark_the_newest_and_the_last_one_puts_the_original_back() -> None:
    first, second = ActivityTracker(), ActivityTracker()
    one = watch(first)
    wrapped = dist.Work.wait
    assert wrapped is not ORIGINAL_WAIT
    two = watch(second)
    assert dist.Work.wait is wrapped
    unwatch(two)
    unwatch(two)  # again: nothing
    assert dist.Work.wait is wrapped
    assert watching()
    unwatch(one)
    assert dist.Work.wait is ORIGINAL_WAIT
    assert not watching()


def test_a_guardian_watches_from_its_start_to_its_end() -> None:
    model = torch.nn.Linear(4, 1)
    guardian = Guardian(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert dist.Work.wait is not ORIGINAL_WAIT
    assert watching()
    guardian.close()
    assert dist.Work.wait is ORIGINAL_WAIT
    assert not watching()

"""Marks every test with its tier (``unit``, ``integration``, ``e2e``: the folder it is in), so that
``pytest -m unit`` selects a tier as ``pytest tests/unit`` does; sets hypothesis's profile; and makes
SIGTERM stop a test session the way Ctrl-C does."""

from __future__ import annotations

import os
import signal
from types import FrameType

import pytest
from hypothesis import settings

# No per-example deadline: a test's speed is not what it checks (benchmarks measure speed), and on a
# busy 2-core machine an example that usually takes a millisecond sometimes takes a second.
settings.register_profile("trainguard", deadline=None)
settings.load_profile("trainguard")

TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Add the tier marker of the folder each test lives in."""
    for item in items:
        parts = item.path.parts
        for tier in TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
                break


def pytest_sessionstart(session: pytest.Session) -> None:
    """SIGTERM (a cancelled CI job, ``.ci/run`` stopped) interrupts the session as Ctrl-C does, so the
    fixtures' teardown runs: the test node, the control plane and every worker they started are stopped
    instead of being left running beside the next run. A process forked from pytest keeps the default."""
    session_pid = os.getpid()

    def interrupt(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != session_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)

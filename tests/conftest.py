"""Marks every test with its tier (``unit``, ``integration``, ``e2e``: the folder it is in), so that
``pytest -m unit`` selects a tier as ``pytest tests/unit`` does; and sets hypothesis's profile."""

from __future__ import annotations

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

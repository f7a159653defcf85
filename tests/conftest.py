"""Marks every test with its tier (``unit``, ``integration``, ``e2e``: the folder it is in), so that
``pytest -m unit`` selects a tier as ``pytest tests/unit`` does."""

from __future__ import annotations

import pytest

TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Add the tier marker of the folder each test lives in."""
    for item in items:
        parts = item.path.parts
        for tier in TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
                break

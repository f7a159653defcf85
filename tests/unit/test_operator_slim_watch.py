"""kopf's watch streams reach kopf without managedFields (``trainguard_operator.slim_watch``)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kopf._cogs.clients import watching
from kopf._core.reactor import queueing
from trainguard_operator import handlers, slim_watch

JOB: dict[str, Any] = {
    "apiVersion": "trainguard.dev/v1alpha1",
    "kind": "GuardedTrainingJob",
    "metadata": {
        "name": "tiny-lm",
        "uid": "u1",
        "annotations": {"trainguard.dev/last-handled-configuration": "{}"},
        "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {"f:replicas": {}}}}],
    },
    "spec": {"replicas": 2},
    "status": {"phase": "Running"},
}


def test_kopfs_watcher_gets_the_slim_stream_once_the_handlers_are_imported() -> None:
    assert handlers is not None  # imported: the install ran
    # queueing.watcher looks the generator up on the module at call time.
    assert queueing.watching is watching  # type: ignore[attr-defined]
    assert getattr(watching.infinite_watch, "_trainguard_slim", False)
    before = watching.infinite_watch
    slim_watch.install()  # a second install does not wrap twice
    assert watching.infinite_watch is before


def test_the_slim_stream_drops_managed_fields_and_keeps_everything_else() -> None:
    async def stream(**_: Any) -> AsyncIterator[Any]:
        yield watching.Bookmark.LISTED
        yield {"type": None, "object": copy.deepcopy(JOB)}
        yield {"type": "MODIFIED", "object": copy.deepcopy(JOB)}
        yield {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "7"}}}
        yield {"type": "ERROR", "object": {"code": 410}}

    async def collect() -> list[Any]:
        return [event async for event in slim_watch.slim_stream(stream)(resource="r")]

    events = asyncio.run(collect())
    expected = copy.deepcopy(JOB)
    del expected["metadata"]["managedFields"]
    assert events == [
        watching.Bookmark.LISTED,
        {"type": None, "object": expected},
        {"type": "MODIFIED", "object": expected},
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "7"}}},
        {"type": "ERROR", "object": {"code": 410}},
    ]


def test_a_kopf_without_the_generator_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(watching, "infinite_watch")
    with pytest.raises(RuntimeError, match="infinite_watch is gone"):
        slim_watch.install()

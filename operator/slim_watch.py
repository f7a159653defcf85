"""kopf's watch streams without ``metadata.managedFields``.

kopf keeps, for every object that has a daemon (every GuardedTrainingJob), the whole body of its last
watch event (``daemons_memory.live_fresh_body``), and holds each queued event until it is processed. About
three quarters of a GuardedTrainingJob's body are ``managedFields`` (the API server's server-side-apply
bookkeeping: a nested dict per field of every writer), which neither kopf nor the operator reads. The
controller-runtime operators drop them the same way (client-go cache transforms,
``TransformStripManagedFields``); kopf has no such hook, so ``install`` wraps its one watch generator
(``kopf._cogs.clients.watching.infinite_watch``, kopf 1.45) and drops the field from each event's object
before kopf sees it. ``install`` refuses loudly if kopf no longer has that function (a kopf upgrade must
then port it); a test checks the wrapped stream.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

from kopf._cogs.clients import watching

#: Set on the wrapper, so that installing twice wraps once.
_MARK = "_trainguard_slim"


def slimmed(event: Any) -> Any:
    """A watch event (or one of kopf's bookmarks) with its object's ``metadata.managedFields`` removed, in
    place: the event is the stream's own, read by nothing before kopf."""
    if isinstance(event, dict):
        obj = event.get("object")
        metadata = obj.get("metadata") if isinstance(obj, dict) else None
        if isinstance(metadata, dict):
            metadata.pop("managedFields", None)
    return event


def slim_stream(watch: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """``watch`` (an async generator function of watch events) yielding its events ``slimmed``."""

    @functools.wraps(watch)
    async def slim(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async for event in watch(*args, **kwargs):
            yield slimmed(event)

    setattr(slim, _MARK, True)
    return slim


def install() -> None:
    """Make kopf's watch streams drop ``managedFields`` (idempotent). Called before kopf starts watching
    (``handlers`` calls it at import)."""
    watch = getattr(watching, "infinite_watch", None)
    if watch is None or not callable(watch):
        raise RuntimeError(
            "kopf._cogs.clients.watching.infinite_watch is gone: this kopf version is not the one "
            "trainguard_operator.slim_watch was written for"
        )
    if not getattr(watch, _MARK, False):
        watching.infinite_watch = slim_stream(watch)

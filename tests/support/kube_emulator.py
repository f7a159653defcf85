"""The Kubernetes API emulator the operator's integration tests and ``bench/operator_scale.py`` run against:
kmock's ``KubernetesEmulator`` plus what a real API server does that kopf and the operator rely on.
Its own behaviour is tested in ``tests/integration/test_operator_emulator.py``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import kmock
from kmock._internal.rendering import ReactionMismatchError

NS = "default"
VERBS = {"list", "watch", "get", "create", "update", "patch", "delete"}


def selects(selector: str, labels: Any) -> bool:
    """Whether an equality-based label selector (``a=b,c!=d,e,!f``) selects an object with ``labels``."""
    labels = labels if isinstance(labels, dict) else {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class FastReactions(kmock.RawHandler):
    """kmock's reaction matching without its cost growing with the requests served.

    kmock 0.8 decides whether a reaction sees a request with ``request in reaction_source``, which
    replays every request served so far through the reaction's filters: each request costs more the
    longer the emulator runs (~80 ms after a few hundred). Here a chain of filters and priorities over
    the emulator is checked on the request alone (what replaying gives for such a chain); any other view
    (slices, unions...) still gets kmock's own check. The order of reactions is kmock's.
    """

    def _sees(self, view: Any, request: kmock.Request) -> bool:
        while True:
            if view is self:
                return True
            if type(view) is kmock.Filter:
                if not view.criteria(request):
                    return False
            elif type(view) is not kmock.Priority:
                return request in view
            view = view._source

    async def _handle(self, request: kmock.Request) -> Any:
        # As kmock.RawHandler._handle (reverse priority, padded to one length, stable), then the check.
        priorities = [payload.priorities for payload in self._payloads]
        length = max((len(p) for p in priorities), default=0)
        keys = [tuple(-v for v in p) + (0,) * (length - len(p)) for p in priorities]
        for index in sorted(range(len(keys)), key=lambda i: keys[i]):
            payload = self._payloads[index]
            if self._sees(payload._source, request) and not payload._disabled.is_set():
                try:
                    return await payload(request)
                except ReactionMismatchError:
                    payload._disabled.set()
                except NotImplementedError:
                    pass
        raise NotImplementedError("no reaction matches the request")


#: What an API server answers a watch whose resourceVersion it no longer has.
GONE = {
    "type": "ERROR",
    "object": {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "reason": "Expired",
        "message": "too old resource version",
        "code": 410,
    },
}


#: What an API server that is not ready answers every request.
UNAVAILABLE = {
    "kind": "Status",
    "apiVersion": "v1",
    "status": "Failure",
    "reason": "ServiceUnavailable",
    "message": "the server is currently unable to handle the request",
    "code": 503,
}


class WatchFaults:
    """Watches of one plural ended, held and answered 410 Gone on a test's request."""

    def __init__(self) -> None:
        self.cut = asyncio.Event()
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.gone = False


class Emulator(kmock.KubernetesEmulator, FastReactions):
    """kmock's emulator plus the API server behaviour the operator and kopf rely on: on creation a uid,
    a creationTimestamp and a name from ``generateName`` (kopf names Events so); a resourceVersion that
    changes with every write; optimistic concurrency on it (a merge patch carrying a stale
    resourceVersion gets 409, a JSON patch whose ``test`` of it fails gets 422); lists and watches
    filtered by their label selector; and a cost per request that does not grow with the requests served.

    A test can break the watches of a kind as a network or an API server would (``break_watches``,
    ``resume_watches``): open ones end, new ones wait, and the first after the break is answered 410
    Gone (the version it asks for is gone), so only a watcher that lists again sees what changed
    meanwhile (kmock replays no deletion to a new watch). It can also go down as a whole (``go_down``,
    ``come_back``): every open watch ends and every request is answered 503, as while a restarted API
    server is not ready."""

    _serial = 0
    _down = False

    def go_down(self) -> None:
        """End every open watch and answer every request 503 until ``come_back``."""
        self._down = True
        for faults in self.__dict__.setdefault("_watch_faults", {}).values():
            faults.cut.set()
            faults.cut = asyncio.Event()

    def come_back(self) -> None:
        """Serve again after ``go_down``."""
        self._down = False

    def _faults(self, plural: str | None) -> WatchFaults:
        table: dict[str | None, WatchFaults] = self.__dict__.setdefault("_watch_faults", {})
        return table.setdefault(plural, WatchFaults())

    def break_watches(self, plural: str) -> None:
        """End every open watch of ``plural``; new ones wait for ``resume_watches``."""
        faults = self._faults(plural)
        faults.cut.set()
        faults.cut = asyncio.Event()
        faults.resumed.clear()
        faults.gone = True

    def resume_watches(self, plural: str) -> None:
        """Let the watches of ``plural`` be opened again (the first is answered 410 Gone)."""
        self._faults(plural).resumed.set()

    def watches_open(self, plural: str) -> int:
        """How many watches of ``plural`` are streaming now."""
        found: dict[str | None, int] = self.__dict__.setdefault("_watches_open", {})
        return found.get(plural, 0)

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        plural = getattr(request.resource, "plural", None)
        faults = self._faults(plural)
        await faults.resumed.wait()
        if faults.gone:
            faults.gone = False
            yield b""
            yield GONE
            return
        cut = faults.cut
        selector = request.params.get("labelSelector")
        stream = super()._serve_watch(request).__aiter__()
        counts: dict[str | None, int] = self.__dict__.setdefault("_watches_open", {})
        counts[plural] = counts.get(plural, 0) + 1
        following: asyncio.Future[Any] | None = None
        try:
            while True:
                following = asyncio.ensure_future(stream.__anext__())
                cutting = asyncio.ensure_future(cut.wait())
                await asyncio.wait({following, cutting}, return_when=asyncio.FIRST_COMPLETED)
                cutting.cancel()
                if not following.done():
                    following.cancel()
                    await asyncio.gather(following, return_exceptions=True)
                    return
                try:
                    item = following.result()
                except StopAsyncIteration:
                    return
                if selector and isinstance(item, dict):
                    labels = ((item.get("object") or {}).get("metadata") or {}).get("labels")
                    if not selects(str(selector), labels):
                        continue
                yield item
        finally:
            counts[plural] -= 1
            if following is not None and not following.done():
                following.cancel()
                await asyncio.gather(following, return_exceptions=True)
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()

    def _next_version(self) -> str:
        Emulator._serial += 1
        return str(Emulator._serial)

    def _current_version(self, request: kmock.Request) -> str | None:
        if request.resource is None or request.name is None:
            return None
        try:
            found = self.objects[request.resource, request.namespace, request.name]
        except KeyError:
            return None
        return None if found.deleted else found.raw.get("metadata", {}).get("resourceVersion")

    async def _handle(self, request: kmock.Request) -> Any:
        if self._down:  # a plain Status, as the API server's (kmock's own errors carry a traceback)
            return aiohttp.web.json_response(UNAVAILABLE, status=503)
        data = request.data
        if request.resource is not None and request.action == kmock.action.CREATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            version = self._next_version()
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{version}"
            meta.setdefault("uid", f"uid-{version}")
            meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            meta["resourceVersion"] = version
        elif request.resource is not None and request.action == kmock.action.UPDATE and request.name:
            current = self._current_version(request)
            if isinstance(data, list):
                for op in data:
                    test = op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion"
                    if test and op.get("value") != current:
                        raise kmock.KubernetesError(status=422, reason="Invalid", message="stale test")
                data.append({"op": "add", "path": "/metadata/resourceVersion", "value": self._next_version()})
            elif isinstance(data, dict):
                wanted = (data.get("metadata") or {}).get("resourceVersion")
                if wanted is not None and current is not None and wanted != current:
                    raise kmock.KubernetesError(
                        status=409, reason="Conflict", message="the object has been modified"
                    )
                data.setdefault("metadata", {})["resourceVersion"] = self._next_version()
        return await super()._handle(request)

    async def _serve_list(self, request: kmock.Request) -> Any:
        # kmock 0.8 ignores ?labelSelector=: lists are filtered here, as the API server filters them.
        payload = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector and isinstance(payload, dict):
            payload["items"] = [
                item
                for item in payload.get("items", [])
                if selects(str(selector), (item.get("metadata") or {}).get("labels"))
            ]
        return payload

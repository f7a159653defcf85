"""The Kubernetes API emulator the operator's integration tests and ``bench/operator_scale.py`` run against:
kmock's ``KubernetesEmulator`` plus what a real API server does that kopf and the operator rely on.
Its own behaviour is tested in ``tests/integration/test_operator_emulator.py``."""

from __future__ import annotations

import time
from typing import Any

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


class Emulator(kmock.KubernetesEmulator, FastReactions):
    """kmock's emulator plus the API server behaviour the operator and kopf rely on: on creation a uid,
    a creationTimestamp and a name from ``generateName`` (kopf names Events so); a resourceVersion that
    changes with every write; optimistic concurrency on it (a merge patch carrying a stale
    resourceVersion gets 409, a JSON patch whose ``test`` of it fails gets 422); lists filtered by their
    label selector; and a cost per request that does not grow with the requests served."""

    _serial = 0

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

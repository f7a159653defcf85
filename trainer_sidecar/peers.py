"""What one rank tells the others without a collective: that it is busy, and for how long.

A rank busy with something that is not a step (an evaluation only rank 0 runs, a save of the loop's
own) makes its peers wait in their next collective, where they look hung to their own sidecars. The busy
rank therefore announces itself in the process group's key-value store (the rendezvous store every
torch.distributed job has), and a light thread on every rank watches it: while a peer is busy and this
rank makes no progress, this rank reports itself busy too ("waiting for rank 0: eval"), for at most what
the peer asked. The store is used from that thread's own connection, so a main thread blocked in a
collective does not block it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

_COUNT_KEY = "trainguard/busy-count"
_LATEST_KEY = "trainguard/busy-latest"
WATCH_SECONDS = 2.0


@dataclass(frozen=True)
class PeerBusy:
    """A peer's announcement: which rank, doing what, for at most how long, since when (its clock)."""

    rank: int
    reason: str
    seconds: float | None
    since: float


def default_store() -> Any | None:
    """The default process group's store (None without a process group, or if this torch has none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        store = getter() if getter is not None else None
        # A connection of its own, when the store can make one: the watcher must not share a socket with
        # the process group's own use of the store.
        return store.clone() if store is not None and hasattr(store, "clone") else store
    except (RuntimeError, ValueError, NotImplementedError):
        return None


class PeerBoard:
    """Announcements of busy ranks in the store: ``announce`` and ``withdraw`` from the busy rank,
    ``busy_peer`` from the watchers. Every call swallows store errors (logged once): telling peers is a
    courtesy, it must never fail the training step."""

    def __init__(self, store: Any, rank: int) -> None:
        self._store = store
        self._rank = rank
        self._warned = False

    def _safely(self, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except Exception as exc:  # the store is a network service: anything can go wrong
            if not self._warned:
                log.warning("the process group's store is not usable for busy announcements: %s", exc)
                self._warned = True
            return None

    def announce(self, reason: str, seconds: float | None) -> None:
        """Tell the peers this rank is busy."""
        payload = json.dumps({"rank": self._rank, "reason": reason, "seconds": seconds, "since": time.time()})
        self._safely(lambda: self._store.set(_LATEST_KEY, payload))
        self._safely(lambda: self._store.add(_COUNT_KEY, 1))

    def withdraw(self) -> None:
        """Tell the peers this rank is busy no longer."""
        self._safely(lambda: self._store.add(_COUNT_KEY, -1))

    def busy_peer(self) -> PeerBusy | None:
        """The latest announcement while any rank is busy (None when none is, or the store fails)."""
        count = self._safely(lambda: self._store.add(_COUNT_KEY, 0))
        if not isinstance(count, int) or count <= 0:
            return None
        raw = self._safely(lambda: self._store.get(_LATEST_KEY))
        try:
            data = json.loads(raw)
            seconds = data["seconds"]
            allowed = None if seconds is None else float(seconds)
            return PeerBusy(int(data["rank"]), str(data["reason"])[:100], allowed, float(data["since"]))
        except (TypeError, ValueError, KeyError):
            return None


class PeerWatch:
    """A daemon thread that calls ``on_change(peer)`` when a busy peer appears or goes (``peer`` None),
    checking every ``WATCH_SECONDS`` while ``idle()`` (this rank makes no progress) is true."""

    def __init__(
        self, board: PeerBoard, idle: Callable[[], bool], on_change: Callable[[PeerBusy | None], None]
    ) -> None:
        self._board, self._idle, self._on_change = board, idle, on_change
        self._stop = threading.Event()
        self._current: PeerBusy | None = None
        self._thread = threading.Thread(target=self._run, name="trainguard-peer-watch", daemon=True)

    def start(self) -> None:
        """Start watching."""
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (the thread ends within one period)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(WATCH_SECONDS):
            peer = self._board.busy_peer() if self._idle() else None
            if peer != self._current:
                self._current = peer
                try:
                    self._on_change(peer)
                except Exception:  # a status that cannot be written is the sidecar's problem to report
                    log.exception("reporting a busy peer failed")

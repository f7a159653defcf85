"""Busy sections: a rank doing something that is not a training step, for how long, and the peers that
wait for it meanwhile.

``BusySections`` is what a guardian publishes about itself (``Guardian.busy``) and about a busy peer. What
one rank tells the others travels without a collective, as follows.

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
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from trainer_sidecar.contract.status import MAX_BUSY_REASON_CHARS, MAX_BUSY_SECONDS, Phase

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


class BusySections:
    """The busy sections a rank is in (nested, innermost last), the busy peer it waits for, and when its
    last progress was; ``view`` is what its status says about them."""

    def __init__(self) -> None:
        self._sections: list[tuple[str, float | None]] = []
        self.since: float | None = None
        self._peer: PeerBusy | None = None
        self._peer_noticed = 0.0
        self.last_progress = time.monotonic()
        self._board: PeerBoard | None = None
        self._watch: PeerWatch | None = None

    def enter(self, reason: str, seconds: float | None) -> float | None:
        """Begin a section; returns what ``since`` was, for ``leave``. Raises ValueError for a bound that
        is not a positive number of at most ``MAX_BUSY_SECONDS``."""
        if seconds is not None and not (math.isfinite(seconds) and 0 < seconds <= MAX_BUSY_SECONDS):
            raise ValueError(f"busy seconds must be a positive number of at most {MAX_BUSY_SECONDS:g}")
        self._sections.append((reason[:MAX_BUSY_REASON_CHARS], seconds))
        before, self.since = self.since, self.since or time.time()
        if self._board is not None:
            self._board.announce(reason, seconds)
        return before

    def leave(self, since: float | None) -> None:
        """End the innermost section (``since``: what ``enter`` returned); the hang clock restarts."""
        self._sections.pop()
        if self._board is not None:
            self._board.withdraw()
        self.since = since
        self.progressed()

    def progressed(self) -> None:
        """The rank made progress (a step boundary, the end of a section)."""
        self.last_progress = time.monotonic()

    def watch_peers(self, rank: int, on_change: Callable[[], None]) -> None:
        """Tell peers of this rank's sections, and watch theirs (``on_change`` when a busy peer appears or
        goes), through the process group's store; nothing without one."""
        store = default_store()
        if store is None:
            return
        self._board = PeerBoard(store, rank)
        idle = lambda: time.monotonic() - self.last_progress > WATCH_SECONDS  # noqa: E731

        def changed(peer: PeerBusy | None) -> None:
            self._peer, self._peer_noticed = peer, time.time()
            if peer is not None:
                log.info("waiting for rank %d, busy with %s", peer.rank, peer.reason)
            on_change()

        self._watch = PeerWatch(self._board, idle, changed)
        self._watch.start()

    def stop(self) -> None:
        """Stop watching peers."""
        if self._watch is not None:
            self._watch.stop()

    def view(self, phase: Phase, busy_since: float | None) -> tuple[Phase, float | None, str, float | None]:
        """(phase, busy since, what, for how long) as the status says them: the rank's own ``phase``
        (and ``busy_since``) unless it is running and in a section, or running and waiting for a busy
        peer (then for at most what the peer asked, counted from its start)."""
        if phase is not Phase.RUNNING:
            return phase, busy_since, "", None
        if self._sections:
            reason, seconds = self._sections[-1]
            return Phase.BUSY, self.since, reason, seconds
        peer = self._peer
        if peer is None:
            return phase, None, "", None
        left = None if peer.seconds is None else max(1.0, peer.seconds - (time.time() - peer.since))
        left = None if left is None else min(left, MAX_BUSY_SECONDS)
        return Phase.BUSY, self._peer_noticed, f"waiting for rank {peer.rank}: {peer.reason}", left

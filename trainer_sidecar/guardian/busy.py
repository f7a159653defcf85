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

An evaluation the loop did not declare is one too when the guardian can see it: the guarded model in eval
mode while the training thread is in the loop's own code (``evaluation_change``, asked by the activity
watch's thread, never by the training thread). It is an unbounded section like ``busy("eval")``, opened
and closed from that thread (``BusySections.enter_implicit``), announced to the peers alike.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch.distributed as dist

from trainer_sidecar.contract.allowance import OpenSection, busy_allowance
from trainer_sidecar.contract.status import (
    MAX_BUSY_REASON_CHARS,
    MAX_BUSY_SECONDS,
    MAX_BUSY_SECTIONS,
    Activity,
    BusySection,
    Phase,
)
from trainer_sidecar.guardian.config import ConfigError
from trainer_sidecar.guardian.progress import ProgressClock

log = logging.getLogger(__name__)

_COUNT_KEY = "trainguard/busy-count"
_LATEST_KEY = "trainguard/busy-latest"
WATCH_SECONDS = 2.0
#: What an evaluation the guardian inferred (the model in eval mode between steps) is published as.
EVAL_MODE_REASON = "eval (the model is in eval mode)"
#: What a step's training runs in (the loop's forward pass aside): a model in eval mode seen in one of
#: these trains in eval mode (frozen batch norm, no dropout), so its eval mode says nothing of an evaluation.
STEP_ACTIVITIES = frozenset({Activity.BACKWARD, Activity.STEP, Activity.COLLECTIVE})

#: The progress a step makes: the step kept and the cumulative step count (a rollback changes either).
StepProgress = tuple[int, int]


class EvalChange(StrEnum):
    """What ``evaluation_change`` tells the activity watch to do."""

    NONE = "none"
    BEGIN = "begin"  # open the implicit evaluation section
    END = "end"  # close it: the model went back to train mode (the end of a pause: progress)
    STEPPED = "stepped"  # close it: a step (or a rollback, or the loop's end) ended it


def evaluation_change(
    open_at: StepProgress | None,
    progress: StepProgress,
    phase: Phase,
    activity: Activity,
    lasted: float,
    period: float,
    eval_mode: bool,
    trains_in_eval_mode: bool,
) -> EvalChange:
    """Whether an implicit evaluation section begins or ends, from one look of the activity watch: the
    section open since ``progress`` was ``open_at`` (None: none open), the ``progress`` and ``phase`` now,
    the training thread's ``activity`` (lasted ``lasted`` seconds), whether the guarded model is in eval
    mode, and whether the loop was seen training in eval mode.

    Begins when running, in the loop's own code for at least ``period``, with the model in eval mode,
    unless the loop trains in eval mode. Ends with ``STEPPED`` once the progress moved, the phase is no
    longer running, or the thread is in a step's own work; else with ``END`` once the model is back in
    train mode. Inside the loop's own busy sections (activity busy) an open section stays open. Pure."""
    if open_at is not None:
        if progress != open_at or phase is not Phase.RUNNING or activity in STEP_ACTIVITIES:
            return EvalChange.STEPPED
        return EvalChange.NONE if eval_mode else EvalChange.END
    if (
        eval_mode
        and not trains_in_eval_mode
        and phase is Phase.RUNNING
        and activity is Activity.LOOP
        and lasted >= period
    ):
        return EvalChange.BEGIN
    return EvalChange.NONE


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


@dataclass(frozen=True)
class BusyView:
    """What a status says about busy sections: the phase, when the busy stretch began, what the rank is
    busy with (the innermost section), the seconds allowed from ``since`` for a sidecar that reads no
    ``sections`` (None: the startup grace), and every open section (outermost first)."""

    phase: Phase
    since: float | None
    reason: str = ""
    seconds: float | None = None
    sections: tuple[BusySection, ...] = ()


class _Section:
    """One open section (a token: ``leave`` closes this one, whichever order sections are closed in)."""

    __slots__ = ("reason", "seconds", "since")

    def __init__(self, reason: str, seconds: float | None, since: float) -> None:
        self.reason, self.seconds, self.since = reason, seconds, since


def legacy_seconds(sections: tuple[BusySection, ...], since: float) -> float | None:
    """The one bound, counted from ``since`` (when the busy stretch began), that gives a sidecar reading
    only ``busy_since``/``busy_seconds`` the same verdict as the nested rule (``contract.allowance``):
    the earliest deadline of the bounded sections (the sidecar caps it at its grace, as the rule does
    for each section and for the stretch). None when no section is bounded. At least a millisecond (the
    field must be positive), at most ``MAX_BUSY_SECONDS``."""
    opened = [OpenSection(s.since, s.seconds, s.reason) for s in sections]
    allowance = busy_allowance(opened, since, None)
    if allowance is None:
        return None
    deadline = allowance.section.start + allowance.allowed
    return min(MAX_BUSY_SECONDS, max(1e-3, deadline - since))


class BusySections:
    """The busy sections a rank is in (open ones in the order they were entered), the busy peer it waits
    for, and when its last progress was; ``view`` is what its status says about them. Sections are
    closed by their token, so closing out of order closes the right one, and closing one twice is a
    no-op. Safe to use from several threads."""

    def __init__(self) -> None:
        self._sections: list[_Section] = []
        # The implicit evaluation section, and the progress it began at (see ``enter_implicit``).
        self._implicit: tuple[_Section, StepProgress] | None = None
        self._stretch_since: float | None = None  # when the open sections began (the first of them opened)
        self._lock = threading.Lock()
        self._peer: PeerBusy | None = None
        self._peer_noticed = 0.0
        self.last_progress = time.monotonic()
        self._board: PeerBoard | None = None
        self._watch: PeerWatch | None = None

    @property
    def since(self) -> float | None:
        """When the busy stretch began: the first of the open sections opened then (None: none is open).
        It stays while any section is open, whichever closes first."""
        return self._stretch_since

    @property
    def waiting(self) -> bool:
        """Whether this rank waits for a busy peer (as the peer watch last saw)."""
        return self._peer is not None

    def enter(self, reason: str, seconds: float | None) -> object:
        """Begin a section; returns its token, for ``leave``. Raises ConfigError for a bound that is not a
        positive number of at most ``MAX_BUSY_SECONDS``, or beyond ``MAX_BUSY_SECTIONS`` open sections (a
        status carries no more: a recursion through a busy-decorated function, most likely)."""
        if seconds is not None and not (math.isfinite(seconds) and 0 < seconds <= MAX_BUSY_SECONDS):
            raise ConfigError(
                f"guardian.busy(seconds=...): busy seconds must be a positive number of at most "
                f"{MAX_BUSY_SECONDS:g}, got {seconds!r}"
            )
        section = _Section(reason[:MAX_BUSY_REASON_CHARS], seconds, time.time())
        with self._lock:
            if len(self._sections) >= MAX_BUSY_SECTIONS:
                raise ConfigError(
                    f"guardian.busy(...): at most {MAX_BUSY_SECTIONS} busy sections may be open at once "
                    "(a busy-decorated function that recurses?)"
                )
            self._sections.append(section)
            if self._stretch_since is None:
                self._stretch_since = section.since
        if self._board is not None:
            self._board.announce(reason, seconds)
        return section

    def enter_implicit(self, reason: str, progress: StepProgress) -> object:
        """Begin a section the guardian inferred rather than the loop declared: unbounded, as
        ``enter(reason, None)``, and shown by ``view`` only while the step progress is still ``progress``
        (a step ends it at once, before the watch that opened it closes it with ``leave``)."""
        token = self.enter(reason, None)
        with self._lock:
            assert isinstance(token, _Section)
            self._implicit = (token, progress)
        return token

    def leave(self, token: object) -> None:
        """End the section ``enter`` returned ``token`` for; the hang clock restarts. A section that is
        not open (closed before) is left alone, and the peers are told only once."""
        with self._lock:
            found = next((i for i, s in enumerate(self._sections) if s is token), None)
            if found is None:
                log.warning("a busy section was closed twice (or never opened); ignored")
                return
            del self._sections[found]
            if self._implicit is not None and self._implicit[0] is token:
                self._implicit = None
            if not self._sections:
                self._stretch_since = None
        if self._board is not None:
            self._board.withdraw()
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

    def view(self, phase: Phase, busy_since: float | None, progress: StepProgress | None = None) -> BusyView:
        """What the status says: the rank's own ``phase`` (and ``busy_since``) unless it is running and
        in sections (then every open section, see ``BusyView``), or running and waiting for a busy peer
        (then for at most what the peer asked, counted from its start). An implicit section is left out
        once ``progress`` differs from the one it began at: a step ended it."""
        if phase is not Phase.RUNNING:
            return BusyView(phase, busy_since)
        with self._lock:
            sections, since = list(self._sections), self._stretch_since
            implicit = self._implicit
        if implicit is not None and progress is not None and implicit[1] != progress:
            sections = [s for s in sections if s is not implicit[0]]
        opened = tuple(BusySection(reason=s.reason, since=s.since, seconds=s.seconds) for s in sections)
        if opened and since is not None:
            since = min(since, *(s.since for s in opened))  # a wall clock stepped back: the earliest
            return BusyView(Phase.BUSY, since, opened[-1].reason, legacy_seconds(opened, since), opened)
        peer = self._peer
        if peer is None:
            return BusyView(phase, None)
        left = None if peer.seconds is None else max(1.0, peer.seconds - (time.time() - peer.since))
        left = None if left is None else min(left, MAX_BUSY_SECONDS)
        reason = f"waiting for rank {peer.rank}: {peer.reason}"
        waiting = BusySection(reason=reason[:MAX_BUSY_REASON_CHARS], since=self._peer_noticed, seconds=left)
        return BusyView(Phase.BUSY, self._peer_noticed, waiting.reason, left, (waiting,))


@contextmanager
def held(
    sections: BusySections,
    section: object,
    mark: Callable[[Activity], Activity],
    publish: Callable[[], None],
    progress: ProgressClock,
) -> Iterator[None]:
    """Inside: the training thread is busy in ``section`` (entered already): marked ``Activity.BUSY`` and
    published (``publish``: at once); after, the section is left and the activity goes back."""
    before = mark(Activity.BUSY)
    publish()
    try:
        yield
    finally:
        mark(before)
        sections.leave(section)
        if sections.since is None:
            # The end of a busy stretch is progress, as a rollback's is: without it, the first status
            # after an evaluation longer than the hang timeout reads "no step for" that long.
            progress.pause_ended()
        publish()

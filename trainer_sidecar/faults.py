"""Fault injection for tests, demos and fire drills, driven by ``TRAINGUARD_FAULTS``.

Format: comma-separated ``KIND@STEP[xCOUNT][:RANK]``. KIND is one of nan_loss, inf_grad, loss_spike,
bad_sample, hang, crash. ``xCOUNT`` repeats the fault on COUNT consecutive steps (a burst); ``:RANK``
limits it to one rank (default: every rank). Examples: ``nan_loss@120x4``, ``hang@300:1``, ``crash@500``.

Each fault fires once per job, even across restarts: fired faults are recorded in a ledger beside the
checkpoints (one file per rank) *before* they take effect, so a crash at step 500 does not recur after
resuming from step 400.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

FAULTS_ENV = "TRAINGUARD_FAULTS"


class FaultKind(StrEnum):
    """The faults the guardian knows how to inject."""

    NAN_LOSS = "nan_loss"
    INF_GRAD = "inf_grad"
    LOSS_SPIKE = "loss_spike"
    BAD_SAMPLE = "bad_sample"
    HANG = "hang"
    CRASH = "crash"


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: a kind at a step, optionally on one rank only."""

    kind: FaultKind
    step: int
    rank: int | None = None

    @property
    def key(self) -> str:
        """The ledger key: the same fault always has the same key."""
        rank = "*" if self.rank is None else str(self.rank)
        return f"{self.kind.value}@{self.step}:{rank}"


_ITEM = re.compile(r"^(?P<kind>[a-z_]+)@(?P<step>\d+)(?:x(?P<count>\d+))?(?::(?P<rank>\d+))?$")


class FaultSpecError(ValueError):
    """The fault schedule cannot be parsed; the message quotes the bad item."""


def parse_faults(text: str) -> list[Fault]:
    """Parse a ``TRAINGUARD_FAULTS`` value into individual per-step faults."""
    faults: list[Fault] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        match = _ITEM.match(item)
        if match is None:
            raise FaultSpecError(f"{FAULTS_ENV}: cannot parse {item!r}; expected KIND@STEP[xCOUNT][:RANK]")
        try:
            kind = FaultKind(match["kind"])
        except ValueError:
            known = ", ".join(k.value for k in FaultKind)
            raise FaultSpecError(f"{FAULTS_ENV}: unknown fault kind in {item!r}; known: {known}") from None
        count = int(match["count"] or 1)
        if count < 1:
            raise FaultSpecError(f"{FAULTS_ENV}: burst count must be at least 1 in {item!r}")
        rank = int(match["rank"]) if match["rank"] is not None else None
        start = int(match["step"])
        faults.extend(Fault(kind, start + offset, rank) for offset in range(count))
    return faults


class FaultInjector:
    """Answers "does fault K fire now?" for one rank, remembering fired faults in a shared ledger."""

    def __init__(self, faults: list[Fault], rank: int, ledger_dir: Path | None) -> None:
        self._pending = {(f.kind, f.step): f for f in faults if f.rank is None or f.rank == rank}
        # One ledger per rank: ranks never write the same file, so no read-modify-write race.
        self._ledger = ledger_dir / f"faults-fired-rank{rank}.json" if ledger_dir is not None else None
        self.rank = rank

    @classmethod
    def from_env(cls, rank: int, ledger_dir: Path | None) -> FaultInjector:
        """Build from ``TRAINGUARD_FAULTS`` (empty: injects nothing)."""
        return cls(parse_faults(os.environ.get(FAULTS_ENV, "")), rank, ledger_dir)

    @property
    def active(self) -> bool:
        """Whether any fault is scheduled for this rank (lets the hot path skip all checks)."""
        return bool(self._pending)

    def _fired(self) -> set[str]:
        if self._ledger is None or not self._ledger.exists():
            return set()
        try:
            data = json.loads(self._ledger.read_text())
        except (OSError, json.JSONDecodeError):
            return set()
        return set(data) if isinstance(data, list) else set()

    def _record(self, key: str) -> None:
        if self._ledger is None:
            return
        fired = self._fired()
        fired.add(key)
        tmp = self._ledger.with_name(f".{self._ledger.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as handle:
            json.dump(sorted(fired), handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self._ledger)
        dir_fd = os.open(self._ledger.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def fires(self, kind: FaultKind, step: int) -> bool:
        """True exactly once per job for a scheduled (kind, step) on this rank; recorded before returning."""
        fault = self._pending.get((kind, step))
        if fault is None:
            return False
        if fault.key in self._fired():
            del self._pending[(kind, step)]
            return False
        self._record(fault.key)
        del self._pending[(kind, step)]
        return True

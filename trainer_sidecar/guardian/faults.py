"""Fault injection for tests, demos and fire drills, driven by ``TRAINGUARD_FAULTS``.

Format: comma-separated ``KIND@STEP[xCOUNT][:RANK]``. KIND is one of nan_loss, inf_grad, loss_spike,
bad_sample, hang, crash, or ``slow*FACTOR``. ``xCOUNT`` repeats the fault on COUNT consecutive steps (a
burst); ``:RANK`` limits it to one rank (default: every rank). Examples: ``nan_loss@120x4``,
``hang@300:1``, ``crash@500``, ``slow*2@20:1``. A burst is kept as a range, never expanded, so its length
costs nothing; every malformed or out-of-range item is a ``FaultSpecError`` naming it (the guardian makes
it a configuration error).

Each fault fires once per job, even across restarts: fired steps are recorded in a ledger beside the
checkpoints (one file per rank) *before* they take effect, so a crash at step 500 does not recur after
resuming from step 400. ``slow*FACTOR`` is a condition, not an event (a slow machine): from STEP on (for
COUNT steps when given, else to the end) the rank's own compute of every step is stretched FACTOR times
(from 1 to 100) by a sleep in the guardian's step, before the step's collective; it is not recorded in
the ledger, so it holds again after a restart.

The faults act through hooks the guardian offers (``FaultInjector.loss_hook``, ``grad_hook``,
``bad_sample_hook``), installed only when a fault is scheduled for the rank: the training step itself
holds no fault code. Loss faults, crashes and hangs act on the first micro-batch of their step, before
its backward; ``inf_grad`` poisons a gradient at the step's boundary before the gradients are unscaled,
so that an fp16 GradScaler sees the overflow and backs off, as it would for a real one.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import re
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch

from trainer_sidecar.checkpoint import fs
from trainer_sidecar.checkpoint.errors import CheckpointError
from trainer_sidecar.contract.env import FAULTS_ENV
from trainer_sidecar.tensors.sharding import local_tensor

log = logging.getLogger(__name__)

MAX_LEDGER_BYTES = 1 << 20
MAX_STEP = 1 << 53
MAX_RANK = 1 << 20
MAX_ITEMS = 256
MAX_TEXT = 64 << 10


class FaultKind(StrEnum):
    """The faults the guardian knows how to inject."""

    NAN_LOSS = "nan_loss"
    INF_GRAD = "inf_grad"
    LOSS_SPIKE = "loss_spike"
    BAD_SAMPLE = "bad_sample"
    HANG = "hang"
    CRASH = "crash"
    #: A condition: the rank's own compute stretched by ``Fault.factor`` (see the module docstring).
    SLOW = "slow"


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: a kind on ``count`` consecutive steps from ``step``, optionally on one rank."""

    kind: FaultKind
    step: int
    count: int = 1
    rank: int | None = None
    #: ``slow``'s stretch of the rank's own compute (1: none).
    factor: float = 1.0

    def covers(self, step: int) -> bool:
        """Whether the fault is scheduled at ``step``."""
        return self.step <= step < self.step + self.count


@dataclass(frozen=True)
class FaultSchedule:
    """A parsed ``TRAINGUARD_FAULTS``: the faults, in the order given."""

    faults: tuple[Fault, ...] = ()

    def for_rank(self, rank: int) -> tuple[Fault, ...]:
        """The faults that apply to ``rank``."""
        return tuple(f for f in self.faults if f.rank is None or f.rank == rank)


_ITEM = re.compile(
    r"^(?P<kind>[a-z_]+)(?:\*(?P<factor>\d{1,3}(?:\.\d{1,6})?))?@(?P<step>\d{1,20})"
    r"(?:x(?P<count>\d{1,20}))?(?::(?P<rank>\d{1,20}))?$"
)
#: The largest ``slow`` factor: beyond it a rank is hung more than slow.
MAX_SLOW_FACTOR = 100.0


class FaultSpecError(ValueError):
    """The fault schedule cannot be parsed or is out of range; the message quotes the bad item."""


def _parse_item(item: str) -> Fault:
    match = _ITEM.match(item)
    if match is None:
        raise FaultSpecError(
            f"{FAULTS_ENV}: cannot parse {item!r}; expected KIND@STEP[xCOUNT][:RANK] (slow*FACTOR@...)"
        )
    try:
        kind = FaultKind(match["kind"])
    except ValueError:
        known = ", ".join(k.value for k in FaultKind)
        raise FaultSpecError(f"{FAULTS_ENV}: unknown fault kind in {item!r}; known: {known}") from None
    factor = 1.0
    if kind is FaultKind.SLOW:
        if match["factor"] is None:
            raise FaultSpecError(f"{FAULTS_ENV}: slow needs its factor in {item!r}, as in slow*2@20:1")
        factor = float(match["factor"])
        if not 1.0 <= factor <= MAX_SLOW_FACTOR:
            raise FaultSpecError(f"{FAULTS_ENV}: slow factor must be 1 to {MAX_SLOW_FACTOR:g} in {item!r}")
    elif match["factor"] is not None:
        raise FaultSpecError(f"{FAULTS_ENV}: only slow takes a factor, not {kind.value} in {item!r}")
    step = int(match["step"])
    # A slow machine stays slow: without a count, to the end.
    count = int(match["count"]) if match["count"] else (MAX_STEP - step if kind is FaultKind.SLOW else 1)
    rank = int(match["rank"]) if match["rank"] is not None else None
    if count < 1:
        raise FaultSpecError(f"{FAULTS_ENV}: burst count must be at least 1 in {item!r}")
    if step + count > MAX_STEP:
        raise FaultSpecError(f"{FAULTS_ENV}: steps beyond 2^53 in {item!r}")
    if rank is not None and rank >= MAX_RANK:
        raise FaultSpecError(f"{FAULTS_ENV}: rank {rank} out of range in {item!r}")
    return Fault(kind, step, count, rank, factor)


def parse_faults(text: str) -> FaultSchedule:
    """Parse a ``TRAINGUARD_FAULTS`` value (empty: no faults). Raises FaultSpecError naming the bad item."""
    if len(text) > MAX_TEXT:
        raise FaultSpecError(f"{FAULTS_ENV}: {len(text)} characters is too long (at most {MAX_TEXT})")
    items = [item.strip() for item in text.split(",") if item.strip()]
    if len(items) > MAX_ITEMS:
        raise FaultSpecError(f"{FAULTS_ENV}: {len(items)} items is too many (at most {MAX_ITEMS})")
    return FaultSchedule(tuple(_parse_item(item) for item in items))


class FiredSteps:
    """The steps at which each (kind, rank) fault has fired, as merged ranges (so a long burst stays small).

    Serialised as a sorted list of ledger keys ``KIND@STEP[xCOUNT]:RANK`` (RANK ``*``: every rank); a key
    that does not parse is ignored (a damaged ledger means faults may fire again, never a crash).
    """

    def __init__(self) -> None:
        self._ranges: dict[tuple[str, str], list[tuple[int, int]]] = {}

    @classmethod
    def from_keys(cls, keys: Iterable[object]) -> FiredSteps:
        """Parse ledger keys; anything else is skipped."""
        fired = cls()
        for key in keys:
            match = _LEDGER_KEY.match(key) if isinstance(key, str) else None
            if match is not None:
                start, count = int(match["step"]), int(match["count"] or 1)
                fired._add(match["kind"], match["rank"], start, min(start + count, MAX_STEP))
        return fired

    def _add(self, kind: str, rank: str, start: int, end: int) -> None:
        ranges = sorted([*self._ranges.get((kind, rank), []), (start, end)])
        merged: list[tuple[int, int]] = []
        for lo, hi in ranges:
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
            else:
                merged.append((lo, hi))
        self._ranges[(kind, rank)] = merged

    def add(self, fault: Fault, step: int) -> None:
        """Record that ``fault`` fired at ``step``."""
        self._add(fault.kind.value, _rank_label(fault), step, step + 1)

    def covers_all(self, fault: Fault) -> bool:
        """Whether ``fault`` fired at every step it is scheduled for."""
        ranges = self._ranges.get((fault.kind.value, _rank_label(fault)), [])
        index = bisect.bisect_right(ranges, (fault.step, MAX_STEP + 1)) - 1
        return index >= 0 and ranges[index][0] <= fault.step and fault.step + fault.count <= ranges[index][1]

    def contains(self, fault: Fault, step: int) -> bool:
        """Whether ``fault`` already fired at ``step``."""
        ranges = self._ranges.get((fault.kind.value, _rank_label(fault)), [])
        index = bisect.bisect_right(ranges, (step, MAX_STEP + 1)) - 1
        return index >= 0 and ranges[index][0] <= step < ranges[index][1]

    def keys(self) -> list[str]:
        """The ledger keys, sorted."""
        return sorted(
            f"{kind}@{lo}{'' if hi - lo == 1 else f'x{hi - lo}'}:{rank}"
            for (kind, rank), ranges in self._ranges.items()
            for lo, hi in ranges
        )


_LEDGER_KEY = re.compile(
    r"^(?P<kind>[a-z_]+)@(?P<step>\d{1,20})(?:x(?P<count>\d{1,20}))?:(?P<rank>\*|\d{1,20})$"
)


def _rank_label(fault: Fault) -> str:
    return "*" if fault.rank is None else str(fault.rank)


class FaultInjector:
    """Answers "does fault K fire now?" for one rank, remembering fired faults in a shared ledger."""

    def __init__(self, schedule: FaultSchedule, rank: int, ledger_dir: Path | None) -> None:
        self._faults = schedule.for_rank(rank)
        # One ledger per rank: ranks never write the same file, so no read-modify-write race.
        self._ledger = ledger_dir / f"faults-fired-rank{rank}.json" if ledger_dir is not None else None
        self._fired = self._read_ledger()
        self._slow = [f for f in self._faults if f.kind is FaultKind.SLOW]
        self._pending = [
            f for f in self._faults if f.kind is not FaultKind.SLOW and not self._fired.covers_all(f)
        ]
        self.rank = rank

    @property
    def active(self) -> bool:
        """Whether a fault is still to fire on this rank (the guardian's hooks do nothing otherwise)."""
        return bool(self._pending or self._slow)

    def slow_factor(self, step: int) -> float:
        """How many times its own compute ``step`` takes on this rank (1: not slowed). Never recorded."""
        return max((f.factor for f in self._slow if f.covers(step)), default=1.0)

    def _read_ledger(self) -> FiredSteps:
        if self._ledger is None or not self._faults or not self._ledger.parent.exists():
            return FiredSteps()  # nothing to fire, or a new directory: nothing fired yet
        try:
            with fs.open_side_dir(self._ledger.parent) as dir_fd:
                raw = fs.read_if_present(dir_fd, self._ledger.name, MAX_LEDGER_BYTES, str(self._ledger))
            data = json.loads(raw) if raw is not None else []
        except (CheckpointError, ValueError) as exc:
            log.warning("fault ledger not read (faults may fire again): %s", exc)
            return FiredSteps()
        return FiredSteps.from_keys(data if isinstance(data, list) else [])

    def _write_ledger(self) -> None:
        if self._ledger is None:
            return
        payload = json.dumps(self._fired.keys()).encode()
        try:
            with fs.open_side_dir(self._ledger.parent) as dir_fd:
                fs.replace_file(dir_fd, self._ledger.name, payload)
        except (CheckpointError, OSError) as exc:
            log.error(
                "fault ledger %s not written (the fault may fire again after a restart): %s",
                self._ledger,
                exc,
            )

    def fires(self, kind: FaultKind, step: int) -> bool:
        """True exactly once per job for a scheduled (kind, step) on this rank; recorded before returning."""
        fault = next((f for f in self._pending if f.kind is kind and f.covers(step)), None)
        if fault is None or self._fired.contains(fault, step):
            return False
        self._fired.add(fault, step)
        self._write_ledger()
        if self._fired.covers_all(fault):
            self._pending.remove(fault)
        return True

    # -- hooks -----------------------------------------------------------------------------------------
    def loss_hook(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """Before the first backward of ``step``: crash or hang the process, or poison or inflate the loss."""
        if self.fires(FaultKind.CRASH, step):
            log.error("fault injection: crash at step %d (SIGKILL)", step)
            os.kill(os.getpid(), signal.SIGKILL)
            # Still here: the worker is PID 1 of its PID namespace (a pod's container with no init), where
            # the kernel drops a signal the process sends itself without a handler, SIGKILL included.
            os._exit(128 + signal.SIGKILL)
        if self.fires(FaultKind.HANG, step):
            log.error("fault injection: hang at step %d", step)
            while True:
                time.sleep(3600)
        if self.fires(FaultKind.NAN_LOSS, step):
            return loss * math.nan
        if self.fires(FaultKind.LOSS_SPIKE, step):
            return loss * 50.0
        return loss

    def grad_hook(self, params: Sequence[torch.nn.Parameter], step: int) -> None:
        """At ``step``'s boundary, before unscaling: make one gradient element infinite."""
        if not self.fires(FaultKind.INF_GRAD, step):
            return
        # A sharded gradient is poisoned in this rank's own shard (a DTensor's local tensor).
        grad = next((g for p in params if p.grad is not None and (g := local_tensor(p.grad)).numel()), None)
        if grad is not None:
            with torch.no_grad():
                grad.view(-1)[0] = math.inf

    def bad_sample_hook(self, step_of: Callable[[], int]) -> Callable[[], bool]:
        """For the data guard: asked once per batch, True adds a NaN-poisoned sample to the batch."""
        return lambda: self.fires(FaultKind.BAD_SAMPLE, step_of())


def expand(schedule: FaultSchedule, limit: int) -> Iterable[tuple[FaultKind, int, int | None]]:
    """(kind, step, rank) of every scheduled step, at most ``limit`` of them (for tests and reports)."""
    produced = 0
    for fault in schedule.faults:
        for step in range(fault.step, fault.step + min(fault.count, limit - produced)):
            yield fault.kind, step, fault.rank
            produced += 1
        if produced >= limit:
            return

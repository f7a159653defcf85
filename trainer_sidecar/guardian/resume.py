"""Which checkpoint a gang resumes from, and the epoch it writes under: agreed by every rank.

Every rank must restore the same checkpoint, or their weights differ from the first step on. Each rank
proposes the newest checkpoint it can verify (its own files and rank 0's), the gang takes the oldest
proposal, every rank verifies that one, and if any rank cannot, all step below it and try again. A
checkpoint that verifies but then fails to load on some rank (damaged in between, malformed content) is
skipped the same way. Without a process group this is simply the newest valid checkpoint.

Writers are fenced by epochs (``trainer_sidecar.checkpoint.fence``): every rank first checks that it can
write the checkpoint directory (a read-only or full volume is refused on every rank alike, before any
claim is written), then rank 0 claims the next epoch and the gang adopts it.

Damage never means "start from scratch" while older history is there: an unreadable epoch claim falls
back to the newest readable one, and a damaged checkpoint to the next older valid one. A start that
passed over anything (on any rank) says so; the guardian then holds pruning for the whole run, so the
history stays for a human to look at.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from trainer_sidecar.checkpoint import (
    CheckpointError,
    CheckpointId,
    CheckpointStore,
    EpochOwner,
    claim_next_epoch,
)
from trainer_sidecar.checkpoint.store import check_writable
from trainer_sidecar.guardian.gang import Gang

log = logging.getLogger("trainguard")

_NONE = -1


@dataclass(frozen=True)
class GangClaim:
    """The epoch the gang writes under, and what rank 0's claim passed over (None: nothing)."""

    epoch: int
    damage: str | None = None


@dataclass
class Resumed:
    """What ``NewestRestorable`` restored (None: a fresh start) and what it passed over on this rank.

    ``damaged`` is agreed by the gang: True when any rank passed over a checkpoint (or found checkpoints
    but none valid)."""

    checkpoint: CheckpointId | None
    passed_over: list[str] = field(default_factory=list)
    damaged: bool = False


def claim_gang_epoch(root: Path, gang: Gang, owner: EpochOwner) -> GangClaim:
    """Every rank checks that it can write ``root``; then rank 0 claims the next epoch of it and every
    rank returns that epoch.

    A directory that some rank cannot write (read-only, full, not a directory), and a claim that fails on
    rank 0, are reported to every rank as a CheckpointError naming the directory: no claim is written
    unless every rank can write, and no rank writes under an epoch the others do not share.
    """
    usable, failure = 1, ""
    try:
        check_writable(root, gang.rank)
    except CheckpointError as exc:
        usable, failure = 0, f"rank {gang.rank}: {exc}"
        log.error("%s", failure)
    (everyone,) = gang.agree_min([usable])
    if everyone == 0:
        elsewhere = f"checkpoint directory {root} is not writable on another rank (see its log)"
        raise CheckpointError(failure or elsewhere)
    claimed, damage = _NONE, None
    if gang.rank == 0:
        try:
            claim = claim_next_epoch(root, owner)
            claimed, damage = claim.record.epoch, claim.over.damage(root)
        except CheckpointError as exc:
            failure = str(exc)
    if damage is not None:
        log.warning("%s", damage)
    epoch, damaged = gang.agree_max([claimed, int(damage is not None)])
    if epoch == _NONE:
        raise CheckpointError(failure or f"rank 0 could not claim an epoch of {root}")
    if damaged and damage is None:
        damage = f"checkpoint directory {root}: rank 0 passed over unreadable epoch claims (see its log)"
    return GangClaim(epoch, damage)


def agree_checkpoint(
    store: CheckpointStore, gang: Gang, below: CheckpointId | None, passed_over: list[str] | None = None
) -> CheckpointId | None:
    """The newest checkpoint at or below ``below`` that every rank verifies (None: there is none); the
    reasons this rank passed over newer ones are added to ``passed_over``."""
    skipped = [] if passed_over is None else passed_over
    bound = below
    while True:
        mine = store.newest_valid_id(at_most=bound, skipped=skipped)
        (packed,) = gang.agree_min([_NONE if mine is None else mine.packed])
        if packed == _NONE:
            return None
        candidate = CheckpointId.unpack(packed)
        verdict = store.verify(candidate)
        if not verdict.valid:
            skipped.append(f"{candidate.dir_name}: {verdict.reason}")
        (valid,) = gang.agree_min([int(verdict.valid)])
        if valid == 1:
            return candidate
        bound = _just_below(candidate)
        if bound is None:
            return None


class NewestRestorable:
    """The gang's search for the newest checkpoint every rank restores, driven by its caller, which
    restores each ``candidate`` itself and says how it went (``restored``): nothing here calls back.

    Every rank asks for the same candidates in the same order (each one agreed, ``agree_checkpoint``);
    when the content of one does not load on some rank, every rank moves on to the next older one.
    ``done`` says what was restored (None: a fresh start) and what was passed over on the way, with
    ``damaged`` (the same on every rank): whether any rank passed over anything, or found checkpoints
    but none valid."""

    def __init__(self, store: CheckpointStore, gang: Gang) -> None:
        self._store, self._gang = store, gang
        self._resumed = Resumed(None)
        self._bound: CheckpointId | None = None
        self._over = False

    def candidate(self) -> CheckpointId | None:
        """The next checkpoint to restore, the same on every rank; None: the search is over."""
        if self._over:
            return None
        checkpoint = agree_checkpoint(self._store, self._gang, self._bound, self._resumed.passed_over)
        if checkpoint is None:
            self._over = True
            if self._store.steps():
                self._resumed.passed_over.append("checkpoints exist but none is valid")
                log.error(
                    "checkpoints exist under %s but none is valid: starting from scratch; nothing there is "
                    "deleted in this run",
                    self._store.root,
                )
        return checkpoint

    def restored(self, checkpoint: CheckpointId, ok: bool) -> bool:
        """This rank restored ``checkpoint`` (``ok``) or could not: whether every rank did (then the search
        is over, on it)."""
        if not ok:
            self._resumed.passed_over.append(f"{checkpoint.dir_name}: does not load (see above)")
        (restored,) = self._gang.agree_min([int(ok)])
        if restored == 1:
            self._resumed.checkpoint, self._over = checkpoint, True
            return True
        self._bound = _just_below(checkpoint)
        self._over = self._bound is None
        return False

    def done(self) -> Resumed:
        """What the search restored and passed over (one collective: every rank calls it once, at the end)."""
        (damaged,) = self._gang.agree_max([int(bool(self._resumed.passed_over))])
        self._resumed.damaged = damaged == 1
        return self._resumed


def _just_below(checkpoint: CheckpointId) -> CheckpointId | None:
    return CheckpointId.unpack(checkpoint.packed - 1) if checkpoint.packed > 0 else None

"""Which checkpoint a gang resumes from, and the epoch it writes under: agreed by every rank.

Every rank must restore the same checkpoint, or their weights differ from the first step on. Each rank
proposes the newest checkpoint it can verify (its own files and rank 0's), the gang takes the oldest
proposal, every rank verifies that one, and if any rank cannot, all step below it and try again. A
checkpoint that verifies but then fails to load on some rank (damaged in between, malformed content) is
skipped the same way. Without a process group this is simply the newest valid checkpoint.

Writers are fenced by epochs (``trainer_sidecar.checkpoint.fence``): rank 0 claims the next epoch of the
checkpoint directory before anything is resumed, and the gang adopts it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from trainer_sidecar.checkpoint import CheckpointError, CheckpointId, CheckpointStore, EpochOwner, claim_epoch
from trainer_sidecar.guardian.gang import Gang

log = logging.getLogger("trainguard")

_NONE = -1


def claim_gang_epoch(root: Path, gang: Gang, owner: EpochOwner) -> int:
    """Rank 0 claims the next epoch of the checkpoint directory; every rank returns it.

    A claim that fails on rank 0 is reported to every rank (as a CheckpointError), so no rank writes
    under an epoch the others do not share.
    """
    claimed, failure = _NONE, ""
    if gang.rank == 0:
        try:
            claimed = claim_epoch(root, owner).epoch
        except CheckpointError as exc:
            failure = str(exc)
    (epoch,) = gang.agree_max([claimed])
    if epoch == _NONE:
        raise CheckpointError(failure or f"rank 0 could not claim an epoch of {root}")
    return epoch


def agree_checkpoint(store: CheckpointStore, gang: Gang, below: CheckpointId | None) -> CheckpointId | None:
    """The newest checkpoint at or below ``below`` that every rank verifies (None: there is none)."""
    bound = below
    while True:
        mine = store.newest_valid_id(at_most=bound)
        (packed,) = gang.agree_min([_NONE if mine is None else mine.packed])
        if packed == _NONE:
            return None
        candidate = CheckpointId.unpack(packed)
        (valid,) = gang.agree_min([int(store.verify(candidate).valid)])
        if valid == 1:
            return candidate
        bound = _just_below(candidate)
        if bound is None:
            return None


def restore_newest(
    store: CheckpointStore, gang: Gang, restore: Callable[[CheckpointId], bool]
) -> CheckpointId | None:
    """Agree on a checkpoint and ``restore`` it on every rank; when ``restore`` returns False on any rank
    (its content does not load), every rank moves on to the next older one. Returns the checkpoint
    restored, or None for a fresh start."""
    bound: CheckpointId | None = None
    while True:
        checkpoint = agree_checkpoint(store, gang, bound)
        if checkpoint is None:
            if store.steps():
                log.error("checkpoints exist under %s but none is valid: starting from scratch", store.root)
            return None
        (restored,) = gang.agree_min([int(restore(checkpoint))])
        if restored == 1:
            return checkpoint
        bound = _just_below(checkpoint)
        if bound is None:
            return None


def _just_below(checkpoint: CheckpointId) -> CheckpointId | None:
    return CheckpointId.unpack(checkpoint.packed - 1) if checkpoint.packed > 0 else None

"""Fencing: one writer at a time in a checkpoint directory, however many believe they are the job.

Every writer (a gang of ranks: each start of a job's workers) holds an *epoch*. Rank 0 claims one with
``claim_epoch``: it creates ``epochs/epoch-<N>.json`` for N = the highest epoch + 1, atomically and only
if no one else did (a complete file is hard-linked into place, which fails if the name exists: atomic on
local disks and NFS alike), recording who claimed it and which checkpoints it *inherits*: the complete
ones the previous epoch trusted at that moment. The other ranks are told the epoch.

Checkpoints carry their epoch in their directory's name, so two epochs never write the same path. A
reader trusts a checkpoint only if the highest epoch wrote it or inherited it, so a checkpoint that a
fenced writer commits after the fence is never picked, whatever that writer believes. A writer checks
the fence before it creates a checkpoint's directory, right before it commits (renames its manifest
into place) and once more after: a writer whose epoch is no longer the highest has its save refused
with ``FencedError`` naming the epoch that fenced it, so a save reported successful was committed
before any newer claim.

A claim names its job as ``<namespace>/<name>`` (``job_identity``): what makes a job unique, on a cluster
and locally. Another job's claim is refused (``same_job``), also when only the namespace differs. A claim
written before namespaces were recorded names the job alone; it is accepted by a job of that name in any
namespace (the upgrade), whose own claim then records the namespace. The job's UID is not part of the
identity on purpose: a job deleted and re-applied under its name resumes from its checkpoints.

Old checkpoints without an epoch in their name are epoch 0; while no epoch was ever claimed, epoch 0
is the highest and a writer without an epoch writes as before.

Limits: a checkpoint that the old writer commits in the moment between the new claim's look at the
directory and its claim is not inherited (it is never trusted by mistake, at worst not used). On NFS a
fenced writer notices the fence when its client next revalidates the directory; readers do not depend
on that. Anyone who can write to the directory can claim an epoch, and so fence every writer out.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from trainer_sidecar.checkpoint import fs, writer
from trainer_sidecar.checkpoint.errors import CheckpointError
from trainer_sidecar.checkpoint.format import loads_strict
from trainer_sidecar.checkpoint.layout import (
    EPOCH_LIMIT,
    EPOCHS_DIR,
    CheckpointId,
    epoch_file_name,
    parse_dir_name,
    parse_epoch_file_name,
    scan_checkpoints,
)
from trainer_sidecar.checkpoint.manifest import is_complete
from trainer_sidecar.contract.identity import same_job

_RECORD_LIMIT = 4 << 20  # bytes of one claim: tens of thousands of inherited names
_CLAIM_TRIES = 1000


class FencedError(CheckpointError):
    """A newer epoch has claimed the checkpoint directory: this writer's saves are refused, for good."""

    def __init__(self, message: str, *, epoch: int, newer: EpochRecord | None) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.newer = newer


def _checkpoint_name(name: str) -> str:
    if parse_dir_name(name) is None:
        raise ValueError(f"not a checkpoint directory name: {name!r}")
    return name


class EpochOwner(BaseModel):
    """Who claimed an epoch: the job (``job_identity``: namespace/name), its attempt, the host and
    process, and when."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    job: str = ""
    attempt: int = 0
    host: str = Field(default_factory=socket.gethostname)
    pid: int = Field(default_factory=os.getpid)
    time: float = Field(default_factory=time.time, allow_inf_nan=False)

    def describe(self) -> str:
        """One line naming the owner, for messages."""
        job = f"job {self.job} attempt {self.attempt}, " if self.job else ""
        claimed = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.time))
        return f"{job}pid {self.pid} on {self.host}, claimed {claimed}"


class EpochRecord(BaseModel):
    """The claim of one epoch: its number, its owner and the checkpoints it inherited as trusted."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    epoch: int = Field(ge=1, lt=EPOCH_LIMIT)
    owner: EpochOwner
    inherits: list[Annotated[str, AfterValidator(_checkpoint_name)]] = Field(default_factory=list)


@dataclass(frozen=True)
class Fence:
    """What a checkpoint directory says about its writers: the highest epoch and that epoch's claim.

    ``record`` is None when no epoch was ever claimed (``highest`` 0) or the highest claim is unreadable.
    An unreadable claim (empty or cut short by a crash or a full disk on a volume without hard links,
    garbage, or a directory or link where the file should be) never erases the history: the fence falls
    back to the newest readable claim below it (``fallback``; None when there is none) and trusts what
    that claim trusted, plus every checkpoint written by it or by an epoch it passed over
    (``passed_over``, newest first), up to the highest.
    """

    highest: int
    record: EpochRecord | None
    _inherited: frozenset[str] = field(default=frozenset(), repr=False)
    passed_over: tuple[int, ...] = ()
    fallback: EpochRecord | None = None

    @property
    def _lowest_own(self) -> int:
        """The lowest epoch whose own checkpoints are trusted."""
        if not self.passed_over:
            return self.highest
        return self.fallback.epoch if self.fallback is not None else 0

    def trusts(self, checkpoint: CheckpointId) -> bool:
        """Whether a reader may use ``checkpoint``: written by the highest epoch (or, past unreadable
        claims, by the epochs down to the newest readable one) or inherited by it."""
        return self._lowest_own <= checkpoint.epoch <= self.highest or checkpoint.dir_name in self._inherited

    @property
    def owner(self) -> EpochOwner | None:
        """Who claimed the highest readable claim (the highest, or the one fallen back to)."""
        claim = self.record if self.record is not None else self.fallback
        return claim.owner if claim is not None else None

    def describe(self) -> str:
        """The highest epoch and its owner, for messages."""
        if self.record is None:
            return f"epoch {self.highest}" + ("" if self.highest else " (no epoch claimed)")
        return f"epoch {self.highest} ({self.record.owner.describe()})"

    def damage(self, where: Path | str) -> str | None:
        """What was passed over to keep the history (None when every claim read was whole), for messages."""
        if not self.passed_over:
            return None
        names = ", ".join(epoch_file_name(epoch) for epoch in self.passed_over)
        base = (
            f"the newest readable claim, epoch {self.fallback.epoch}"
            if self.fallback is not None
            else "no readable claim"
        )
        return (
            f"checkpoint directory {where}: unreadable epoch claims passed over ({names}: empty, cut short "
            f"by a crash or a full disk, or not a file); trusting what {base} trusted and the checkpoints of "
            f"epochs {self._lowest_own} to {self.highest}"
        )


def _claims(epochs_fd: int) -> list[int]:
    """Every claimed epoch: any entry with a claim's name counts, a directory or a link too (it is an
    unreadable claim, and the next claim must not try to take its number)."""
    found = (parse_epoch_file_name(name) for name, _ in fs.entries(epochs_fd))
    return sorted(epoch for epoch in found if epoch is not None)


def _read_record(epochs_fd: int, epoch: int, where: str) -> EpochRecord | None:
    path = f"{where}/{epoch_file_name(epoch)}"
    try:
        raw = fs.read_small(epochs_fd, epoch_file_name(epoch), _RECORD_LIMIT, path)
        record = EpochRecord.model_validate(loads_strict(raw.decode("utf-8")))
    except (CheckpointError, OSError, ValueError, RecursionError, ValidationError):
        return None
    return record if record.epoch == epoch else None


def read_fence(root_fd: int, root: Path, *, with_record: bool = True) -> Fence:
    """The fence of the checkpoint directory open at ``root_fd`` (``root``: its path, for messages)."""
    where = f"{root}/{EPOCHS_DIR}"
    if fs.kind(root_fd, EPOCHS_DIR) is None:
        return Fence(0, None)
    with fs.open_dir(root_fd, EPOCHS_DIR, where) as epochs_fd:  # a link or a file here: CheckpointError
        claims = _claims(epochs_fd)
        if not claims:
            return Fence(0, None)
        if not with_record:
            return Fence(claims[-1], None)
        passed_over: list[int] = []
        fallback = None
        for epoch in reversed(claims):
            fallback = _read_record(epochs_fd, epoch, where)
            if fallback is not None:
                break
            passed_over.append(epoch)
    inherited = frozenset(fallback.inherits) if fallback is not None else frozenset()
    if not passed_over:
        return Fence(claims[-1], fallback, inherited)
    return Fence(claims[-1], None, inherited, tuple(passed_over), fallback)


def check_fence(root_fd: int, root: Path, epoch: int) -> None:
    """Raise FencedError unless ``epoch`` is the highest epoch of the directory."""
    fence = read_fence(root_fd, root, with_record=False)
    if fence.highest == epoch:
        return
    fence = read_fence(root_fd, root)
    if fence.highest < epoch:
        message = (
            f"checkpoint directory {root}: epoch {epoch} was never claimed (the highest is {fence.highest})"
        )
    else:
        message = (
            f"checkpoint directory {root} is fenced: {fence.describe()} superseded this writer's epoch"
            f" {epoch}; its checkpoints are refused (is another attempt of the job, or another job,"
            " writing here?)"
        )
    raise FencedError(message, epoch=epoch, newer=fence.record)


def _inheritance(root_fd: int, root: Path, fence: Fence) -> list[str]:
    """The complete checkpoints ``fence`` trusts now: what the next epoch inherits."""
    return [
        checkpoint.dir_name
        for checkpoint in scan_checkpoints(root_fd)
        if fence.trusts(checkpoint) and is_complete(root_fd, checkpoint, f"{root}/{checkpoint.dir_name}")
    ]


def _publish_claim(epochs_fd: int, name: str, payload: bytes) -> bool:
    """Make ``name`` exist with ``payload``, atomically and only if it does not exist yet; False if it did.

    A complete temp file is hard-linked to the name (linkat fails if the name exists). On a file system
    without hard links the name is created exclusively and written in place instead: a reader that
    sees it half-written treats the claim as unreadable (it trusts that epoch's own checkpoints only).
    """
    fd, tmp = fs.create_temp(epochs_fd, name)
    try:
        try:
            writer.write_all(fd, [memoryview(payload)])
            os.fsync(fd)
            try:
                os.link(tmp, name, src_dir_fd=epochs_fd, dst_dir_fd=epochs_fd)
            except FileExistsError:
                return os.fstat(fd).st_nlink >= 2  # a lost reply on NFS can report EEXIST for our own link
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                    raise
                return _create_claim(epochs_fd, name, payload)
        finally:
            os.close(fd)
    finally:
        fs.unlink(epochs_fd, tmp)
    return True


def _create_claim(epochs_fd: int, name: str, payload: bytes) -> bool:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, 0o666, dir_fd=epochs_fd)
    except FileExistsError:
        return False
    try:
        writer.write_all(fd, [memoryview(payload)])
        os.fsync(fd)
    except BaseException:
        fs.unlink(epochs_fd, name)  # ours (created exclusively): never leave a claim cut short behind
        raise
    finally:
        os.close(fd)
    return True


@dataclass(frozen=True)
class Claim:
    """An epoch claimed, and the fence it was claimed over (its ``damage`` says what was passed over)."""

    record: EpochRecord
    over: Fence


def _try_claim(root_fd: int, epochs_fd: int, root: Path, owner: EpochOwner) -> Claim | None:
    """One attempt at claiming the epoch after the highest; None if another claimer took that number."""
    fence = read_fence(root_fd, root)
    holder = fence.owner.job if fence.owner is not None else ""
    if not same_job(holder, owner.job):
        raise CheckpointError(
            f"checkpoint directory {root} belongs to job {holder} ({fence.describe()}), not to job "
            f"{owner.job}: claiming it would fence that job out and resume from its checkpoints. Give "
            "each job a checkpoint claim of its own (a job of the same namespace and name resumes from it)"
        )
    if fence.highest + 1 >= EPOCH_LIMIT:
        raise CheckpointError(
            f"checkpoint directory {root}: epoch {fence.highest} is claimed, the last of the"
            f" {EPOCH_LIMIT - 1} epochs a directory can have"
            f" ({root}/{EPOCHS_DIR}/{epoch_file_name(fence.highest)}): nothing was claimed; move the"
            " checkpoints to a new directory to go on"
        )
    record = EpochRecord(epoch=fence.highest + 1, owner=owner, inherits=_inheritance(root_fd, root, fence))
    payload = record.model_dump_json(indent=1).encode()
    if not _publish_claim(epochs_fd, epoch_file_name(record.epoch), payload):
        return None
    fs.fsync(epochs_fd)
    return Claim(record, fence)


def claim_next_epoch(root: Path, owner: EpochOwner | None = None) -> Claim:
    """Claim the next epoch of the checkpoint directory ``root`` (created if missing) for a new writer.

    Fences every older epoch out: from now on their saves fail with FencedError and readers trust only
    this epoch's checkpoints and those it inherits (the complete ones trusted until now; past an
    unreadable claim, those the fence falls back to: see ``Fence``). Concurrent claims get distinct
    epochs. Only rank 0 of a gang claims; the others are given the epoch. Raises CheckpointError naming
    the directory, with nothing claimed, when the directory cannot be written (read-only, full), its
    epochs are used up, or its highest epoch another job claimed (both owners named): two jobs sharing
    one claim would fence each other out and resume from each other's weights. Jobs are told apart by
    namespace and name (``same_job``).
    """
    root = Path(root)
    owner = owner if owner is not None else EpochOwner()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with fs.open_root(root) as root_fd:
            fs.make_dir(root_fd, EPOCHS_DIR)
            with fs.open_dir(root_fd, EPOCHS_DIR, f"{root}/{EPOCHS_DIR}") as epochs_fd:
                for _ in range(_CLAIM_TRIES):
                    claim = _try_claim(root_fd, epochs_fd, root, owner)
                    if claim is not None:
                        return claim
    except OSError as exc:
        raise CheckpointError(f"checkpoint directory {root}: no epoch claimed: {exc}") from exc
    raise CheckpointError(f"checkpoint directory {root}: no epoch claimed in {_CLAIM_TRIES} tries")


def claim_epoch(root: Path, owner: EpochOwner | None = None) -> EpochRecord:
    """The record of ``claim_next_epoch`` (see there)."""
    return claim_next_epoch(root, owner).record

"""The clean-checkpoint store on the shared volume: layout, completeness, verification, loading, pruning.

Layout under the checkpoint directory (see ``layout``)::

    epochs/epoch-000003.json          who claimed epoch 3, and what it inherited (see ``fence``)
    step-0000002000-e000003/          the checkpoint of step 2000, written under epoch 3
        rank-0.safetensors            model, optimizer, scheduler, scaler, guardian counters, RNG, data
        rank-0.json                   manifest: step, epoch, time, world size, each file's size and SHA-256
        rank-1.safetensors            (other ranks) RNG and data position only; the model is replicated
        rank-1.json

A checkpoint is identified by (step, epoch) (``CheckpointId``). It is *trusted* when the directory's
highest epoch wrote or inherited it, *complete* when every rank's manifest exists, and *valid* for a rank
when it is trusted and complete and the files that rank loads (rank 0's and its own) match their
manifests: size, SHA-256, and a data file whose header and layout parse. Every file is written as temp
file, fsync, rename, directory fsync; the manifest last, so a manifest never describes a half-written
file. Only trusted complete checkpoints count towards ``keep_clean``; the newest is never deleted, and
nothing is overwritten: a checkpoint that already holds a valid file of this rank is not written again.

The directory is not trusted (see ``fs``): nothing under it is followed through a link, manifests are
validated strictly (see ``manifest``), and a defect of any kind makes a checkpoint invalid with a reason,
so that ``verify`` and ``newest_valid`` fall back to an older one rather than raise.

Checkpoints of older formats (1: ``torch.save``; 2: trainguard's own raw format) are reported as an
unknown format and skipped, never loaded.

A save copies the state into reusable host buffers (``save_async``: the only part the training loop
waits for); then a writer thread writes the file (see ``writer``), then the manifest. Rank 0's pruning
of old checkpoints runs afterwards in a janitor thread, so ``wait`` returns as soon as the new
checkpoint is durable.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from trainer_sidecar.checkpoint import fs, writer
from trainer_sidecar.checkpoint.errors import CheckpointError
from trainer_sidecar.checkpoint.fence import Fence, FencedError, check_fence, read_fence
from trainer_sidecar.checkpoint.format import Serialized, read_layout, serialize
from trainer_sidecar.checkpoint.layout import (
    EPOCH_LIMIT,
    CheckpointId,
    data_file_name,
    manifest_name,
    scan_checkpoints,
)
from trainer_sidecar.checkpoint.manifest import (
    FileEntry,
    Manifest,
    is_complete,
    manifest_bytes,
    new_manifest,
    published,
    read_manifest,
)
from trainer_sidecar.checkpoint.shards import open_reader
from trainer_sidecar.contract.status import CheckpointRef
from trainer_sidecar.tensors.sharding import Box, box_of, is_sharded, read_all
from trainer_sidecar.tensors.tensorstate import HostBuffers, PendingCopy, flatten

log = logging.getLogger(__name__)

Target = int | CheckpointId
"""A checkpoint: by identity, or by step (then the trusted one of that step with the highest epoch)."""


@dataclass(frozen=True)
class Verdict:
    """Whether one checkpoint can be loaded by one rank, and if not, why."""

    step: int
    valid: bool
    reason: str = ""
    epoch: int = 0

    @property
    def checkpoint(self) -> CheckpointId:
        """The checkpoint judged."""
        return CheckpointId(self.step, self.epoch)


def _invalid(checkpoint: CheckpointId, reason: str) -> Verdict:
    return Verdict(checkpoint.step, False, reason, checkpoint.epoch)


def _writers(step_fd: int, checkpoint: CheckpointId, where: str) -> int:
    """How many ranks wrote a checkpoint: as rank 0's manifest says, or without a valid one (a load that
    did not verify first), as many as there are data files of consecutive ranks from 0."""
    try:
        return read_manifest(step_fd, checkpoint, 0, where).world_size
    except CheckpointError:
        count = 0
        while fs.kind(step_fd, data_file_name(count)) is not None:
            count += 1
        return max(1, count)


def files_to_verify(rank: int, world_size: int, written_by: int) -> list[int]:
    """The ranks whose files a rank of ``world_size`` checks in a checkpoint ``written_by`` ranks wrote:
    rank 0's and its own (the files it reads whole, or nearly), and its share of the rest (those whose
    rank is ``rank`` modulo ``world_size``), so that every file is checked by some rank of the gang."""
    mine = {0, *(r for r in range(written_by) if r % max(1, world_size) == rank)}
    if rank < written_by:
        mine.add(rank)
    return sorted(mine)


_PROBE = b"\0" * 4096  # a block: a full volume refuses it even where it still allows an empty file


def check_writable(root: Path, rank: int = 0) -> None:
    """Make sure this process can write into the checkpoint directory ``root`` (created if missing):
    a probe file of a block is created, written, fsynced and removed. Raises CheckpointError naming the
    directory when it cannot be created, is not a directory, is read-only or full; nothing else in it is
    touched."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"checkpoint directory {root} cannot be created: {exc}") from exc
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} is not a directory")
    with fs.open_root(root) as root_fd:
        probe = None
        try:
            fd, probe = fs.create_temp(root_fd, f"write-probe-{rank}")
            try:
                writer.write_all(fd, [memoryview(_PROBE)])
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise CheckpointError(f"checkpoint directory {root} is not writable: {exc}") from exc
        finally:
            if probe is not None:
                fs.unlink(root_fd, probe)


#: How many checkpoints waiting for rank 0's manifest a store remembers (older ones are superseded).
_AWAITING_LIMIT = 4


class CheckpointStore:
    """Writes, verifies, finds and prunes clean checkpoints for one rank of a job.

    ``epoch`` is the writer's epoch (see ``fence.claim_epoch``; None: epoch 0, a writer without one,
    fenced as soon as any epoch is claimed). A store only reading claims nothing and may leave it None.
    A save runs in a writer thread (with a hashing thread beside it when ``parallel_hash``; by default
    when this process may use more than one CPU). Rank 0 prunes old checkpoints in a janitor thread once
    a new one is durable, so ``wait`` does not include the deletion; ``close`` does.
    """

    def __init__(
        self,
        root: Path,
        *,
        rank: int = 0,
        world_size: int = 1,
        keep_clean: int = 3,
        parallel_hash: bool | None = None,
        epoch: int | None = None,
    ) -> None:
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.keep_clean = keep_clean
        self.epoch = 0 if epoch is None else epoch
        if not 0 <= self.epoch < EPOCH_LIMIT:
            raise CheckpointError(f"checkpoint epoch {epoch} out of range")
        self.parallel_hash = writer.default_parallel_hash() if parallel_hash is None else parallel_hash
        self._check_directory()
        self._buffers = HostBuffers()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-ckpt")
        self._janitor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-prune")
        self._inflight: Future[CheckpointRef | None] | None = None
        self._fenced: FencedError | None = None
        self._lock = threading.Lock()
        self._last_clean: CheckpointRef | None = None
        # Checkpoints this rank has written whose rank 0 manifest was not there yet (rank 0 still
        # writing): clean once it lands, which ``last_clean`` looks for. Newest last, a few at most.
        self._awaiting_rank0: list[CheckpointId] = []
        #: How long the last checkpoint written took from its start in the background to durable.
        self.last_write_seconds: float | None = None
        # Checkpoints being written and being deleted, so that pruning never removes one while written.
        self._dirs = threading.Condition()
        self._writing: set[CheckpointId] = set()
        self._deleting: set[CheckpointId] = set()
        self._prune_lock = threading.Lock()
        self._prune_queued = False
        self._prune_future: Future[None] | None = None
        self._prune_hold: str | None = None

    # -- start-up checks ------------------------------------------------------------------------------
    def _check_directory(self) -> None:
        check_writable(self.root, self.rank)

    @contextmanager
    def _root(self) -> Iterator[int]:
        with fs.open_root(self.root) as root_fd:
            yield root_fd

    def _where(self, checkpoint: CheckpointId) -> str:
        return str(self.root / checkpoint.dir_name)

    # -- saving ---------------------------------------------------------------------------------------
    def save_async(
        self, step: int, state: dict[str, Any], meta: dict[str, Any], *, stable: set[int] | None = None
    ) -> None:
        """Capture ``state`` into host memory and write it in the background, as (step, this epoch).

        The caller waits for the copy of what may change under it (and for a previous save still in
        flight, whose buffers this one reuses: a second save never corrupts the first). The tensors whose
        storage is in ``stable`` (``data_ptr`` of parameters and optimizer state) are copied in the
        background too: the caller must ``settle`` before they change. A DTensor is written as this
        rank's shard, with its place in the global tensor. Errors, including a state holding values a
        checkpoint cannot store, surface on the next ``wait`` as CheckpointError; once a save found this
        store fenced (FencedError), every later ``save_async`` raises that error at once.
        """
        self.wait()
        if self._fenced is not None:
            raise self._fenced
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"checkpoint step must be a non-negative integer, not {step!r}")
        skeleton, tensors = flatten(state)
        boxes = [box_of(t) if is_sharded(t) else None for t in tensors]
        copy = self._buffers.capture(tensors, stable)
        checkpoint = CheckpointId(step, self.epoch)
        self._inflight = self._executor.submit(
            self._write, checkpoint, skeleton, self._buffers.tensors, boxes, copy, dict(meta)
        )

    def settle(self) -> bool:
        """Order the background copy of the last save before any change of its stable tensors (see
        ``tensorstate.PendingCopy.settle``). Returns True when they had already changed in place: that
        save is then not written unless its copy had landed first (``PendingCopy.landed_whole``)."""
        return self._buffers.pending.settle()

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> CheckpointRef | None:
        """Save and wait until the checkpoint is durable; returns the clean checkpoint written (or kept).

        Pruning may still be running afterwards (see ``wait_for_pruning``).
        """
        self.save_async(step, state, meta)
        return self.wait()

    def wait(self) -> CheckpointRef | None:
        """Block until the save in flight (if any) is durable; re-raise its error as CheckpointError
        (FencedError if a newer epoch fenced this store)."""
        future, self._inflight = self._inflight, None
        if future is None:
            return None
        try:
            return future.result()
        except FencedError as exc:
            self._fenced = exc
            raise
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"writing a checkpoint under {self.root} failed: {exc}") from exc

    def wait_for_pruning(self) -> None:
        """Block until the pruning scheduled by completed saves has run (errors are only logged).

        A save still in flight schedules its pruning when it completes: call ``wait`` first.
        """
        with self._dirs:
            future = self._prune_future
        if future is not None:
            future.result()

    @property
    def busy(self) -> bool:
        """Whether a background write is still running."""
        return self._inflight is not None and not self._inflight.done()

    @property
    def fenced(self) -> FencedError | None:
        """The error a save met when a newer epoch fenced this store (None while it has not); also seen
        from a save that ended in the background and was not waited for. Never blocks."""
        future = self._inflight
        if self._fenced is None and future is not None and future.done():
            error = future.exception()
            if isinstance(error, FencedError):
                self._fenced = error
        return self._fenced

    def check_fence(self) -> None:
        """Raise FencedError if this store's epoch is no longer the directory's highest."""
        with self._root() as root_fd:
            check_fence(root_fd, self.root, self.epoch)

    def _write(
        self,
        checkpoint: CheckpointId,
        skeleton: Any,
        tensors: list[torch.Tensor],
        boxes: list[Box | None],
        copy: PendingCopy,
        meta: dict[str, Any],
    ) -> CheckpointRef | None:
        if not copy.landed_whole():
            log.warning(
                "%s not written: parameters or optimizer state changed in place before the copy of them "
                "was settled, so it may hold part of the change",
                self._where(checkpoint),
            )
            return None
        with self._dirs:
            self._writing.add(checkpoint)
            self._dirs.wait_for(lambda: checkpoint not in self._deleting)
        started = time.monotonic()
        try:
            ref, written = self._write_checkpoint(checkpoint, skeleton, tensors, boxes, meta)
        finally:
            with self._dirs:
                self._writing.discard(checkpoint)
        if written:
            self.last_write_seconds = time.monotonic() - started
        if written and self.rank == 0:
            self._schedule_prune()  # once the checkpoint is no longer registered as being written
        return ref

    def _write_checkpoint(
        self,
        checkpoint: CheckpointId,
        skeleton: Any,
        tensors: list[torch.Tensor],
        boxes: list[Box | None],
        meta: dict[str, Any],
    ) -> tuple[CheckpointRef | None, bool]:
        """Write this rank's files unless they are there and valid: (its reference, whether written)."""
        where = self._where(checkpoint)
        data_path = f"{where}/{data_file_name(self.rank)}"
        try:
            serialized = serialize(skeleton, tensors, boxes)
        except CheckpointError as exc:
            raise CheckpointError(f"{data_path} not written: {exc}") from exc
        with self._root() as root_fd:
            check_fence(root_fd, self.root, self.epoch)  # before creating the checkpoint's directory
            with self._step_dir(root_fd, checkpoint) as step_fd:
                if self._kept(step_fd, checkpoint):
                    return self._record_clean(checkpoint), False
                sha256 = writer.write_file(
                    step_fd, data_file_name(self.rank), serialized, parallel_hash=self.parallel_hash
                )
                manifest = self._manifest(checkpoint, serialized, sha256, meta, data_path)
                check_fence(root_fd, self.root, self.epoch)  # right before the commit
                writer.write_small(step_fd, manifest_name(self.rank), manifest_bytes(manifest))
            # Reported as written only if no newer epoch was claimed by the time the commit landed.
            check_fence(root_fd, self.root, self.epoch)
        return self._record_clean(checkpoint), True

    def _manifest(
        self,
        checkpoint: CheckpointId,
        serialized: Serialized,
        sha256: str,
        meta: dict[str, Any],
        data_path: str,
    ) -> Manifest:
        files = {data_file_name(self.rank): FileEntry(size=serialized.size, sha256=sha256)}
        try:
            return new_manifest(checkpoint, self.rank, self.world_size, time.time(), files, meta)
        except CheckpointError as exc:
            raise CheckpointError(f"{data_path}: manifest not written: {exc}") from exc

    @contextmanager
    def _step_dir(self, root_fd: int, checkpoint: CheckpointId) -> Iterator[int]:
        """The checkpoint's directory, created if missing; whatever else holds its name (a planted link,
        a file) is moved aside, loudly, never followed."""
        name, where = checkpoint.dir_name, self._where(checkpoint)
        for _ in range(3):
            fs.make_dir(root_fd, name)
            kind = fs.kind(root_fd, name)
            if kind == "dir":
                with fs.open_dir(root_fd, name, where) as step_fd:
                    yield step_fd
                return
            if kind is not None:
                aside = fs.move_aside(root_fd, name, f"{kind}-aside")
                log.error("%s was a %s, not a directory: moved aside to %s, not followed", where, kind, aside)
        raise CheckpointError(f"{where}: keeps being replaced by something other than a directory")

    def _kept(self, step_fd: int, checkpoint: CheckpointId) -> bool:
        """Whether this rank's files of ``checkpoint`` are there and valid (then they are kept as they
        are); broken ones are moved aside, byte for byte, to be written anew."""
        if fs.kind(step_fd, manifest_name(self.rank)) is None:
            return False
        where = self._where(checkpoint)
        reason = self._rank_defect(step_fd, checkpoint, self.rank, where)
        if reason is None:
            log.info("checkpoint %s already holds a valid rank-%d file; not overwritten", where, self.rank)
            return True
        log.warning("checkpoint %s is invalid (%s); moving it aside and writing anew", where, reason)
        stamp = int(time.time())
        for name in (data_file_name(self.rank), manifest_name(self.rank)):
            if fs.kind(step_fd, name) is not None:
                fs.rename(step_fd, name, f"{name}.corrupt-{stamp}")
        return False

    def _record_clean(self, checkpoint: CheckpointId) -> CheckpointRef | None:
        ref = self.reference(checkpoint)
        with self._lock:
            if ref is None:
                if self._last_clean is None or checkpoint.step > self._last_clean.step:
                    self._awaiting_rank0 = [*self._awaiting_rank0, checkpoint][-_AWAITING_LIMIT:]
            else:
                self._note_clean(ref)
        return ref

    def _note_clean(self, ref: CheckpointRef) -> None:
        """Under ``_lock``: ``ref`` is clean; it is the newest known unless a newer one is."""
        if self._last_clean is None or ref.step >= self._last_clean.step:
            self._last_clean = ref
        self._awaiting_rank0 = [c for c in self._awaiting_rank0 if c.step > ref.step]

    @property
    def last_clean(self) -> CheckpointRef | None:
        """The newest checkpoint this rank wrote or read that is clean (rank 0's manifest there too).

        A checkpoint this rank finished before rank 0 did becomes clean when rank 0's manifest lands:
        each call looks again for the few such checkpoints, newest first, so that every rank's status
        ends up naming the same newest checkpoint, not only the rank that finished last.
        """
        with self._lock:
            awaiting = list(self._awaiting_rank0)
        for checkpoint in reversed(awaiting):
            ref = self.reference(checkpoint)
            if ref is not None:
                with self._lock:
                    self._note_clean(ref)
                break
        with self._lock:
            return self._last_clean

    # -- reading --------------------------------------------------------------------------------------
    def fence(self) -> Fence:
        """The directory's fence now: the highest epoch, its owner and what it inherited."""
        with self._root() as root_fd:
            return read_fence(root_fd, self.root)

    def ids(self) -> list[CheckpointId]:
        """Every checkpoint directory (trusted or not, complete or not), oldest first."""
        with self._root() as root_fd:
            return scan_checkpoints(root_fd)

    def trusted_ids(self) -> list[CheckpointId]:
        """The checkpoints a reader may use (the highest epoch's and those it inherited), oldest first."""
        with self._root() as root_fd:
            return self._trusted(root_fd)

    def _trusted(self, root_fd: int) -> list[CheckpointId]:
        try:
            fence = read_fence(root_fd, self.root)
        except CheckpointError as exc:
            log.error("no checkpoint is trusted: %s", exc)
            return []
        return [checkpoint for checkpoint in scan_checkpoints(root_fd) if fence.trusts(checkpoint)]

    def steps(self) -> list[int]:
        """Steps that have a checkpoint directory (any epoch, complete or not), oldest first."""
        return sorted({checkpoint.step for checkpoint in self.ids()})

    def resolve(self, target: Target) -> CheckpointId | None:
        """``target`` as an identity: a step means the trusted checkpoint of that step with the highest
        epoch (None if there is none)."""
        if isinstance(target, CheckpointId):
            return target
        matches = [checkpoint for checkpoint in self.trusted_ids() if checkpoint.step == target]
        return matches[-1] if matches else None

    def is_complete(self, target: Target) -> bool:
        """Every rank of the writing job has published its manifest (no hashing: cheap)."""
        checkpoint = self.resolve(target)
        if checkpoint is None:
            return False
        with self._root() as root_fd:
            return is_complete(root_fd, checkpoint, self._where(checkpoint))

    def _rank_defect(self, step_fd: int, checkpoint: CheckpointId, rank: int, where: str) -> str | None:
        """Why rank ``rank``'s files of ``checkpoint`` cannot be loaded, or None if they can."""
        try:
            manifest = read_manifest(step_fd, checkpoint, rank, where)
            for name, entry in manifest.files.items():
                path = f"{where}/{name}"
                fd, size = fs.open_regular(step_fd, name, path)
                try:
                    if size != entry.size:
                        return f"{path}: truncated ({size} bytes, manifest says {entry.size})"
                    if fs.sha256_fd(fd, entry.size, path) != entry.sha256:
                        return f"{path}: SHA-256 does not match the manifest (corrupted)"
                    if name == data_file_name(rank):
                        read_layout(fd, path)  # cheap: the header, and that the tensors tile the data
                finally:
                    os.close(fd)
        except CheckpointError as exc:
            return str(exc)
        except OSError as exc:
            return f"{where}: {exc}"
        return None

    def verify(self, target: Target) -> Verdict:
        """Check this rank's share of a checkpoint: trusted, complete, and sizes, layout and SHA-256 as
        manifested of rank 0's files, this rank's own, and of every file whose rank is this rank's modulo
        this store's world size (``files_to_verify``): over a gang every file is checked by some rank,
        which is what a rank reading shards from other ranks' files relies on (the gang agrees on the
        verdicts, see ``resume``). A store of one rank checks every file. Never raises: every defect is an
        invalid verdict with a reason naming the file.
        """
        checkpoint = self.resolve(target)
        if checkpoint is None:
            assert isinstance(target, int)  # an identity resolves to itself
            return Verdict(target, False, f"{self.root}: no trusted checkpoint of step {target}")
        where = self._where(checkpoint)
        try:
            with self._root() as root_fd:
                fence = read_fence(root_fd, self.root)
                if not fence.trusts(checkpoint):
                    return _invalid(checkpoint, f"{where}: not trusted: written by epoch {checkpoint.epoch}, "
                                    f"neither {fence.describe()} nor inherited by it")  # fmt: skip
                with fs.open_dir(root_fd, checkpoint.dir_name, where) as step_fd:
                    return self._verify_files(step_fd, checkpoint, where)
        except (CheckpointError, OSError) as exc:
            return _invalid(checkpoint, str(exc))

    def _verify_files(self, step_fd: int, checkpoint: CheckpointId, where: str) -> Verdict:
        try:
            first = read_manifest(step_fd, checkpoint, 0, where)
        except CheckpointError as exc:
            return _invalid(checkpoint, str(exc))
        if not published(step_fd, first.world_size):
            return _invalid(checkpoint, f"{where}: incomplete (a rank's manifest is missing)")
        for rank in files_to_verify(self.rank, self.world_size, first.world_size):
            reason = self._rank_defect(step_fd, checkpoint, rank, where)
            if reason is not None:
                return _invalid(checkpoint, reason)
        return Verdict(checkpoint.step, True, epoch=checkpoint.epoch)

    def newest_valid_id(
        self, at_most: CheckpointId | None = None, skipped: list[str] | None = None
    ) -> CheckpointId | None:
        """The newest trusted checkpoint at or below ``at_most`` this rank can load; logs why newer ones
        were skipped (and adds each to ``skipped``). Never raises."""
        for checkpoint in reversed(self.trusted_ids()):
            if at_most is not None and checkpoint > at_most:
                continue
            verdict = self.verify(checkpoint)
            if verdict.valid:
                return checkpoint
            log.warning("skipping checkpoint at %s: %s", checkpoint, verdict.reason)
            if skipped is not None:
                skipped.append(f"{checkpoint.dir_name}: {verdict.reason}")
        return None

    def newest_valid(self, at_most: int | None = None) -> int | None:
        """The step of ``newest_valid_id`` (a step bound: any epoch of that step or below)."""
        bound = None if at_most is None else CheckpointId(at_most, EPOCH_LIMIT - 1)
        found = self.newest_valid_id(bound)
        return None if found is None else found.step

    def load(self, target: Target) -> dict[str, Any]:
        """Load this rank's view of a checkpoint, every tensor read whole (see ``open``): rank 0's state,
        a sharded model's tensors assembled from every rank's shards, and this rank's own state."""
        with self.open(target) as state:
            return dict(read_all(state))

    @contextmanager
    def open(self, target: Target) -> Iterator[dict[str, Any]]:
        """This rank's view of a checkpoint, its tensors not read yet (``shards.SavedTensor``: read any box
        of them inside the block; the files close on leaving): rank 0's state, each sharded tensor
        by its global shape, and this rank's own generators, data position and tracked state (see
        ``shards``). The files are parsed as data only (see ``format``): a file on a shared volume can
        never run code here; one that is not a well-formed checkpoint raises CheckpointError naming it.
        """
        checkpoint = self.resolve(target)
        if checkpoint is None:
            raise CheckpointError(f"{self.root}: no trusted checkpoint of step {target}")
        where = self._where(checkpoint)
        with (
            self._root() as root_fd,
            fs.open_dir(root_fd, checkpoint.dir_name, where) as step_fd,
            open_reader(step_fd, where, _writers(step_fd, checkpoint, where)) as reader,
        ):
            yield reader.state(self.rank)
        self._record_clean(checkpoint)

    def reference(self, target: Target) -> CheckpointRef | None:
        """The checkpoint as rank 0's manifest describes it (None without a valid manifest)."""
        checkpoint = self.resolve(target)
        if checkpoint is None:
            return None
        where = self._where(checkpoint)
        try:
            with self._root() as root_fd, fs.open_dir(root_fd, checkpoint.dir_name, where) as step_fd:
                manifest = read_manifest(step_fd, checkpoint, 0, where)
        except (CheckpointError, OSError):
            return None
        entry = manifest.files[data_file_name(0)]
        try:
            return CheckpointRef(step=checkpoint.step, path=where, sha256=entry.sha256, time=manifest.time)
        except ValidationError:  # the status contract is stricter than a manifest needs to be
            return None

    # -- retention ------------------------------------------------------------------------------------
    def hold_pruning(self, reason: str) -> None:
        """Never prune again with this store: its start found damage (``reason``), so what looks old or
        untrusted may be the history a human needs. The next start, finding none, prunes as usual."""
        with self._prune_lock:
            self._prune_hold = reason
        log.warning("checkpoints under %s are not pruned in this run: %s", self.root, reason)

    def prune(self) -> list[CheckpointId]:
        """Delete checkpoints beyond the newest ``keep_clean`` trusted complete ones; returns those deleted.

        Everything older than the oldest kept goes (untrusted and incomplete ones too); newer incomplete
        ones stay (another rank may still be writing them), and never one this store is writing. A store
        whose epoch is fenced, or whose pruning is held (``hold_pruning``), prunes nothing. Rank 0 runs
        this in the background after each save.
        """
        with self._prune_lock, self._root() as root_fd:
            if self._prune_hold is not None:
                return []
            fence = read_fence(root_fd, self.root)
            if fence.highest != self.epoch:
                log.warning(
                    "not pruning %s: epoch %d is fenced by %s", self.root, self.epoch, fence.describe()
                )
                return []
            every = scan_checkpoints(root_fd)
            complete = [c for c in every if fence.trusts(c) and is_complete(root_fd, c, self._where(c))]
            if not complete:
                return []
            kept = complete[-self.keep_clean :]
            deleted = [c for c in every if c < kept[0] and self._delete(root_fd, c)]
            if deleted:
                log.info(
                    "pruned checkpoints %s (keeping %s)", [str(c) for c in deleted], [str(c) for c in kept]
                )
            return deleted

    def _delete(self, root_fd: int, checkpoint: CheckpointId) -> bool:
        with self._dirs:
            if checkpoint in self._writing:
                return False
            self._deleting.add(checkpoint)
        try:
            fs.remove_tree(root_fd, checkpoint.dir_name)
        finally:
            with self._dirs:
                self._deleting.discard(checkpoint)
                self._dirs.notify_all()
        return True

    def _schedule_prune(self) -> None:
        with self._dirs:
            if self._prune_queued:
                return  # the one queued has not started yet: it will see this checkpoint
            self._prune_queued = True
            self._prune_future = self._janitor.submit(self._prune_in_background)

    def _prune_in_background(self) -> None:
        with self._dirs:
            self._prune_queued = False
        try:
            self.prune()
        except Exception:
            log.exception("pruning old checkpoints under %s failed (retried after the next save)", self.root)

    def close(self) -> None:
        """Finish the write in flight and the pruning after it, and stop the background threads."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._janitor.shutdown(wait=True)

"""The clean-checkpoint store on the shared volume.

Layout under the checkpoint directory::

    step-0000002000/
        rank-0.pt        model, optimizer, scheduler, scaler, guardian counters, RNG and data position
        rank-0.json      manifest: step, time, world size, and each file's size and SHA-256
        rank-1.pt        (other ranks) RNG and data position only; the model is replicated under DDP
        rank-1.json

A checkpoint is *complete* when every rank's manifest exists, and *valid* for a rank when the files
that rank loads (rank 0's and its own) match their manifests. Every file is written as temp file,
fsync, rename, directory fsync; the manifest last, so a manifest never describes a half-written file.
Only complete checkpoints count towards ``keep_clean``; the newest complete one is never deleted, and
nothing is ever overwritten: a step that already has a valid checkpoint is not written again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from trainer_sidecar.status import CheckpointRef
from trainer_sidecar.tensorstate import HostBuffers, flatten, unflatten

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_STEP_PREFIX = "step-"
_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """The checkpoint directory or a checkpoint in it cannot be used; the message names the path."""


@dataclass(frozen=True)
class Verdict:
    """Whether one checkpoint can be loaded by one rank, and if not, why."""

    step: int
    valid: bool
    reason: str = ""


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint at ``step`` (zero-padded so names sort by step)."""
    return f"{_STEP_PREFIX}{step:010d}"


def fsync_dir(path: Path) -> None:
    """Make a rename or creation inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.size += view.nbytes
        return self._handle.write(view)

    def flush(self) -> None:
        self._handle.flush()


def _atomic_write_bytes(path: Path, payload: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in large chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class CheckpointStore:
    """Writes, verifies, finds and prunes clean checkpoints for one rank of a job."""

    def __init__(self, root: Path, *, rank: int = 0, world_size: int = 1, keep_clean: int = 3) -> None:
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.keep_clean = keep_clean
        self._check_directory()
        self._buffers = HostBuffers()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-ckpt")
        self._inflight: Future[CheckpointRef | None] | None = None
        self._lock = threading.Lock()
        self.last_clean: CheckpointRef | None = None

    # -- start-up checks ------------------------------------------------------------------------------
    def _check_directory(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"checkpoint directory {self.root} cannot be created: {exc}") from exc
        if not self.root.is_dir():
            raise CheckpointError(f"checkpoint directory {self.root} is not a directory")
        probe = self.root / f".write-probe-{os.getpid()}-{self.rank}"
        try:
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise CheckpointError(f"checkpoint directory {self.root} is not writable: {exc}") from exc

    # -- saving ---------------------------------------------------------------------------------------
    def save_async(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Capture ``state`` into host memory now and write it in the background.

        The caller waits only for the copy (and for a previous save still in flight, whose buffers this
        one reuses: a second save never corrupts the first). Errors surface on the next ``wait``.
        """
        self.wait()
        skeleton, tensors = flatten(state)
        self._buffers.capture(tensors)
        payload = unflatten(skeleton, self._buffers.tensors)
        self._inflight = self._executor.submit(self._write, step, payload, dict(meta))

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> CheckpointRef | None:
        """Save and wait for the write to complete; returns the clean checkpoint written (or kept)."""
        self.save_async(step, state, meta)
        return self.wait()

    def wait(self) -> CheckpointRef | None:
        """Block until the save in flight (if any) is durable; re-raise its error as CheckpointError."""
        future, self._inflight = self._inflight, None
        if future is None:
            return None
        try:
            return future.result()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"writing a checkpoint under {self.root} failed: {exc}") from exc

    @property
    def busy(self) -> bool:
        """Whether a background write is still running."""
        return self._inflight is not None and not self._inflight.done()

    def _write(self, step: int, payload: dict[str, Any], meta: dict[str, Any]) -> CheckpointRef | None:
        directory = self.root / step_dir_name(step)
        directory.mkdir(exist_ok=True)
        data_path = directory / f"rank-{self.rank}.pt"
        manifest_path = directory / f"rank-{self.rank}.json"
        if manifest_path.exists():
            verdict = self._verify_files(step, [self.rank])
            if verdict.valid:
                log.info(
                    "checkpoint %s already holds a valid rank-%d file; not overwritten", directory, self.rank
                )
                return self._record_clean(step, directory)
            log.warning(
                "checkpoint %s is invalid (%s); moving it aside and writing anew", directory, verdict.reason
            )
            stamp = int(time.time())
            for path in (data_path, manifest_path):
                if path.exists():
                    path.rename(path.with_name(f"{path.name}.corrupt-{stamp}"))

        tmp = data_path.with_name(f".{data_path.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as handle:
            writer = _HashingWriter(handle)
            torch.save(payload, writer)  # type: ignore[arg-type]  # any object with write() works
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, data_path)
        fsync_dir(directory)

        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
            "time": time.time(),
            "files": {data_path.name: {"size": writer.size, "sha256": writer.sha256.hexdigest()}},
            **meta,
        }
        _atomic_write_bytes(manifest_path, json.dumps(manifest, indent=1).encode())
        ref = self._record_clean(step, directory)
        if self.rank == 0:
            self.prune()
        return ref

    def reference(self, step: int) -> CheckpointRef | None:
        """The checkpoint at ``step`` as rank 0's manifest describes it (None without a manifest)."""
        directory = self.root / step_dir_name(step)
        manifest = self._read_manifest(directory / "rank-0.json")
        if manifest is None:
            return None
        entry = manifest["files"].get("rank-0.pt", {})
        return CheckpointRef(
            step=step, path=str(directory), sha256=str(entry.get("sha256", "")), time=float(manifest["time"])
        )

    def _record_clean(self, step: int, directory: Path) -> CheckpointRef | None:
        ref = self.reference(step)
        if ref is None:
            return None
        with self._lock:
            if self.last_clean is None or ref.step >= self.last_clean.step:
                self.last_clean = ref
        return ref

    # -- reading --------------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps that have a checkpoint directory (complete or not), oldest first."""
        found = []
        for child in self.root.iterdir():
            if child.is_dir() and child.name.startswith(_STEP_PREFIX):
                try:
                    found.append(int(child.name[len(_STEP_PREFIX) :]))
                except ValueError:
                    continue
        return sorted(found)

    @staticmethod
    def _read_manifest(path: Path) -> dict[str, Any] | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or not isinstance(data.get("files"), dict) or "time" not in data:
            return None
        return data

    def is_complete(self, step: int) -> bool:
        """Every rank of the writing job has published its manifest (no hashing: cheap)."""
        directory = self.root / step_dir_name(step)
        first = self._read_manifest(directory / "rank-0.json")
        if first is None:
            return False
        world = int(first.get("world_size", 1))
        return all((directory / f"rank-{r}.json").exists() for r in range(world))

    def _verify_files(self, step: int, ranks: Iterable[int]) -> Verdict:
        directory = self.root / step_dir_name(step)
        for rank in ranks:
            manifest_path = directory / f"rank-{rank}.json"
            manifest = self._read_manifest(manifest_path)
            if manifest is None:
                return Verdict(step, False, f"{manifest_path}: missing or not a valid manifest")
            if manifest.get("format") != FORMAT_VERSION or manifest.get("step") != step:
                return Verdict(step, False, f"{manifest_path}: wrong format or step")
            for name, entry in manifest["files"].items():
                path = directory / name
                try:
                    size = path.stat().st_size
                except OSError:
                    return Verdict(step, False, f"{path}: missing")
                if size != entry.get("size"):
                    return Verdict(
                        step, False, f"{path}: truncated ({size} bytes, manifest says {entry.get('size')})"
                    )
                if file_sha256(path) != entry.get("sha256"):
                    return Verdict(step, False, f"{path}: SHA-256 does not match the manifest (corrupted)")
        return Verdict(step, True)

    def verify(self, step: int) -> Verdict:
        """Check the files this rank would load at ``step``: complete, sizes and SHA-256 as manifested.

        A rank beyond the writing job's world size loads rank 0's files only (see ``load``).
        """
        directory = self.root / step_dir_name(step)
        first_path = directory / "rank-0.json"
        first = self._read_manifest(first_path)
        if first is None:
            return Verdict(step, False, f"{first_path}: missing or not a valid manifest")
        if not self.is_complete(step):
            return Verdict(step, False, f"{directory}: incomplete (a rank's manifest is missing)")
        writers = int(first.get("world_size", 1))
        return self._verify_files(step, sorted({0, self.rank} if self.rank < writers else {0}))

    def newest_valid(self, at_most: int | None = None) -> int | None:
        """The newest step at or below ``at_most`` this rank can load; logs why newer ones were skipped."""
        for step in reversed(self.steps()):
            if at_most is not None and step > at_most:
                continue
            verdict = self.verify(step)
            if verdict.valid:
                return step
            log.warning("skipping checkpoint at step %d: %s", step, verdict.reason)
        return None

    def load(self, step: int) -> dict[str, Any]:
        """Load this rank's view of a checkpoint: rank 0's model state merged with this rank's own state.

        Uses ``weights_only=True``: a file on a shared volume can never run code here.
        """
        directory = self.root / step_dir_name(step)
        state = self._load_file(directory / "rank-0.pt")
        if self.rank != 0:
            own = directory / f"rank-{self.rank}.pt"
            if own.exists():
                state.update(self._load_file(own))
            else:
                log.warning(
                    "%s has no state for rank %d; RNG and data position start afresh", directory, self.rank
                )
                state.pop("rng", None)
        self._record_clean(step, directory)
        return state

    @staticmethod
    def _load_file(path: Path) -> dict[str, Any]:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot be loaded safely: {exc}") from exc
        if not isinstance(loaded, dict):
            raise CheckpointError(
                f"{path}: not a trainguard checkpoint (top level is {type(loaded).__name__})"
            )
        return loaded

    # -- retention ------------------------------------------------------------------------------------
    def prune(self) -> list[int]:
        """Delete checkpoints beyond the newest ``keep_clean`` complete ones. Returns the deleted steps.

        Incomplete directories are deleted only when older than the oldest kept complete checkpoint
        (a newer incomplete one may still be being written by another rank).
        """
        steps = self.steps()
        complete = [s for s in steps if self.is_complete(s)]
        if not complete:
            return []
        kept = complete[-self.keep_clean :]
        oldest_kept = kept[0]
        deleted = []
        for step in steps:
            if step in kept or step >= oldest_kept:
                continue
            shutil.rmtree(self.root / step_dir_name(step), ignore_errors=True)
            deleted.append(step)
        if deleted:
            log.info("pruned checkpoints at steps %s (keeping %s)", deleted, kept)
        return deleted

    def close(self) -> None:
        """Finish the write in flight and stop the writer thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

"""The clean-checkpoint store on the shared volume: layout, manifests, completeness, verification, pruning.

Layout under the checkpoint directory::

    step-0000002000/
        rank-0.safetensors  model, optimizer, scheduler, scaler, guardian counters, RNG and data position
        rank-0.json         manifest: step, time, world size, and each file's size and SHA-256
        rank-1.safetensors  (other ranks) RNG and data position only; the model is replicated under DDP
        rank-1.json

A checkpoint is *complete* when every rank's manifest exists, and *valid* for a rank when the files
that rank loads (rank 0's and its own) match their manifests. Every file is written as temp file,
fsync, rename, directory fsync; the manifest last, so a manifest never describes a half-written file.
Only complete checkpoints count towards ``keep_clean``; the newest complete one is never deleted, and
nothing is ever overwritten: a step that already has a valid checkpoint is not written again.

Checkpoints of older formats (1: ``torch.save``; 2: trainguard's own raw format) are reported as an unknown
format and skipped, never loaded.

A save copies the state into reusable host buffers (``save_async``: the only part the training loop
waits for); then a writer thread writes the file (see ``writer``), then the manifest. Rank 0's pruning
of old checkpoints runs afterwards in a janitor thread, so ``wait`` returns as soon as the new
checkpoint is durable.
"""

from __future__ import annotations

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
from typing import Any

import torch

from trainer_sidecar.checkpoint import writer
from trainer_sidecar.checkpoint.errors import CheckpointError
from trainer_sidecar.checkpoint.format import FORMAT_VERSION, read_state, serialize
from trainer_sidecar.checkpoint.writer import atomic_write_bytes, default_parallel_hash, file_sha256
from trainer_sidecar.status import CheckpointRef
from trainer_sidecar.tensorstate import HostBuffers, flatten

log = logging.getLogger(__name__)

_STEP_PREFIX = "step-"


@dataclass(frozen=True)
class Verdict:
    """Whether one checkpoint can be loaded by one rank, and if not, why."""

    step: int
    valid: bool
    reason: str = ""


def data_file_name(rank: int) -> str:
    """The name of a rank's data file inside a checkpoint directory."""
    return f"rank-{rank}.safetensors"


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint at ``step`` (zero-padded so names sort by step)."""
    return f"{_STEP_PREFIX}{step:010d}"


class CheckpointStore:
    """Writes, verifies, finds and prunes clean checkpoints for one rank of a job.

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
    ) -> None:
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.keep_clean = keep_clean
        self.parallel_hash = default_parallel_hash() if parallel_hash is None else parallel_hash
        self._check_directory()
        self._buffers = HostBuffers()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-ckpt")
        self._janitor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-prune")
        self._inflight: Future[CheckpointRef | None] | None = None
        self._lock = threading.Lock()
        self.last_clean: CheckpointRef | None = None
        # Steps being written and being deleted, so that pruning never removes a step while it is written.
        self._dirs = threading.Condition()
        self._writing: set[int] = set()
        self._deleting: set[int] = set()
        self._prune_lock = threading.Lock()
        self._prune_queued = False
        self._prune_future: Future[None] | None = None

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
        one reuses: a second save never corrupts the first). Errors, including a state holding values a
        checkpoint cannot store, surface on the next ``wait`` as CheckpointError.
        """
        self.wait()
        skeleton, tensors = flatten(state)
        self._buffers.capture(tensors)
        self._inflight = self._executor.submit(self._write, step, skeleton, self._buffers.tensors, dict(meta))

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> CheckpointRef | None:
        """Save and wait until the checkpoint is durable; returns the clean checkpoint written (or kept).

        Pruning may still be running afterwards (see ``wait_for_pruning``).
        """
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

    def _write(
        self,
        step: int,
        skeleton: Any,
        tensors: list[torch.Tensor],
        meta: dict[str, Any],
    ) -> CheckpointRef | None:
        with self._dirs:
            self._writing.add(step)
            self._dirs.wait_for(lambda: step not in self._deleting)
        try:
            ref, written = self._write_step(step, skeleton, tensors, meta)
        finally:
            with self._dirs:
                self._writing.discard(step)
        if written and self.rank == 0:
            self._schedule_prune()  # once the step is no longer registered as being written
        return ref

    def _write_step(
        self,
        step: int,
        skeleton: Any,
        tensors: list[torch.Tensor],
        meta: dict[str, Any],
    ) -> tuple[CheckpointRef | None, bool]:
        """Write one step's files unless it already holds a valid one: (its reference, whether written)."""
        directory = self.root / step_dir_name(step)
        data_path = directory / data_file_name(self.rank)
        manifest_path = directory / f"rank-{self.rank}.json"
        try:
            serialized = serialize(skeleton, tensors)
        except CheckpointError as exc:
            raise CheckpointError(f"{data_path} not written: {exc}") from exc
        directory.mkdir(exist_ok=True)
        if manifest_path.exists():
            verdict = self._verify_files(step, [self.rank])
            if verdict.valid:
                log.info(
                    "checkpoint %s already holds a valid rank-%d file; not overwritten", directory, self.rank
                )
                return self._record_clean(step, directory), False
            log.warning(
                "checkpoint %s is invalid (%s); moving it aside and writing anew", directory, verdict.reason
            )
            stamp = int(time.time())
            for path in (data_path, manifest_path):
                if path.exists():
                    path.rename(path.with_name(f"{path.name}.corrupt-{stamp}"))

        sha256 = self._write_data(data_path, serialized)
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
            "time": time.time(),
            "files": {data_path.name: {"size": serialized.size, "sha256": sha256}},
            **meta,
        }
        atomic_write_bytes(manifest_path, json.dumps(manifest, indent=1).encode())
        return self._record_clean(step, directory), True

    def _write_data(self, data_path: Path, serialized: Any) -> str:
        return writer.write_data(data_path, serialized, parallel_hash=self.parallel_hash)

    def reference(self, step: int) -> CheckpointRef | None:
        """The checkpoint at ``step`` as rank 0's manifest describes it (None without a manifest)."""
        directory = self.root / step_dir_name(step)
        manifest = self._read_manifest(directory / "rank-0.json")
        if manifest is None:
            return None
        entry = manifest["files"].get(data_file_name(0), {})
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
            if manifest.get("format") != FORMAT_VERSION:
                return Verdict(
                    step,
                    False,
                    f"{manifest_path}: unknown checkpoint format {manifest.get('format')!r}"
                    f" (this version reads format {FORMAT_VERSION} only)",
                )
            if manifest.get("step") != step:
                return Verdict(step, False, f"{manifest_path}: describes step {manifest.get('step')!r}")
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

        The files are parsed as data only (see ``read_state``): a file on a shared volume can never run
        code here; one that is not a well-formed checkpoint raises CheckpointError naming it.
        """
        directory = self.root / step_dir_name(step)
        state = read_state(directory / data_file_name(0))
        if self.rank != 0:
            own = directory / data_file_name(self.rank)
            if own.exists():
                state.update(read_state(own))
            else:
                log.warning(
                    "%s has no state for rank %d; RNG and data position start afresh", directory, self.rank
                )
                state.pop("rng", None)
        self._record_clean(step, directory)
        return state

    # -- retention ------------------------------------------------------------------------------------
    def prune(self) -> list[int]:
        """Delete checkpoints beyond the newest ``keep_clean`` complete ones. Returns the deleted steps.

        Incomplete directories are deleted only when older than the oldest kept complete checkpoint
        (a newer incomplete one may still be being written by another rank), and never a step this
        store is writing. Rank 0 runs this in the background after each save; it can also be called.
        """
        with self._prune_lock:
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
                with self._dirs:
                    if step in self._writing:
                        continue
                    self._deleting.add(step)
                try:
                    shutil.rmtree(self.root / step_dir_name(step), ignore_errors=True)
                finally:
                    with self._dirs:
                        self._deleting.discard(step)
                        self._dirs.notify_all()
                deleted.append(step)
            if deleted:
                log.info("pruned checkpoints at steps %s (keeping %s)", deleted, kept)
            return deleted

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

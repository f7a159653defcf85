"""The status channel from a worker's guardian to its sidecar: one small JSON file, written atomically.

The guardian rewrites the file at most every ``status_interval_seconds`` (and at once on a phase
change); the sidecar and the local runner read it. A reader never trusts the file: a missing,
half-written or garbage file reads as ``None`` with a reason, never as an exception.
"""

from __future__ import annotations

import json
import os
import time
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

STATUS_FILE_ENV = "TRAINGUARD_STATUS_FILE"
#: Where the guardian writes its final status when the worker ends (a container's terminationMessagePath).
TERMINATION_MESSAGE_ENV = "TRAINGUARD_TERMINATION_MESSAGE_PATH"
#: The kubelet keeps at most this much of a container's termination message.
TERMINATION_MESSAGE_LIMIT = 4096
SCHEMA_VERSION = 1


class Phase(StrEnum):
    """What the worker is doing, as far as its guardian knows."""

    STARTING = "starting"
    RUNNING = "running"
    ROLLING_BACK = "rolling-back"
    DIVERGED = "diverged"
    FINISHED = "finished"
    FAILED = "failed"


class CheckpointRef(BaseModel):
    """A clean checkpoint on the shared volume."""

    model_config = ConfigDict(extra="ignore")

    step: int
    path: str
    sha256: str = ""
    time: float = 0.0


class WorkerStatus(BaseModel):
    """One worker's published state. Counters are cumulative over the job (restored on resume)."""

    model_config = ConfigDict(extra="ignore")

    schema_version: int = SCHEMA_VERSION
    rank: int = 0
    world_size: int = 1
    pid: int = 0
    phase: Phase = Phase.STARTING
    started_at: float = Field(description="Wall-clock time the guardian was created (unix seconds).")
    updated_at: float = 0.0
    step: int = 0
    resumed_step: int = Field(
        0, description="The checkpoint step this process resumed from (0: a fresh start)."
    )
    last_step_time: float | None = None
    busy_since: float | None = Field(
        None,
        description="While the phase is rolling-back (restoring the snapshot, then validating it): when "
        "that began (unix seconds). None otherwise.",
    )
    loss: float | None = None
    grad_norm: float | None = None
    lr_scale: float = 1.0
    max_grad_norm: float = 0.0
    steps_total: int = 0
    skipped_steps: int = 0
    consecutive_bad_steps: int = 0
    rollbacks: int = 0
    spikes: int = 0
    samples_seen: int = 0
    samples_dropped: int = 0
    explosion_pattern: str | None = None
    last_clean_checkpoint: CheckpointRef | None = None
    message: str = ""

    @property
    def drop_rate(self) -> float:
        """Dropped samples over samples seen (0 before any sample)."""
        return self.samples_dropped / self.samples_seen if self.samples_seen else 0.0


def write_termination_message(path: Path, status: WorkerStatus) -> None:
    """Write ``status`` as compact JSON, within the kubelet's 4096-byte limit, to a container's
    termination message file, so that the final state outlives the pod's sidecar (it lands in the pod's
    ``state.terminated.message``). The free-text message is shortened first if the limit requires it."""
    payload = status.model_dump(mode="json")
    payload["drop_rate"] = status.drop_rate
    text = json.dumps(payload, separators=(",", ":"))
    overflow = len(text.encode()) - TERMINATION_MESSAGE_LIMIT
    if overflow > 0:
        message = str(payload.get("message", ""))
        payload["message"] = message[: max(0, len(message) - overflow - 3)] + "..."
        text = json.dumps(payload, separators=(",", ":"))
    path.write_text(text)


def write_status(path: Path, status: WorkerStatus) -> None:
    """Replace the status file atomically (temp file and rename), so a reader sees old or new, never half."""
    payload = status.model_dump(mode="json")
    payload["drop_rate"] = status.drop_rate
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, separators=(",", ":")))
    os.replace(tmp, path)


def read_status(path: Path) -> tuple[WorkerStatus | None, str]:
    """Read a status file. Returns (status, "") or (None, why it could not be read)."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None, f"status file {path} does not exist yet"
    except OSError as exc:
        return None, f"status file {path} cannot be read: {exc}"
    try:
        return WorkerStatus.model_validate_json(text), ""
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(document)"
        return None, f"status file {path} is not a valid status ({where}: {first['msg']})"


class StatusPublisher:
    """Rate-limited writer of one worker's status file; costs a dict and a rename at most twice a second."""

    def __init__(self, path: Path | None, interval_seconds: float) -> None:
        self.path = path
        self.interval_seconds = interval_seconds
        self._last_write = 0.0
        self._last_phase: Phase | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def due(self, phase: Phase) -> bool:
        """Whether a write would happen now: the interval passed or the phase changed."""
        if self.path is None:
            return False
        return phase != self._last_phase or time.monotonic() - self._last_write >= self.interval_seconds

    def publish(self, status: WorkerStatus, *, force: bool = False) -> bool:
        """Write the status if forced or due. Returns whether it wrote."""
        if self.path is None or not (force or self.due(status.phase)):
            return False
        now = time.monotonic()
        status.updated_at = time.time()
        write_status(self.path, status)
        self._last_write = now
        self._last_phase = status.phase
        return True

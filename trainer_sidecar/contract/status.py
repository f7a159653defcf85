"""The status channel from a worker's guardian to its sidecar: one small JSON file, written atomically, and
the one contract every reader of it validates against.

The guardian rewrites the file at most every ``status_interval_seconds`` (and at once on a phase change,
when its training thread has stayed in one ``Activity`` for a watch period the file does not say yet,
and when that watch sees an evaluation begin or end: ``trainer_sidecar.guardian.reporting``); the
sidecar reads it, and the operator and the local runner receive it again as JSON (the sidecar's
``/status`` body, a container's termination message). Every reader goes through ``read_status`` (a file)
or ``parse_status`` / ``parse_status_document`` (JSON from elsewhere), which validate with
``WorkerStatus`` and never raise: a missing, half-written, oversized, special or garbage input reads as
``None`` with a reason.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, ClassVar, NamedTuple, Self, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    model_validator,
)

from trainer_sidecar.contract.files import FileRefused, read_small_file
from trainer_sidecar.contract.hang import ProgressGaps
from trainer_sidecar.contract.inplace import LauncherState
from trainer_sidecar.contract.reported import (
    Fold,
    Keep,
    PrinterColumn,
    Reported,
    ReportedField,
    WorkerCounter,
)

MAX_LOCAL_RANKS = 256
#: The kubelet keeps at most this much of a container's termination message.
TERMINATION_MESSAGE_LIMIT = 4096
SCHEMA_VERSION = 1

#: A status is a few hundred bytes; a reader refuses (without reading them) inputs larger than this.
MAX_STATUS_BYTES = 64 * 1024
#: The worker's free-text message is cut to this many characters (it is a reason, not a log).
MAX_MESSAGE_CHARS = 1024
#: Longest checkpoint path accepted (Linux's PATH_MAX).
MAX_PATH_CHARS = 4096
#: Largest counter or step accepted: every such value stays exact as a JSON number and a float sample.
MAX_COUNT = 2**53
#: Largest process id (pid_t is a signed 32-bit integer).
MAX_PID = 2**31 - 1
#: Largest gang accepted (well above what the operator's spec allows).
MAX_WORLD_SIZE = 2**20


_Model = TypeVar("_Model", bound=BaseModel)


def _shorten(text: str) -> str:
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return text[: MAX_MESSAGE_CHARS - 3] + "..."


# Integers are strict (no bools, no numeric strings, no floats); floats are finite (the models set
# allow_inf_nan=False) and strict (no bools or strings; integers are fine).
Count = Annotated[int, Strict(), Field(ge=0, le=MAX_COUNT)]
Timestamp = Annotated[float, Strict(), Field(ge=0.0)]
#: A busy section's bound is at most a week (the sidecar caps it at its startup grace in any case).
MAX_BUSY_SECONDS = 7 * 24 * 3600.0
MAX_BUSY_REASON_CHARS = 200
#: Open busy sections a status carries at most (the guardian refuses to open more, nested or not).
MAX_BUSY_SECTIONS = 32
#: The checkpoint cadence's reason: one line.
MAX_CADENCE_CHARS = 300
BusySeconds = Annotated[float, Strict(), Field(gt=0.0, le=MAX_BUSY_SECONDS)]
FiniteFloat = Annotated[float, Strict()]
NonNegativeFloat = Annotated[float, Strict(), Field(ge=0.0)]
Message = Annotated[str, AfterValidator(_shorten)]


class Phase(StrEnum):
    """What the worker is doing, as far as its guardian knows."""

    STARTING = "starting"
    RUNNING = "running"
    #: Restoring the last clean snapshot and validating it: no step for a while (``busy_since``).
    ROLLING_BACK = "rolling-back"
    #: Inside ``Guardian.busy`` (an evaluation, a save of the loop's own), or waiting for a busy peer:
    #: no step for a while, at most ``busy_seconds`` (``busy_since``, ``busy_reason``).
    BUSY = "busy"
    DIVERGED = "diverged"
    FINISHED = "finished"
    #: Told to stop (SIGTERM, Ctrl-C): the worker wrote its checkpoint (when clean) and is exiting.
    STOPPED = "stopped"
    FAILED = "failed"


class Activity(StrEnum):
    """Where a worker's training thread is, as far as its guardian knows (``WorkerStatus.activity``).

    What a hang of the gang is read from: among ranks that stopped stepping, one in its own work is the
    cause and those in a collective wait for it (``trainguard.core.policy``). The guardian knows its own
    calls, and the waits of the collectives the loop calls through torch.distributed on its thread where
    the host blocks in them (``LOOP_COLLECTIVE``): under DistributedDataParallel the gradient all-reduce
    runs inside ``backward``, in C++ (a rank in backward may be waiting for a peer's gradients), and under
    NCCL a collective's wait returns before the GPU is done, so a rank in ``loop`` may be waiting at the
    loop's next host sync (FSDP's forward all-gather, the loop's own all-reduce).
    """

    #: The training loop's own code between the guardian's calls: the next batch, the forward pass.
    LOOP = "loop"
    #: The guardian's loader is fetching the next batch (``Guardian.run``).
    DATA = "data"
    #: ``Guardian.backward``: the backward pass (under DDP it holds the gradient all-reduce).
    BACKWARD = "backward"
    #: The guardian's own work at a step boundary: norms, the judge, clipping, the optimizer's update.
    STEP = "step"
    #: In a collective of the guardian's (the step's all-reduce, an agreement, a barrier): it returns
    #: only once every rank has entered it.
    COLLECTIVE = "collective"
    #: Waiting for a collective the guardian did not issue: the loop's own ``torch.distributed`` call
    #: (an all-reduce of its metrics, its model's or optimizer's), seen where the host blocks, in its
    #: work's ``wait()`` (``trainer_sidecar.guardian.collectives``).
    LOOP_COLLECTIVE = "loop_collective"
    #: Opening, loading or saving a checkpoint.
    CHECKPOINT = "checkpoint"
    #: Inside ``Guardian.busy`` (an evaluation, a save of the loop's own).
    BUSY = "busy"


def _known_activity(value: object) -> object:
    # A newer writer's activity this reader does not know reads as unknown, not as an unreadable status.
    if isinstance(value, str) and value not in Activity.__members__.values():
        return None
    return value


class CheckpointRef(BaseModel):
    """A clean checkpoint on the shared volume: its step, folder, rank 0's file hash and write time."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    step: Count
    path: str = Field(max_length=MAX_PATH_CHARS)
    sha256: str = Field("", pattern=r"^([0-9a-f]{64})?$", description="Lower-case hex, or empty: unknown.")
    time: Timestamp = 0.0


class BusySection(BaseModel):
    """One open busy section of a worker: what, since when (the worker's wall clock, unix seconds), and
    how long it asked to be allowed (None: the startup grace). Each is judged from its own start (see
    ``trainer_sidecar.contract.allowance``)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    reason: str = Field("", max_length=MAX_BUSY_REASON_CHARS)
    since: Timestamp
    seconds: BusySeconds | None = None


class WorkerStatus(BaseModel):
    """One worker's published state. Counters are cumulative over the job (restored on resume).

    Validation is strict where a reader relies on it: integers are integers (not bools, strings or
    floats) and non-negative counters, floats are finite, timestamps are non-negative, the phase is a known
    one, the rank is below the world size, and strings are bounded (``message`` is shortened to
    ``MAX_MESSAGE_CHARS``; an over-long checkpoint path is refused). Whether timestamps are *plausible*
    (not in the future) is for the reader to judge against its own clock. Unknown fields are ignored, so a
    newer writer's additions do not make a status unreadable.

    A field annotated with a ``Reported`` (``trainer_sidecar.contract.reported``) is a reported one: its
    gang value reaches the job's status, metrics, run summary and CRD, and its own value the sidecar's
    counters, as the annotation says (``trainer_sidecar.contract.fields.REPORTED`` is read off this
    model). ``DERIVED`` lists the reported values made of other fields, which no rank carries.
    """

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    DERIVED: ClassVar[tuple[ReportedField, ...]] = (
        Reported(
            Fold.RATIO,
            "Dropped over seen samples, over all ranks.",
            status="drop_rate",
            ratio_of=("samples_dropped", "samples_seen"),
            metric="trainguard_job_drop_ratio",
            summary="drop_rate",
        ).named("drop_rate", float),
    )

    schema_version: Annotated[int, Strict(), Field(ge=1)] = SCHEMA_VERSION
    rank: Annotated[int, Strict(), Field(ge=0, lt=MAX_WORLD_SIZE)] = 0
    world_size: Annotated[int, Strict(), Field(ge=1, le=MAX_WORLD_SIZE)] = 1
    pid: Annotated[int, Strict(), Field(ge=0, le=MAX_PID)] = 0
    phase: Phase = Phase.STARTING
    started_at: Timestamp = Field(description="Wall-clock time the guardian was created (unix seconds).")
    updated_at: Timestamp = 0.0
    step: Annotated[
        Count,
        Reported(
            Fold.SLOWEST,
            "The gang's training step: the slowest rank's (every rank did it).",
            status="step",
            metric="trainguard_job_step",
            column=PrinterColumn("Step", "Newest step kept.", after="State"),
        ),
    ] = 0
    resumed_step: Count = Field(
        0, description="The checkpoint step this process resumed from (0: a fresh start)."
    )
    last_step_time: Timestamp | None = None
    busy_since: Timestamp | None = Field(
        None,
        description="While the phase is rolling-back (restoring the snapshot, then validating it) or busy: "
        "when that began (unix seconds). None otherwise.",
    )
    busy_reason: str = Field(
        "", max_length=MAX_BUSY_REASON_CHARS, description="What the worker is busy with."
    )
    busy_seconds: BusySeconds | None = Field(
        None,
        description="While busy: how long the worker is allowed, counted from busy_since (None: the startup "
        "grace). With nested sections, the earliest of their own deadlines as of busy_since: what a "
        "sidecar that reads no busy_sections needs to judge the same.",
    )
    busy_sections: list[BusySection] = Field(
        default_factory=list,
        max_length=MAX_BUSY_SECTIONS,
        description="While busy: every open section, outermost first, each with its own start and bound "
        "(empty from a worker older than this field: then busy_since/busy_seconds are the one section).",
    )
    local_rank: Annotated[int, Strict(), Field(ge=0, lt=MAX_LOCAL_RANKS)] = Field(
        0, description="This process's rank among the worker processes of its pod (torchrun's LOCAL_RANK)."
    )
    local_world_size: Annotated[int, Strict(), Field(ge=1, le=MAX_LOCAL_RANKS)] = Field(
        1,
        description="How many worker processes its pod runs (torchrun's LOCAL_WORLD_SIZE): each writes "
        "<stem>-<local rank>.json when above 1, and the sidecar expects every one of them.",
    )
    loss: FiniteFloat | None = None
    grad_norm: NonNegativeFloat | None = None
    lr_scale: NonNegativeFloat = 1.0
    #: The clipping norm in force (None: no clipping).
    max_grad_norm: NonNegativeFloat | None = None
    steps_total: Annotated[
        Count,
        Reported(
            Fold.MAX,
            "Training steps the gang completed (skipped steps included).",
            counter=WorkerCounter(
                "trainguard_worker_steps_total",
                "Training steps the worker completed (skipped steps included).",
            ),
        ),
    ] = 0
    rollbacks: Annotated[
        Count,
        Reported(
            Fold.MAX,
            "In-process rollbacks reported by the guardian.",
            status="rollbacks",
            metric="trainguard_job_rollbacks",
            summary="rollbacks",
            column=PrinterColumn("Rollbacks", "In-process rollbacks.", after="Restarts"),
            counter=WorkerCounter(
                "trainguard_worker_rollbacks_total", "Rollbacks to the last clean snapshot or checkpoint."
            ),
        ),
    ] = 0
    skipped_steps: Annotated[
        Count,
        Reported(
            Fold.MAX,
            "Steps the guardian skipped.",
            status="skipped_steps",
            metric="trainguard_job_skipped_steps",
            summary="skipped_steps",
            counter=WorkerCounter(
                "trainguard_worker_skipped_steps_total",
                "Steps the guardian skipped (non-finite loss or gradients, spikes).",
            ),
        ),
    ] = 0
    consecutive_bad_steps: Count = 0
    spikes: Annotated[
        Count,
        Reported(
            Fold.MAX,
            "Loss or gradient-norm spikes detected.",
            counter=WorkerCounter(
                "trainguard_worker_loss_spikes_total", "Loss or gradient-norm spikes detected."
            ),
        ),
    ] = 0
    samples_seen: Annotated[
        Count,
        Reported(
            Fold.SUM,
            "Samples the data guard saw, over all ranks.",
            status="samples_seen",
            counted_by="samples_seen",
            summary="samples_seen",
            counter=WorkerCounter(
                "trainguard_worker_samples_total", "Training samples the worker's data pipeline produced."
            ),
        ),
    ] = 0
    samples_dropped: Annotated[
        Count,
        Reported(
            Fold.SUM,
            "Samples the data guard dropped, over all ranks.",
            status="samples_dropped",
            counted_by="samples_seen",
            metric="trainguard_job_dropped_samples",
            summary="samples_dropped",
            counter=WorkerCounter(
                "trainguard_worker_dropped_samples_total",
                "Training samples dropped as corrupt or unreadable.",
            ),
        ),
    ] = 0
    explosion_pattern: str | None = Field(None, max_length=64)
    last_clean_checkpoint: CheckpointRef | None = None
    message: Message = ""
    checkpoint_seconds: Annotated[
        NonNegativeFloat | None,
        Reported(
            Fold.MAX,
            "The longest checkpoint write seen (seconds): it sizes the pods' stop grace.",
            status="checkpoint_seconds",
            keep=Keep.HIGHEST,
            digits=3,
            empty_is_unknown=True,
        ),
    ] = Field(
        None, description="How long the worker's last checkpoint took to be written and durable (seconds)."
    )
    max_steps: Annotated[
        Count | None,
        Reported(Fold.MAX, "The last step the training loop declared (max_steps).", status="max_steps"),
    ] = Field(
        None,
        description="The step the loop declared it ends at (Guardian(max_steps=...), steps(max_steps) or "
        "run(loader, max_steps)); None: not declared. The ETA is reckoned to it.",
    )
    checkpoint_every_steps: Annotated[
        Annotated[int, Strict(), Field(ge=1, le=MAX_COUNT)] | None,
        Reported(
            Fold.LEAD,
            "The checkpoint interval in steps now in force (everySteps, or what auto chose).",
            status="checkpoint_every_steps",
            written_with="checkpoint_cadence",
        ),
    ] = Field(
        None,
        description="The checkpoint interval in steps now in force (None: everySteps auto has not chosen one "
        "yet, the first checkpoint comes by time).",
    )
    checkpoint_cadence: Annotated[
        str,
        Reported(
            Fold.LEAD,
            "Why that interval: for everySteps auto the save stall, MTBF (and its source) and step time it "
            "came from.",
            status="checkpoint_cadence",
            empty_is_unknown=True,
        ),
    ] = Field(
        "",
        max_length=MAX_CADENCE_CHARS,
        description="Why that interval: for everySteps auto the save stall, MTBF (and its source) and step "
        "time it came from.",
    )
    checkpoint_stall_seconds: NonNegativeFloat | None = Field(
        None, description="How long the last checkpoint stalled the training thread (seconds)."
    )
    checkpoint_write_since: Timestamp | None = Field(
        None,
        description="When this rank's checkpoint write still in flight started (unix seconds; None: none "
        "in flight): a gang stopped because it lost a rank is given the time to finish it "
        "(trainer_sidecar.contract.stopping).",
    )
    activity: Annotated[Activity | None, BeforeValidator(_known_activity)] = Field(
        None,
        description="Where the training thread is (see Activity); None from a worker older than this field.",
    )
    activity_since: Timestamp | None = Field(
        None, description="When the training thread entered that activity (unix seconds)."
    )
    progress_gaps: Count = Field(
        0,
        description="How many gaps between the progress changes it published the worker timed while "
        "running (declared pauses excluded): the hang deadline is learned once there are enough "
        "(trainer_sidecar.contract.hang). A run resumed from a checkpoint that saved a learned pace "
        "starts at the warm-up less its own short one.",
    )
    longest_progress_gap_seconds: NonNegativeFloat = Field(
        0.0,
        description="The longest of those gaps after the warm-up (seconds; 0 before), or carried from the "
        "checkpoint a run resumed from.",
    )
    exit_code: Annotated[int, Strict(), Field(ge=0, le=255)] | None = Field(
        None,
        description="The code the guardian ends its process with, once it knows (a launcher between the "
        "worker and the orchestrator, such as torchrun, may report another).",
    )

    compute_seconds: NonNegativeFloat | None = Field(
        None,
        description="The rank's own compute per step: the median over its last steps (the job's straggler "
        "window) of the time its training thread spent in its own work between step boundaries, time "
        "waiting in collectives excluded (trainer_sidecar.contract.compute). None until the window is "
        "full, and from a worker older than this field.",
    )
    best_compute_seconds: NonNegativeFloat | None = Field(
        None, description="The lowest such median this process published (its own best pace)."
    )

    @model_validator(mode="after")
    def _rank_in_gang(self) -> Self:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        if self.local_rank >= self.local_world_size:
            raise ValueError(
                f"local_rank {self.local_rank} is not below local_world_size {self.local_world_size}"
            )
        return self

    @property
    def gaps(self) -> ProgressGaps:
        """What the worker learned of its pace, as the hang deadline's rule takes it."""
        return ProgressGaps(self.progress_gaps, self.longest_progress_gap_seconds)

    @property
    def drop_rate(self) -> float:
        """Dropped samples over samples seen (0 before any sample)."""
        return self.samples_dropped / self.samples_seen if self.samples_seen else 0.0

    def to_document(self) -> dict[str, object]:
        """The JSON object every writer publishes: the fields, plus the derived ``drop_rate``."""
        payload: dict[str, object] = self.model_dump(mode="json")
        payload["drop_rate"] = self.drop_rate
        return payload


class StatusRead(NamedTuple):
    """The outcome of reading or parsing a status: ``(status, "")`` or ``(None, why not)``."""

    status: WorkerStatus | None
    reason: str


def _validate(
    model: type[_Model], data: object, source: str, what: str, limit: int
) -> tuple[_Model | None, str]:
    """``data`` (JSON text or bytes of at most ``limit`` bytes, or a decoded object) validated as ``model``,
    or None and a reason naming ``source`` and the first offending field. Never raises."""
    try:
        if isinstance(data, (str, bytes)):
            size = len(data.encode() if isinstance(data, str) else data)
            if size > limit:
                return None, f"{source} is {size} bytes, more than the {limit} allowed"
            return model.model_validate_json(data), ""
        if not isinstance(data, Mapping):
            return None, f"{source} is not a JSON object"
        return model.model_validate(data), ""
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "(document)"
        return None, f"{source} is not a valid {what} ({where}: {first['msg']})"
    except Exception as exc:  # a reader never trusts its input, nor the parser's error paths
        return None, f"{source} cannot be parsed: {type(exc).__name__}"


def parse_status(data: object, source: str = "the status") -> StatusRead:
    """Validate a worker status that arrived as JSON text or bytes, or as an already decoded JSON object
    (a ``/status`` body's ``status``, a termination message). Never raises; ``source`` names the input in
    the reason. Text beyond ``MAX_STATUS_BYTES`` is refused unparsed."""
    return StatusRead(*_validate(WorkerStatus, data, source, "worker status", MAX_STATUS_BYTES))


def _read_status_bytes(path: Path) -> bytes | str:
    """The bytes of the regular status file at ``path`` (symlinks followed), or why they cannot be had."""
    source = f"status file {path}"
    try:
        return read_small_file(path, MAX_STATUS_BYTES, source)
    except FileNotFoundError:
        return f"{source} does not exist yet"
    except FileRefused as exc:
        return str(exc)


def read_status(path: Path) -> StatusRead:
    """Read and validate a worker's status file. Never raises and never blocks on a special file: only a
    regular file (a symlink to one is fine) of at most ``MAX_STATUS_BYTES`` is read, and no more than
    that. Returns ``(status, "")`` or ``(None, why it could not be read)``; the reason names the path."""
    data = _read_status_bytes(Path(path))
    if isinstance(data, str):
        return StatusRead(None, data)
    return parse_status(data, f"status file {path}")


#: The sidecar's reasons (health, read errors) are cut to this many characters.
MAX_REASON_CHARS = 8192


def _shorten_reason(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


Reason = Annotated[str, AfterValidator(_shorten_reason)]


class HealthReport(BaseModel):
    """The sidecar's verdict on its worker: ``alive`` the liveness verdict, ``ready`` what ``/readyz``
    answers, ``reason`` why (also when both are true), and the hang timeout it judged by. ``/healthz``
    passes while ``alive`` or ``kill_held``."""

    model_config = ConfigDict(extra="ignore")

    alive: Annotated[bool, Strict()]
    ready: Annotated[bool, Strict()]
    reason: Reason = ""
    kill_held: Annotated[bool, Strict()] = Field(
        False,
        description="Not alive, but the liveness probe still passes while the worker's checkpoint write in "
        "flight is expected to finish (False from a sidecar older than this field).",
    )
    hang_timeout_seconds: NonNegativeFloat | None = Field(
        None,
        description="The hang timeout the worker is judged by now: learned from its pace, between the "
        "sidecar's floor and ceiling (None: a sidecar older than learning).",
    )


class SidecarInfo(BaseModel):
    """The settings a sidecar judges with: when it started (unix seconds), its two time limits, and the
    floor of the hang timeout it learns (the hang timeout is the ceiling)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    started_at: Timestamp
    hang_timeout_seconds: NonNegativeFloat
    startup_grace_seconds: NonNegativeFloat
    hang_timeout_floor_seconds: NonNegativeFloat | None = Field(
        None, description="The least hang timeout learned (None: the fixed rule, or an older sidecar)."
    )


class SidecarStatusDocument(BaseModel):
    """The body of a sidecar's ``GET /status``: the worker's status as the sidecar read it (None when it
    could not, then ``read_error`` says why), the health verdict, the sidecar's time (unix seconds) and
    settings, and the launcher's state where the worker runs under ``trainguard-launch``. The sidecar
    builds its answer with this model, and the operator and the local runner parse it with
    ``parse_status_document``."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    status: WorkerStatus | None
    read_error: Reason = ""
    health: HealthReport
    time: Timestamp
    sidecar: SidecarInfo
    launcher: LauncherState | None = Field(
        None,
        description="What the pod's launcher (trainguard-launch) runs, when the worker runs under one: the "
        "attempt, and the worker's exit while the launcher waits for an order (None: no launcher, or a "
        "sidecar older than this field).",
    )
    launcher_error: Reason = Field("", description="Why the launcher's state file could not be read.")

    def to_document(self) -> dict[str, object]:
        """The JSON object served: the fields, with ``status.drop_rate`` added when there is a status."""
        payload: dict[str, object] = self.model_dump(mode="json")
        if self.status is not None:
            payload["status"] = self.status.to_document()
        return payload


class DocumentRead(NamedTuple):
    """The outcome of parsing a sidecar's ``/status`` body: ``(document, "")`` or ``(None, why not)``."""

    document: SidecarStatusDocument | None
    reason: str


def parse_status_document(data: object, source: str = "the sidecar's /status") -> DocumentRead:
    """Validate a sidecar's ``/status`` body (JSON text or bytes, or an already decoded object) with the
    same ``WorkerStatus`` the sidecar read. Never raises; anything malformed is ``(None, reason)``, the
    reason naming ``source`` and the first offending field. Text beyond ``MAX_STATUS_BYTES`` plus room for
    the reasons is refused unparsed."""
    limit = MAX_STATUS_BYTES + 4 * MAX_REASON_CHARS
    return DocumentRead(*_validate(SidecarStatusDocument, data, source, "sidecar status", limit))


def write_termination_message(path: Path, status: WorkerStatus) -> None:
    """Write ``status`` as compact JSON, within the kubelet's 4096-byte limit, to a container's
    termination message file, so that the final state outlives the pod's sidecar (it lands in the pod's
    ``state.terminated.message``). The free-text message is shortened first if the limit requires it."""
    payload = status.to_document()
    text = json.dumps(payload, separators=(",", ":"))
    overflow = len(text.encode()) - TERMINATION_MESSAGE_LIMIT
    if overflow > 0:
        message = str(payload.get("message", ""))
        payload["message"] = message[: max(0, len(message) - overflow - 3)] + "..."
        text = json.dumps(payload, separators=(",", ":"))
    path.write_text(text)


def write_status(path: Path, status: WorkerStatus) -> None:
    """Replace the status file atomically (temp file and rename), so a reader sees old or new, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(status.to_document(), separators=(",", ":")))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk or a directory in the way: leave nothing behind
        raise


class StatusPublisher:
    """Rate-limited writer of one worker's status file; costs a dict and a rename at most twice a second."""

    def __init__(self, path: Path | None, interval_seconds: float) -> None:
        self.path = path
        self.interval_seconds = interval_seconds
        self._last_write = 0.0
        self._last_phase: Phase | None = None

    @property
    def written(self) -> bool:
        """Whether a status was ever written."""
        return self._last_phase is not None

    def due(self, phase: Phase) -> bool:
        """Whether a write would happen now: the interval passed or the phase changed."""
        if self.path is None:
            return False
        return phase != self._last_phase or time.monotonic() - self._last_write >= self.interval_seconds

    def publish(self, status: WorkerStatus, *, force: bool = False) -> bool:
        """Write the status if forced or due (making its folder first). Returns whether it wrote; raises
        OSError when it cannot."""
        if self.path is None or not (force or self.due(status.phase)):
            return False
        now = time.monotonic()
        status.updated_at = time.time()
        if not self.written:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        write_status(self.path, status)
        self._last_write = now
        self._last_phase = status.phase
        return True


def local_status_file(path: Path, local_rank: int, local_ranks: int) -> Path:
    """The status file of one of ``local_ranks`` worker processes in a pod: ``path`` itself for a pod of
    one, ``<stem>-<local rank><suffix>`` beside it otherwise (the guardian writes it, the sidecar reads
    every one)."""
    if local_ranks <= 1:
        return path
    return path.with_name(f"{path.stem}-{local_rank}{path.suffix}")

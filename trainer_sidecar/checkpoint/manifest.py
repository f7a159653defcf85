"""The manifest of one rank's files in a checkpoint: untrusted input, validated strictly before any use.

``rank-R.json`` records the format, the checkpoint's step and epoch, the rank and the world size of the
job that wrote it, when, and each file's size and SHA-256; the caller's own keys (``loss``, ``clean``...)
sit beside them. The manifest is written last, so it never describes a half-written file.

A manifest is read with a size bound and validated by a strict model: a wrong type (``world_size:
"two"``, ``time: "yesterday"``, ``null``), a file entry that is not an object, or a file name that is not
a plain name (no ``/``, no leading dot, so never ``..``) makes it invalid, with a reason naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from trainer_sidecar.checkpoint import fs
from trainer_sidecar.checkpoint.errors import CheckpointError
from trainer_sidecar.checkpoint.format import FORMAT_VERSION, loads_strict
from trainer_sidecar.checkpoint.layout import CheckpointId, data_file_name, manifest_name

MANIFEST_LIMIT = 1 << 20
"""The largest manifest a reader accepts, in bytes."""

MAX_WORLD_SIZE = 1 << 16
"""The largest world size a manifest may record."""

FileName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]


class FileEntry(BaseModel):
    """One file of a rank: its size in bytes and its SHA-256 (lowercase hex)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Manifest(BaseModel):
    """A validated manifest. Extra keys (the caller's metadata) are kept as they are."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    format: int
    step: int = Field(ge=0)
    epoch: int = Field(0, ge=0)
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1, le=MAX_WORLD_SIZE)
    time: float = Field(ge=0.0, allow_inf_nan=False)
    files: dict[FileName, FileEntry] = Field(min_length=1, max_length=16)


RESERVED_KEYS = frozenset(Manifest.model_fields)
"""Keys a caller's metadata may not use: they belong to the manifest."""


def manifest_bytes(manifest: Manifest) -> bytes:
    """The manifest as the JSON a reader parses (caller's keys after the manifest's own)."""
    return json.dumps(manifest.model_dump(mode="json"), indent=1, allow_nan=False).encode()


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "(document)"
    return f"{where}: {first['msg']}"


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Validate a manifest's bytes (pure); CheckpointError naming ``where`` and the field at fault."""
    try:
        document = loads_strict(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where}: not a valid manifest (not JSON: {exc})") from exc
    if not isinstance(document, dict):
        raise CheckpointError(f"{where}: not a valid manifest (not a JSON object)")
    if document.get("format") != FORMAT_VERSION:
        found = document.get("format")
        raise CheckpointError(
            f"{where}: unknown checkpoint format {found!r} (this version reads format {FORMAT_VERSION} only)"
        )
    try:
        return Manifest.model_validate(document)
    except ValidationError as exc:
        raise CheckpointError(f"{where}: not a valid manifest ({_first_error(exc)})") from exc


def read_manifest(step_fd: int, checkpoint: CheckpointId, rank: int, where: str) -> Manifest:
    """Rank ``rank``'s manifest of ``checkpoint``, read from the checkpoint's directory ``step_fd``.

    Valid only if it describes this very checkpoint and rank and lists the rank's data file; every defect
    raises CheckpointError naming the file (``where``: the directory's path, for messages).
    """
    path = f"{where}/{manifest_name(rank)}"
    manifest = parse_manifest(fs.read_small(step_fd, manifest_name(rank), MANIFEST_LIMIT, path), path)
    if (manifest.step, manifest.epoch) != (checkpoint.step, checkpoint.epoch):
        found = CheckpointId(manifest.step, manifest.epoch)
        raise CheckpointError(f"{path}: describes {found}, not {checkpoint}")
    if manifest.rank != rank:
        raise CheckpointError(f"{path}: describes rank {manifest.rank}")
    if data_file_name(rank) not in manifest.files:
        raise CheckpointError(f"{path}: does not list {data_file_name(rank)}")
    return manifest


def published(step_fd: int, world_size: int) -> bool:
    """Whether every rank of a job of ``world_size`` has published its manifest (a regular file)."""
    return all(fs.kind(step_fd, manifest_name(rank)) == "file" for rank in range(world_size))


def new_manifest(
    checkpoint: CheckpointId,
    rank: int,
    world_size: int,
    time: float,
    files: dict[str, FileEntry],
    meta: dict[str, Any],
) -> Manifest:
    """The manifest of a rank's files; CheckpointError if ``meta`` uses a reserved key or is not JSON."""
    clashes = sorted(RESERVED_KEYS & set(meta))
    if clashes:
        raise CheckpointError(f"checkpoint metadata may not use the manifest's own keys {clashes}")
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint metadata is not plain JSON: {exc}") from exc
    return Manifest(
        format=FORMAT_VERSION,
        step=checkpoint.step,
        epoch=checkpoint.epoch,
        rank=rank,
        world_size=world_size,
        time=time,
        files=files,
        **meta,
    )


def is_complete(root_fd: int, checkpoint: CheckpointId, where: str) -> bool:
    """Whether every rank of the job that wrote ``checkpoint`` has published a manifest (rank 0's valid).

    Cheap: no file is hashed. Any defect, of the directory or of rank 0's manifest, reads as incomplete.
    """
    try:
        with fs.open_dir(root_fd, checkpoint.dir_name, where) as step_fd:
            first = read_manifest(step_fd, checkpoint, 0, where)
            return published(step_fd, first.world_size)
    except (CheckpointError, OSError):
        return False

"""Names inside a checkpoint directory, and the identity of a checkpoint: its step and its epoch.

::

    epochs/epoch-000003.json          the claim of epoch 3 (see ``fence``)
    step-0000002000-e000003/          the checkpoint of step 2000 written under epoch 3
        rank-0.safetensors            rank 0's state (see ``format``)
        rank-0.json                   its manifest (see ``manifest``)
    step-0000001000/                  a checkpoint written without an epoch (epoch 0)

Only canonical names count: ``step-1`` or ``step-0000002000-e000000`` are not checkpoint directories.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainer_sidecar.checkpoint import fs

EPOCHS_DIR = "epochs"
"""The folder of epoch claims inside the checkpoint directory."""

EPOCH_LIMIT = 1 << 24
"""Epochs are below this number, so that (step, epoch) packs into one int64 (see ``CheckpointId.packed``)."""

_STEP_DIR = re.compile(r"step-(\d{10,})(?:-e(\d{6,}))?")
_EPOCH_FILE = re.compile(r"epoch-(\d{6,})\.json")


@dataclass(frozen=True, order=True)
class CheckpointId:
    """A checkpoint's identity: the step it holds and the epoch that wrote it, ordered by (step, epoch).

    The same step may be written under several epochs (a job resumed from an older checkpoint); they
    are different checkpoints in different directories.
    """

    step: int
    epoch: int = 0

    @property
    def dir_name(self) -> str:
        """The name of this checkpoint's directory."""
        return step_dir_name(self.step, self.epoch)

    @property
    def packed(self) -> int:
        """One non-negative integer that orders as (step, epoch) does: for an all_reduce(MIN) across ranks."""
        return self.step * EPOCH_LIMIT + self.epoch

    @classmethod
    def unpack(cls, packed: int) -> CheckpointId:
        """The identity ``packed`` was made from."""
        return cls(packed // EPOCH_LIMIT, packed % EPOCH_LIMIT)

    def __str__(self) -> str:
        return f"step {self.step}" + (f" (epoch {self.epoch})" if self.epoch else "")


def step_dir_name(step: int, epoch: int = 0) -> str:
    """The directory name of the checkpoint at ``step`` written under ``epoch`` (zero-padded so that names
    sort by step; epoch 0, a writer without an epoch, has no suffix)."""
    return f"step-{step:010d}" + (f"-e{epoch:06d}" if epoch else "")


def parse_dir_name(name: str) -> CheckpointId | None:
    """The checkpoint a directory name stands for, or None if it is not a canonical checkpoint name."""
    match = _STEP_DIR.fullmatch(name)
    if match is None:
        return None
    found = CheckpointId(int(match[1]), int(match[2] or 0))
    return found if found.dir_name == name and found.epoch < EPOCH_LIMIT else None


def data_file_name(rank: int) -> str:
    """The name of a rank's data file inside a checkpoint directory."""
    return f"rank-{rank}.safetensors"


def manifest_name(rank: int) -> str:
    """The name of a rank's manifest inside a checkpoint directory."""
    return f"rank-{rank}.json"


def epoch_file_name(epoch: int) -> str:
    """The name of the claim of ``epoch`` inside ``EPOCHS_DIR``."""
    return f"epoch-{epoch:06d}.json"


def parse_epoch_file_name(name: str) -> int | None:
    """The epoch a claim's file name stands for, or None if it is not a canonical claim name."""
    match = _EPOCH_FILE.fullmatch(name)
    if match is None:
        return None
    epoch = int(match[1])
    return epoch if 0 < epoch < EPOCH_LIMIT and epoch_file_name(epoch) == name else None


def scan_checkpoints(root_fd: int) -> list[CheckpointId]:
    """Every checkpoint directory under the root (real directories with canonical names), oldest first."""
    found = [parse_dir_name(name) for name, kind in fs.entries(root_fd) if kind == "dir"]
    return sorted(checkpoint for checkpoint in found if checkpoint is not None)

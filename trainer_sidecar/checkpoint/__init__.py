"""Clean checkpoints on a shared volume that is not trusted.

- ``format``: a nested training state to the bytes of one data file (a safetensors file) and back
  (pure; no I/O beyond reading a given file descriptor).
- ``writer``: the writer and hashing threads, temp file, fsync, rename, directory fsync.
- ``store``: completeness, verification, the newest valid checkpoint, loading and pruning
  (``CheckpointStore``), over ``layout`` (names), ``manifest`` (validated manifests) and ``fs`` (opening
  files relative to directory descriptors, never through a link).
- ``fence``: epochs, so that of two writers of one directory only the newest can commit
  (``claim_epoch``, ``FencedError``).
"""

from trainer_sidecar.checkpoint.errors import CheckpointError
from trainer_sidecar.checkpoint.fence import (
    Claim,
    EpochOwner,
    EpochRecord,
    Fence,
    FencedError,
    claim_epoch,
    claim_next_epoch,
)
from trainer_sidecar.checkpoint.format import DTYPES, FORMAT_VERSION, read_state
from trainer_sidecar.checkpoint.layout import CheckpointId, data_file_name, step_dir_name
from trainer_sidecar.checkpoint.store import CheckpointStore, Verdict

__all__ = [
    "DTYPES",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointId",
    "CheckpointStore",
    "Claim",
    "EpochOwner",
    "EpochRecord",
    "Fence",
    "FencedError",
    "Verdict",
    "claim_epoch",
    "claim_next_epoch",
    "data_file_name",
    "read_state",
    "step_dir_name",
]

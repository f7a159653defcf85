"""Clean checkpoints on a shared volume, in three parts.

- ``format``: a nested training state to the bytes of one data file and back (pure; no I/O beyond
  reading a given file descriptor).
- ``writer``: the writer and hashing threads, temp file, fsync, rename, directory fsync.
- ``store``: the directory layout, manifests, completeness, verification, the newest valid checkpoint,
  loading and pruning (``CheckpointStore``).
"""

from trainer_sidecar.checkpoint.errors import CheckpointError
from trainer_sidecar.checkpoint.format import DTYPES, FORMAT_VERSION, read_state
from trainer_sidecar.checkpoint.store import CheckpointStore, Verdict, data_file_name, step_dir_name

__all__ = [
    "DTYPES",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointStore",
    "Verdict",
    "data_file_name",
    "read_state",
    "step_dir_name",
]

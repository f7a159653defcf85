"""Forensic bundles: a small JSON file per anomaly beside the checkpoints, for the person who investigates.

Each bundle holds the step and iteration, the reason, the loss and gradient norm, the explosion pattern,
where a NaN was born (when localised), the batches of the step, and the recent loss and norm history. The
newest ``FORENSICS_KEEP`` bundles of each rank are kept.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trainer_sidecar.checkpoint import fs
from trainer_sidecar.checkpoint.errors import CheckpointError

log = logging.getLogger(__name__)

FORENSICS_DIR = "forensics"
FORENSICS_KEEP = 20
HISTORY_KEPT = 100


@dataclass(frozen=True)
class BatchRef:
    """One micro-batch of a step: its epoch, its index in the epoch, and the sample ids it held."""

    epoch: int
    index: int
    sample_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Anomaly:
    """What went wrong at one step, as the guardian saw it."""

    step: int
    iteration: int
    rank: int
    reason: str
    loss: float
    grad_norm: float
    explosion_pattern: str | None
    nan_location: str | None
    batches: Sequence[BatchRef]
    losses: Sequence[float]
    grad_norms: Sequence[float]


def _json_float(value: float) -> float | None:
    return value if math.isfinite(value) else None


def write_bundle(checkpoint_dir: Path, anomaly: Anomaly) -> None:
    """Write one bundle and prune this rank's oldest. Best effort: a failure is logged, never raised."""
    folder = checkpoint_dir / FORENSICS_DIR
    bundle = {
        "step": anomaly.step,
        "iteration": anomaly.iteration,
        "rank": anomaly.rank,
        "time": time.time(),
        "reason": anomaly.reason,
        "loss": _json_float(anomaly.loss),
        "grad_norm": _json_float(anomaly.grad_norm),
        "explosion_pattern": anomaly.explosion_pattern,
        "nan_location": anomaly.nan_location,
        "batches": [
            {"epoch": b.epoch, "index": b.index, "sample_ids": list(b.sample_ids)} for b in anomaly.batches
        ],
        "losses": list(anomaly.losses)[-HISTORY_KEPT:],
        "grad_norms": list(anomaly.grad_norms)[-HISTORY_KEPT:],
    }
    name = f"step-{anomaly.step:010d}-iter-{anomaly.iteration:010d}-rank{anomaly.rank}.json"
    try:
        with fs.open_side_dir(checkpoint_dir, FORENSICS_DIR) as folder_fd:
            fs.replace_file(folder_fd, name, json.dumps(bundle, indent=1).encode())
            mine = sorted(
                n
                for n, _ in fs.entries(folder_fd)
                if n.startswith("step-") and n.endswith(f"-rank{anomaly.rank}.json")
            )
            for old in mine[:-FORENSICS_KEEP]:
                fs.unlink(folder_fd, old)
    except (CheckpointError, OSError) as exc:
        log.warning("could not write the forensic bundle %s: %s", folder / name, exc)

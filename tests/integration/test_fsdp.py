"""A small transformer sharded with FSDP2 (and HSDP) over real gloo ranks, under the guardian: the global
gradient norm, skips and rollbacks taken by every rank alike, sharded checkpoints, and resuming them
bit-identically at the same world size and at another one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import FSDP_WORKER, run_gang, successful_reports

pytestmark = pytest.mark.slow

SETTINGS = {"checkpoint": {"everySteps": 4, "snapshotEverySteps": 2}, "guard": {"spikeMinHistory": 50}}


def gang(ckpt: Path, world_size: int, args: list[str], faults: str = "") -> list[dict[str, Any]]:
    results = run_gang(ckpt, world_size, args, faults=faults, settings=SETTINGS, worker=FSDP_WORKER)
    return successful_reports(results)


def test_fsdp_nan_loss_on_one_rank_makes_every_rank_skip_and_the_norm_is_the_global_one(
    tmp_path: Path,
) -> None:
    reports = gang(tmp_path, 2, ["--steps", "10", "--norm-check-step", "3"], faults="nan_loss@6:1")
    for report in reports:
        assert report["skipped_steps"] == 1
        assert report["step"] == 10
        # torch's own norm of the DTensor gradients (its collective) against the guardian's one sum
        assert report["guardian_norm"] == pytest.approx(report["reference_norm"], rel=1e-6)
    assert len({report["digest"] for report in reports}) == 1


def test_hsdp_an_infinite_gradient_in_one_shard_makes_every_rank_skip(tmp_path: Path) -> None:
    # Rank 3 alone holds the poisoned shard; its replica (rank 1) and the other shard group see a finite
    # local norm: only the step's one collective tells them.
    args = ["--shard", "hsdp", "--steps", "6", "--norm-check-step", "2"]
    reports = gang(tmp_path, 4, args, faults="inf_grad@4:3")
    for report in reports:
        assert report["skipped_steps"] == 1
        assert report["step"] == 6
        # a shard held by two replicas counts once in the global norm
        assert report["guardian_norm"] == pytest.approx(report["reference_norm"], rel=1e-6)


def test_fsdp_rollback_restores_every_shard_on_every_rank(tmp_path: Path) -> None:
    reports = gang(tmp_path, 2, ["--steps", "10"], faults="nan_loss@5x3:0")
    for report in reports:
        assert report["rollbacks"] == 1
        assert report["rollbacks_checked"] == [True]  # each rank's shards, byte for byte, as snapshotted

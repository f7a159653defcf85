"""Two real ranks over gloo: every decision of the guardian is the same on every rank."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests.support.procs import run_gang, successful_reports
from trainer_sidecar.checkpoint import CheckpointStore, data_file_name
from trainer_sidecar.contract.exitcodes import ExitCode

pytestmark = pytest.mark.slow

SETTINGS = {"checkpoint": {"everySteps": 10, "snapshotEverySteps": 5}, "guard": {"spikeMinHistory": 5}}


def test_nan_on_one_rank_makes_every_rank_skip(tmp_path: Path) -> None:
    reports = successful_reports(
        run_gang(tmp_path, 2, ["--steps", "20"], faults="nan_loss@7:1", settings=SETTINGS)
    )
    for report in reports:
        assert report["skipped_steps"] == 1
        assert report["step"] == 20
    assert reports[0]["digest"] == reports[1]["digest"]


def test_loss_spike_on_one_rank_is_skipped_by_both(tmp_path: Path) -> None:
    reports = successful_reports(
        run_gang(tmp_path, 2, ["--steps", "20"], faults="loss_spike@12:0", settings=SETTINGS)
    )
    assert reports[0]["skipped_steps"] == reports[1]["skipped_steps"] >= 1
    assert reports[0]["digest"] == reports[1]["digest"]


def test_rollback_happens_on_every_rank_together(tmp_path: Path) -> None:
    reports = successful_reports(
        run_gang(tmp_path, 2, ["--steps", "20"], faults="nan_loss@7x3:0", settings=SETTINGS)
    )
    for report in reports:
        assert report["rollbacks"] == 1
        assert report["lr_scale"] == pytest.approx(0.5)
    assert reports[0]["digest"] == reports[1]["digest"]


def test_divergence_ends_every_rank_with_the_diverged_code(tmp_path: Path) -> None:
    settings = {"guard": {"maxRollbacks": 1, "maxConsecutiveBadSteps": 2}}
    results = run_gang(tmp_path, 2, ["--steps", "30"], faults="nan_loss@3x6:1", settings=settings)
    assert [code for code, _, _ in results] == [ExitCode.DIVERGED, ExitCode.DIVERGED]


def test_ranks_agree_on_the_checkpoint_to_resume_when_one_rank_file_is_corrupt(tmp_path: Path) -> None:
    first = run_gang(tmp_path, 2, ["--steps", "20"], settings=SETTINGS)
    assert [code for code, _, _ in first] == [0, 0]
    newest_id = CheckpointStore(tmp_path).resolve(20)  # written under the gang's epoch
    assert newest_id is not None
    newest = tmp_path / newest_id.dir_name / data_file_name(1)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    second = run_gang(tmp_path, 2, ["--steps", "25"], settings=SETTINGS)
    reports = successful_reports(second)
    # The gang's decisions are logged once, by rank 0 (the other ranks log them at debug level).
    assert "resumed from the clean checkpoint at step 10" in second[0][2]
    assert "SHA-256 does not match" in second[1][2]
    assert [r["step"] for r in reports] == [25, 25]
    assert reports[0]["digest"] == reports[1]["digest"]


def test_every_steps_auto_checkpoints_every_rank_at_the_same_steps(tmp_path: Path) -> None:
    """Rank 0 chooses the interval from its own timings; the choice travels in the step's collective, so
    both ranks write every checkpoint (each verified with both ranks' files) and end alike."""
    settings = {
        "checkpoint": {
            "everySteps": "auto",
            "everySeconds": None,
            "autoFirstSeconds": 1,
            "autoMinSteps": 3,
            "autoMaxSteps": 5,
            "keepClean": 5,
            "snapshotEverySteps": 1000,
        }
    }
    reports = successful_reports(
        run_gang(tmp_path, 2, ["--steps", "60", "--step-sleep", "0.05"], settings=settings)
    )
    assert reports[0]["digest"] == reports[1]["digest"]
    store = CheckpointStore(tmp_path)
    steps = store.steps()
    assert steps[-1] == 60
    assert len(steps) == 5
    for step in steps:  # both ranks' files, verified: the ranks checkpointed the same steps
        assert store.is_complete(step), step
        for rank in (0, 1):
            assert CheckpointStore(tmp_path, rank=rank, world_size=2).verify(step).valid, (step, rank)
    gaps = [b - a for a, b in itertools.pairwise(steps[:-1])]  # the last one is the declared end
    assert gaps
    assert all(3 <= gap <= 5 for gap in gaps), steps

"""The end of a run written as users write loops (issue 21), in real processes and a real gloo gang:
the loop's step number cannot drift after a rollback, a forgotten ``finish()`` loses nothing, an
unhandled exception is never reported finished, and a finished job rerun trains nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.ports import free_port
from tests.support.procs import finish, start_worker, worker_env
from trainer_sidecar.checkpoint import CheckpointStore

pytestmark = pytest.mark.slow

SETTINGS = {"checkpoint": {"everySteps": 4, "snapshotEverySteps": 4}}
# Rank 1's loss is NaN at steps 5, 6 and 7: the gang rolls back from step 8 to the snapshot of step 4.
NAN_BURST = "nan_loss@5x3:1"


def run(ckpt: Path, args: list[str], world_size: int = 1, faults: str = "") -> list[dict[str, Any]]:
    """Run the test worker as one process or a gang; each rank's exit code, report, stderr and status."""
    port = free_port()
    statuses = [ckpt.parent / f"{ckpt.name}-status-{rank}.json" for rank in range(world_size)]
    procs = [
        start_worker(
            ["--steps", "10", *args],
            worker_env(
                ckpt,
                rank=rank,
                world_size=world_size,
                port=port,
                faults=faults,
                settings=SETTINGS,
                status_file=statuses[rank],
            ),
        )
        for rank in range(world_size)
    ]
    results = []
    for proc, status in zip(procs, statuses, strict=True):
        code, report, err = finish(proc)
        results.append({"code": code, "report": report, "err": err, "status": json.loads(status.read_text())})
    return results


def steps_on_disk(ckpt: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in ckpt.glob("step-*"))


def test_a_single_loop_that_forgets_finish_saves_its_last_step_and_finishes_at_exit(tmp_path: Path) -> None:
    (only,) = run(tmp_path / "ckpt", ["--loop", "own"])
    assert only["code"] == 0, only["err"][-3000:]
    assert CheckpointStore(tmp_path / "ckpt").newest_valid() == 10  # cadence alone: 8
    assert only["status"]["phase"] == "finished"
    assert only["status"]["step"] == 10


def test_an_unhandled_exception_after_the_loop_is_never_reported_finished(tmp_path: Path) -> None:
    (only,) = run(tmp_path / "ckpt", ["--loop", "own", "--raise-after-loop"])
    assert only["code"] == 1
    assert "the loop's epilogue failed" in only["err"]
    assert only["status"]["phase"] != "finished"
    assert CheckpointStore(tmp_path / "ckpt").newest_valid() == 8  # no final checkpoint
    # It says where it failed and why (the step exact, not the last periodic report): the executor
    # compares that with the next attempt's failure.
    status = only["status"]
    assert (status["phase"], status["step"], status["exit_code"]) == ("failed", 10, 1)
    assert re.fullmatch(
        r"RuntimeError: the loop's epilogue failed \(at tiny_train\.py:\d+\)", status["message"]
    )


def test_a_gang_with_a_declared_end_finishes_at_exit_without_a_collective(tmp_path: Path) -> None:
    # The worker destroys its process group before exiting: nothing at exit may need a peer.
    ranks = run(tmp_path / "ckpt", ["--loop", "own", "--declare-max"], world_size=2)
    for rank in ranks:
        assert rank["code"] == 0, rank["err"][-3000:]
        assert rank["status"]["phase"] == "finished"
    # Written at the step boundary that reached max_steps, on both ranks (newest_valid checks both).
    assert CheckpointStore(tmp_path / "ckpt", world_size=2).newest_valid() == 10


def test_a_gang_loop_counter_of_its_own_drifts_and_exits_1_then_a_restart_completes(tmp_path: Path) -> None:
    drifted = run(tmp_path / "ckpt", ["--loop", "own", "--declare-max"], world_size=2, faults=NAN_BURST)
    for rank in drifted:
        assert rank["code"] == 1, rank["err"][-3000:]
        assert rank["report"]["step"] < 10  # the loop's counter said 10: it ran ahead of the model
        assert rank["status"]["phase"] == "failed"
        assert "without guardian.finish()" in rank["status"]["message"]
    assert "a loop that counts its own steps must take guardian.step_count" in drifted[0]["err"]
    restarted = run(tmp_path / "ckpt", ["--loop", "own", "--declare-max"], world_size=2, faults=NAN_BURST)
    for rank in restarted:
        assert rank["code"] == 0, rank["err"][-3000:]
        assert rank["report"]["step"] == 10
        assert rank["status"]["phase"] == "finished"


def test_guardian_steps_keeps_the_loop_in_step_with_the_model_after_a_rollback(tmp_path: Path) -> None:
    ranks = run(tmp_path / "ckpt", ["--loop", "steps"], world_size=2, faults=NAN_BURST)
    for rank in ranks:
        assert rank["code"] == 0, rank["err"][-3000:]
        assert rank["report"]["rollbacks"] == 1
        assert rank["report"]["step"] == 10  # every step asked for is kept
        assert rank["report"]["iterations"] == 14  # 0..7, back to 4, 4..9
        assert rank["status"]["phase"] == "finished"
    assert ranks[0]["report"]["digest"] == ranks[1]["report"]["digest"]
    assert CheckpointStore(tmp_path / "ckpt", world_size=2).newest_valid() == 10


def test_rerunning_a_finished_job_trains_nothing(tmp_path: Path) -> None:
    # nanoGPT's loop tests its end after the step: without a declared end each rerun trained one more.
    first = run(tmp_path / "ckpt", ["--loop", "dowhile", "--declare-max"])[0]
    assert first["code"] == 0, first["err"][-3000:]
    on_disk = steps_on_disk(tmp_path / "ckpt")
    assert on_disk[-1] == 10
    again = run(tmp_path / "ckpt", ["--loop", "dowhile", "--declare-max"])[0]
    assert again["code"] == 0, again["err"][-3000:]
    assert again["report"]["step"] == 10
    assert again["report"]["digest"] == first["report"]["digest"]
    assert steps_on_disk(tmp_path / "ckpt") == on_disk  # no new checkpoint
    assert again["status"]["phase"] == "finished"

"""Two real ranks over gloo: a rank busy with its own evaluation makes the other report that it waits for
it (so neither looks hung), and a gang told to stop checkpoints at one step and resumes from it."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.ports import free_port
from tests.support.procs import finish, start_worker, successful_reports, worker_env
from trainer_sidecar.checkpoint import CheckpointStore
from trainer_sidecar.contract.status import Phase, WorkerStatus, read_status
from trainer_sidecar.guardian.busy import EVAL_MODE_REASON

pytestmark = pytest.mark.slow

SETTINGS: dict[str, Any] = {"checkpoint": {"everySteps": 1000, "snapshotEverySteps": 5}}


def start_gang(tmp_path: Path, args: list[str]) -> list[subprocess.Popen[str]]:
    port = free_port()
    envs = [
        worker_env(
            tmp_path / "ckpt",
            rank=rank,
            world_size=2,
            port=port,
            settings=SETTINGS,
            status_file=tmp_path / f"status-{rank}.json",
        )
        for rank in range(2)
    ]
    return [start_worker(args, env) for env in envs]


def poll_status(path: Path, until: float, wanted: Phase) -> WorkerStatus | None:
    while time.monotonic() < until:
        status, _ = read_status(path)
        if status is not None and status.phase is wanted:
            return status
        time.sleep(0.2)
    return None


def test_a_rank_waiting_for_a_busy_peer_reports_that_it_waits(tmp_path: Path) -> None:
    # Rank 0's evaluation lasts until the test has seen what it looks for (90 s at most), however slowly a
    # loaded machine lets rank 1 notice.
    release = tmp_path / "release"
    args = ["--steps", "12", "--busy-at", "5", "--busy-rank", "0", "--busy-seconds", "90"]
    gang = start_gang(tmp_path, [*args, "--busy-until", str(release)])
    try:
        deadline = time.monotonic() + 120
        evaluating = poll_status(tmp_path / "status-0.json", deadline, Phase.BUSY)
        waiting = poll_status(tmp_path / "status-1.json", deadline, Phase.BUSY)
    finally:
        release.touch()
        results = [finish(proc, timeout=120) for proc in gang]
    successful_reports(results)
    assert evaluating is not None
    assert evaluating.busy_reason == "eval"
    assert evaluating.busy_seconds == 150
    assert waiting is not None, "rank 1 never said it was waiting"
    assert waiting.busy_reason == "waiting for rank 0: eval"
    assert waiting.busy_seconds is not None
    assert 1 <= waiting.busy_seconds <= 150
    assert waiting.step == 5


def test_a_rank_waiting_for_a_peer_evaluating_in_eval_mode_reports_that_it_waits(tmp_path: Path) -> None:
    """As above, but rank 0 evaluates as real loops do (model.eval() ... model.train(), no guardian.busy):
    its guardian infers the evaluation, and announces it to rank 1 as a declared one."""
    release = tmp_path / "release"
    args = ["--steps", "12", "--busy-at", "5", "--busy-rank", "0", "--busy-seconds", "90", "--busy-eval-mode"]
    gang = start_gang(tmp_path, [*args, "--busy-until", str(release)])
    try:
        deadline = time.monotonic() + 120
        evaluating = poll_status(tmp_path / "status-0.json", deadline, Phase.BUSY)
        waiting = poll_status(tmp_path / "status-1.json", deadline, Phase.BUSY)
    finally:
        release.touch()
        results = [finish(proc, timeout=120) for proc in gang]
    successful_reports(results)
    assert evaluating is not None
    assert evaluating.busy_reason == EVAL_MODE_REASON
    assert evaluating.busy_seconds is None  # unbounded, as busy("eval"): the startup grace
    assert waiting is not None, "rank 1 never said it was waiting"
    assert waiting.busy_reason == f"waiting for rank 0: {EVAL_MODE_REASON}"
    assert waiting.step == 5


def test_a_gang_told_to_stop_checkpoints_at_one_step_and_resumes_there(tmp_path: Path) -> None:
    gang = start_gang(tmp_path, ["--steps", "400", "--step-sleep", "0.05"])
    assert poll_status(tmp_path / "status-0.json", time.monotonic() + 90, Phase.RUNNING) is not None
    time.sleep(2)
    for proc in gang:
        proc.send_signal(signal.SIGTERM)
    results = [finish(proc, timeout=60) for proc in gang]
    assert [code for code, _, _ in results] == [128 + signal.SIGTERM] * 2, [
        err[-2000:] for _, _, err in results
    ]
    statuses = [read_status(tmp_path / f"status-{rank}.json")[0] for rank in range(2)]
    assert all(s is not None and s.phase is Phase.STOPPED for s in statuses)
    steps = {s.step for s in statuses if s is not None}
    assert len(steps) == 1  # every rank stopped at the same boundary
    (stopped_at,) = steps
    assert 0 < stopped_at < 400
    assert CheckpointStore(tmp_path / "ckpt").newest_valid() == stopped_at
    # The rerun continues from the stop's checkpoint, not from an older one.
    again = start_gang(tmp_path, ["--steps", str(stopped_at + 5)])
    reports = successful_reports([finish(proc, timeout=120) for proc in again])
    assert [r["step"] for r in reports] == [stopped_at + 5] * 2

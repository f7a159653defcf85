"""SIGKILL at random steps, resume, and end with weights bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest

from tests.support.procs import finish, start_worker, worker_env
from trainer_sidecar.contract.status import read_status

pytestmark = pytest.mark.slow

STEPS = 60
SETTINGS = {"checkpoint": {"everySteps": 4, "snapshotEverySteps": 4}, "statusIntervalSeconds": 0}


def wait_for_step(status_file: Path, step: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        status, _ = read_status(status_file)
        if status is not None and status.step >= step:
            return
        time.sleep(0.005)
    raise AssertionError(f"worker never reached step {step}")


def test_sigkill_at_three_random_steps_resumes_bit_identically(tmp_path: Path) -> None:
    args = ["--steps", str(STEPS), "--step-sleep", "0.02"]
    code, reference, err = finish(start_worker(args, worker_env(tmp_path / "reference", settings=SETTINGS)))
    assert code == 0, err
    assert reference is not None

    seed = random.randrange(1 << 30)
    kill_steps = sorted(random.Random(seed).sample(range(3, STEPS - 3), 3))
    ckpt, status_file = tmp_path / "killed", tmp_path / "status.json"
    env = worker_env(ckpt, settings=SETTINGS, status_file=status_file)
    for step in kill_steps:
        status_file.unlink(missing_ok=True)
        proc = start_worker(args, env)
        wait_for_step(status_file, step, time.monotonic() + 60)
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL
    code, resumed, err = finish(start_worker(args, env))
    assert code == 0, err
    assert "resumed from the clean checkpoint" in err
    assert resumed is not None
    assert resumed["step"] == STEPS
    assert resumed["digest"] == reference["digest"], f"kill steps {kill_steps} (seed {seed})"
    assert json.loads(json.dumps(resumed))["skipped_steps"] == 0


def test_injected_crash_fires_once_and_the_job_completes(tmp_path: Path) -> None:
    env = worker_env(tmp_path, settings=SETTINGS, faults="crash@10")
    code, _, _ = finish(start_worker(["--steps", "20"], env))
    assert code == -signal.SIGKILL
    code, report, err = finish(start_worker(["--steps", "20"], env))
    assert code == 0, err
    assert report is not None
    assert report["step"] == 20


def test_injected_hang_stops_step_progress_on_that_rank(tmp_path: Path) -> None:
    status_file = tmp_path / "status.json"
    env = worker_env(tmp_path / "ckpt", settings=SETTINGS, faults="hang@5", status_file=status_file)
    proc = start_worker(["--steps", "20"], env)
    try:
        wait_for_step(status_file, 5, time.monotonic() + 60)
        time.sleep(1.0)
        status, _ = read_status(status_file)
        assert status is not None
        assert status.step == 5
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.communicate()


AUTO = {
    "checkpoint": {
        "everySteps": "auto",
        "everySeconds": None,
        "autoFirstSeconds": 1,
        "autoMinSteps": 3,
        "autoMaxSteps": 6,
        "assumedMtbfSeconds": 60,
        "snapshotEverySteps": 1000,
    },
    "statusIntervalSeconds": 0,
}


def test_every_steps_auto_checkpoints_and_resumes_bit_identically(tmp_path: Path) -> None:
    """The checkpoints of everySteps auto fall where the measured costs put them, not where a fixed
    cadence would: killed twice after its first checkpoint, the job still ends bit-identical to an
    uninterrupted run checkpointed every 4 steps (a checkpoint's content does not depend on its step)."""
    steps = 100
    args = ["--steps", str(steps), "--step-sleep", "0.05"]
    code, reference, err = finish(start_worker(args, worker_env(tmp_path / "reference", settings=SETTINGS)))
    assert code == 0, err
    assert reference is not None

    seed = random.randrange(1 << 30)
    # Each attempt's first checkpoint comes after a second (about 20 steps), then auto's interval: the
    # second kill comes long enough after the first for its attempt to have chosen one too.
    rng = random.Random(seed)
    first = rng.randrange(35, 45)
    kills = [first, rng.randrange(first + 35, steps - 5)]
    ckpt, status_file = tmp_path / "auto", tmp_path / "status.json"
    env = worker_env(ckpt, settings=AUTO, status_file=status_file)
    chosen = []
    for step in kills:
        status_file.unlink(missing_ok=True)
        proc = start_worker(args, env)
        wait_for_step(status_file, step, time.monotonic() + 60)
        status, _ = read_status(status_file)
        assert status is not None
        chosen.append((status.checkpoint_every_steps, status.checkpoint_cadence))
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    for interval, cadence in chosen:
        assert interval is not None, cadence
        assert 3 <= interval <= 6, cadence
        assert cadence.startswith(f"auto: every {interval} steps (save "), cadence
    code, resumed, err = finish(start_worker(args, env))
    assert code == 0, err
    assert "resumed from the clean checkpoint" in err
    assert resumed is not None
    assert resumed["step"] == steps
    assert resumed["digest"] == reference["digest"], f"kill steps {kills} (seed {seed})"

"""``trainguard run`` at the default health settings: a pause the guardian can see is no hang, and a hang
still is one.

The defaults (``hangTimeoutSeconds`` 300, ``hangTimeoutFloorSeconds`` 10, ``probePeriodSeconds`` 10):
after a warm-up of 20 published gaps (about 10 s of fast steps) the sidecar judges a running worker by the
learned timeout, the floor here. A 20 s epoch start (the loader's worker re-spawned, its
``worker_init_fn``) and a step grown 300x (0.05 s to 15 s of compute) are longer than that, and were
judged hung, on every attempt. Real worker processes, gloo, sidecars and the real policy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import procs

pytestmark = pytest.mark.slow


def default_health_job(
    tmp_path: Path, args: list[str], *, faults: str = "", replicas: int = 2, every_steps: int = 25
) -> Path:
    """A job of ``replicas`` tiny_train workers with ``args`` and a checkpoint every ``every_steps``, with
    no health settings: the defaults."""
    document: dict[str, Any] = {
        "apiVersion": "trainguard.dev/v1alpha1",
        "kind": "GuardedTrainingJob",
        "metadata": {"name": "pauses", "namespace": "default"},
        "spec": {
            "replicas": replicas,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "pytorch",
                            "image": "unused",
                            "command": ["python", str(procs.WORKER), *args],
                            "env": [{"name": "TRAINGUARD_FAULTS", "value": faults}],
                        }
                    ]
                }
            },
            "checkpoint": {"claimName": "ckpt", "everySteps": every_steps, "snapshotEverySteps": 25},
            "recovery": {"maxRestarts": 2, "backoffSeconds": [1]},
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def run(tmp_path: Path, job_file: Path, timeout: float = 420) -> tuple[int, dict[str, Any], str]:
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "run", str(job_file), "--run-dir", str(tmp_path / "run"),
         "--summary", str(summary), "--plain"],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    data = json.loads(summary.read_text()) if summary.exists() else {}
    return proc.returncode, data, proc.stdout + proc.stderr


def test_a_20_s_epoch_start_at_every_epoch_trains_to_success(tmp_path: Path) -> None:
    """384 samples over 2 ranks in batches of 8: 24 steps an epoch, 0.5 s each (about 12 s: the warm-up
    is over), then the next epoch's loader worker takes 20 s to start, twice after the warm-up."""
    args = ["--steps", "50", "--samples", "384", "--step-sleep", "0.5", "--epoch-start-seconds", "20"]
    code, summary, output = run(tmp_path, default_health_job(tmp_path, args))
    assert code == 0, output
    assert summary["result"] == "succeeded", summary
    assert summary["restarts"] == [], summary["restarts"]
    assert summary["final_step"] == 50


def test_steps_grown_300x_train_to_success_and_a_hang_after_them_is_caught_within_30_s(
    tmp_path: Path,
) -> None:
    """Steps of 0.05 s, then from step 290 two steps of 15 s of compute in the forward pass (300x), then
    fast steps again until rank 1 hangs in its forward pass at step 340 (the ``hang`` fault sleeps). The
    checkpoint at step 200 is far enough before the switch that a run resumed from it has learned its
    pace again when it comes (as on main, where every attempt was killed there). The long steps cost
    nothing, and the hang is caught at the learned timeout, within 30 s of its last step."""
    args = ["--steps", "380", "--step-sleep", "0.05", "--long-steps-from", "290", "--long-steps", "2",
            "--long-step-seconds", "15"]  # fmt: skip
    job_file = default_health_job(tmp_path, args, faults="hang@340:1", every_steps=100)
    code, summary, output = run(tmp_path, job_file)
    assert code == 0, output
    assert summary["result"] == "succeeded", summary
    (restart,) = summary["restarts"]
    assert "rank 1 hung" in restart["reason"], restart
    assert "learned from its pace, at most 300 s" in restart["reason"], restart  # not the ceiling
    assert restart["last_step"] is not None, restart
    assert restart["last_step"] > 291, restart
    assert restart["detect_seconds"] <= 30, restart
    assert summary["final_step"] == 380

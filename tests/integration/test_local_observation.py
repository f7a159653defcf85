"""What ``trainguard run`` reports of a gang it restarted, with real workers and sidecars: the restart's
figures come from the step the next attempt really resumed from."""

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


def hang_job(path: Path) -> Path:
    """Two ranks, a checkpoint every 5 steps, rank 1 hangs before step 17 (after the checkpoint at 15)."""
    command = ["python", str(procs.WORKER), "--steps", "30", "--step-sleep", "0.1"]
    faults = [{"name": "TRAINGUARD_FAULTS", "value": "hang@17:1"}]
    container: dict[str, Any] = {"name": "pytorch", "image": "unused", "command": command, "env": faults}
    document: dict[str, Any] = {
        "apiVersion": "trainguard.dev/v1alpha1",
        "kind": "GuardedTrainingJob",
        "metadata": {"name": "observed"},
        "spec": {
            "replicas": 2,
            "template": {"spec": {"containers": [container]}},
            "checkpoint": {"claimName": "ckpt", "everySteps": 5, "snapshotEverySteps": 5},
            "health": {"hangTimeoutSeconds": 3, "startupGraceSeconds": 60, "probePeriodSeconds": 1},
            "recovery": {"maxRestarts": 2, "backoffSeconds": [1]},
        },
    }
    job = path / "job.yaml"
    job.write_text(yaml.safe_dump(document))
    return job


def test_a_restart_after_a_hang_reports_the_step_the_gang_resumed_from(tmp_path: Path) -> None:
    summary_file = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "run", str(hang_job(tmp_path)), "--run-dir",
         str(tmp_path / "run"), "--summary", str(summary_file), "--plain"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(summary_file.read_text())
    [restart] = summary["restarts"]
    assert restart["resumed_step"] == 15  # the clean checkpoint before the hang
    last = restart["last_step"]
    assert last is not None
    assert last <= 17
    assert restart["redone_steps"] == max(0, last - 15)
    assert 0 < summary["kept_seconds"] <= summary["wall_seconds"]
    assert 0 < summary["goodput"] <= 1
    recovered = [e for e in summary["timeline"] if e["kind"] == "recovered"]
    assert len(recovered) == 1
    assert "resumed from step 15" in recovered[0]["message"]
    # The checkpoint attempt 2 resumed from is not announced again as a new one.
    later = [e["step"] for e in summary["timeline"] if e["kind"] == "checkpoint" and e["attempt"] == 2]
    assert later
    assert min(later) > 15
    assert summary["final_step"] == 30

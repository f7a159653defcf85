"""A ``trainguard run`` job for the end-to-end tests: a GuardedTrainingJob file of the test worker with
the faults, recovery, guard and health a scenario sets (``job``), and one run of the CLI on it with its
summary read back (``run``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.support import procs

WORKER = str(procs.WORKER)


def job(
    tmp_path: Path,
    *,
    steps: int = 40,
    faults: str = "",
    replicas: int = 2,
    recovery: dict[str, Any] | None = None,
    guard: dict[str, Any] | None = None,
    hang_timeout: int = 3,
    step_sleep: float = 0.05,
    nproc_per_node: int = 1,
    namespace: str = "default",
    extra_args: tuple[str, ...] = (),
    health: dict[str, Any] | None = None,
) -> Path:
    """Write a GuardedTrainingJob of the test worker (two replicas, 40 steps, a checkpoint every 5) with
    what the scenario sets under ``tmp_path``; returns its path."""
    document = {
        "apiVersion": "trainguard.dev/v1alpha1",
        "kind": "GuardedTrainingJob",
        "metadata": {"name": "test-job", "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "nprocPerNode": nproc_per_node,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "pytorch",
                            "image": "unused",
                            "command": [
                                "python",
                                WORKER,
                                "--steps",
                                str(steps),
                                "--step-sleep",
                                str(step_sleep),
                                *extra_args,
                            ],
                            "env": [{"name": "TRAINGUARD_FAULTS", "value": faults}],
                        }
                    ]
                }
            },
            "checkpoint": {"claimName": "ckpt", "everySteps": 5, "snapshotEverySteps": 5},
            "guard": guard or {},
            "health": {
                "hangTimeoutSeconds": hang_timeout,
                "startupGraceSeconds": 60,
                "probePeriodSeconds": 1,
                **(health or {}),
            },
            "recovery": recovery or {"maxRestarts": 3, "backoffSeconds": [1, 2]},
        },
    }
    path = tmp_path / "job.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document))
    return path


def run(tmp_path: Path, job_file: Path, *extra: str, timeout: float = 240) -> tuple[int, dict[str, Any], str]:
    """Run ``trainguard run`` on ``job_file`` (its run directory under ``tmp_path``); returns its exit code,
    its summary (empty when none was written) and its output."""
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "run", str(job_file), "--run-dir", str(tmp_path / "run"),
         "--summary", str(summary), "--plain", *extra],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    data = json.loads(summary.read_text()) if summary.exists() else {}
    return proc.returncode, data, proc.stdout + proc.stderr

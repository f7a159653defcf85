"""Time to recover under ``trainguard run``: a crashed rank, restarted cold and in warm spares, side by side.

The README's demo model (``examples/tiny_lm/train.py``, two ranks, gloo) runs under the local runner
(``trainguard.local.runner.LocalRunner``, in this process) with one fault, ``crash@STEP:1`` (rank 1
SIGKILLs itself before the step's backward; rank 0 then fails in its collective), a checkpoint every
``--checkpoint-every`` steps and a 1 s backoff. Runs alternate cold (``warm_spares=False``: every
attempt is ``python train.py`` from scratch) and warm (the restart runs in spares that imported torch
while attempt 1 trained), ``--runs`` of each.

Phases of the one recovery, all on this machine's wall clock:

- ``detect_s``: the last step rank 0 logged in attempt 1 to the runner's failure decision;
- ``stop_s``: that decision to the old gang being stopped (the ``restart`` event);
- ``start_s``: the end of the backoff to the first step rank 0 logs in attempt 2; within it
  ``to_rendezvous_s`` (to rank 0's first log line, just after the gloo rendezvous and reading the
  corpus: interpreter and imports, or the handoff), ``to_guardian_s`` (to the guardian's creation in
  rank 0, the status file's ``started_at``: model, DDP, optimizer too) and ``guardian_to_step_s``
  (resume from the checkpoint, the example's held-out loss on rank 0, the first step);
- ``recover_s``: the last step of attempt 1 to the first of attempt 2, the backoff excluded
  (``detect_s + stop_s + start_s``). The goal for warm spares is ``recover_s`` <= 2 s.

Rank 0 logs every step (``--log-every 1``) with millisecond timestamps; those lines are the steps'
times. The last line is one JSON object: every run, the medians per mode, and ``warm_over_cold`` (the
median ``recover_s`` ratio).

    python -m bench.recovery_local [--runs 2] [--steps 120] [--crash-step 70]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from trainer_sidecar.contract.status import read_status
from trainguard.core.spec import parse_job
from trainguard.local.runner import LocalRunner

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "tiny_lm" / "train.py"
BACKOFF_SECONDS = 1
GOAL_RECOVER_S = 2.0
_STEP_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \[rank 0\] tiny_lm: step (\d+) loss")


def job_document(steps: int, crash_step: int, checkpoint_every: int) -> dict[str, Any]:
    """The demo job (examples/local/job.yaml) shortened: one crash of rank 1, a 1 s backoff."""
    return {
        "apiVersion": "trainguard.dev/v1alpha1",
        "kind": "GuardedTrainingJob",
        "metadata": {"name": "recovery-bench", "namespace": "default"},
        "spec": {
            "replicas": 2,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "pytorch",
                            "image": "unused",
                            "command": ["python", str(TRAIN), "--max-steps", str(steps), "--log-every", "1"],
                            "env": [{"name": "TRAINGUARD_FAULTS", "value": f"crash@{crash_step}:1"}],
                        }
                    ]
                }
            },
            "checkpoint": {"claimName": "ckpt", "everySteps": checkpoint_every, "snapshotEverySteps": 10},
            "health": {"hangTimeoutSeconds": 30, "startupGraceSeconds": 120, "probePeriodSeconds": 1},
            "recovery": {"maxRestarts": 2, "backoffSeconds": [BACKOFF_SECONDS]},
        },
    }


def first_line_time(log: Path, text: str) -> float:
    """When rank 0 first logged a line containing ``text`` (NaN: never)."""
    for line in log.read_text(errors="replace").splitlines():
        if text in line and line[:4].isdigit():
            return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return float("nan")


def step_times(log: Path) -> list[tuple[int, float]]:
    """(step, wall-clock time) of every step line rank 0 logged."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        match = _STEP_LINE.match(line)
        if match:
            stamp = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found.append((int(match[2]), stamp))
    return found


def run_once(scratch: Path, document: dict[str, Any], *, warm: bool) -> dict[str, Any]:
    """One run of the job; its recovery's phases."""
    job = parse_job(document, "bench job")
    runner = LocalRunner(
        job,
        checkpoint_root=scratch / "volumes",
        run_dir=scratch / "run",
        stop_grace_seconds=10.0,
        warm_spares=warm,
    )
    code = runner.run()
    folder = runner.run_folder
    if code != 0 or runner.attempt != 2 or folder is None:
        raise RuntimeError(f"{'warm' if warm else 'cold'} run: exit {code}, {runner.attempt} attempt(s)")
    events = {(e.kind, e.attempt): e for e in runner.events}
    failed = events[("failure", 1)].time
    restarted = events[("restart", 1)].time
    starting = restarted + BACKOFF_SECONDS
    last_step, last_time = step_times(folder / "logs" / "attempt-1-rank-0.log")[-1]
    first_step, first_time = step_times(folder / "logs" / "attempt-2-rank-0.log")[0]
    status, _ = read_status(folder / "attempt-2" / "rank-0" / "status.json")
    guardian = status.started_at if status is not None else float("nan")
    corpus = first_line_time(folder / "logs" / "attempt-2-rank-0.log", "tiny_lm: corpus:")
    return {
        "mode": "warm" if warm else "cold",
        "start_message": events[("start", 2)].message,
        "unready_spares": runner.unready_handoffs,
        "last_step": last_step,
        "first_step": first_step,
        "detect_s": round(failed - last_time, 3),
        "stop_s": round(restarted - failed, 3),
        "start_s": round(first_time - starting, 3),
        "to_rendezvous_s": round(corpus - starting, 3),
        "to_guardian_s": round(guardian - starting, 3),
        "guardian_to_step_s": round(first_time - guardian, 3),
        "recover_s": round(first_time - last_time - BACKOFF_SECONDS, 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job cold and warm, alternately; print each run and the medians (JSON on the last line)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=2, help="runs of each mode (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=120, help="training steps (default: %(default)s)")
    parser.add_argument("--crash-step", type=int, default=70, help="rank 1 crashes (default: %(default)s)")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="(default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="one run of each, 60 steps: a smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.steps, args.crash_step = 1, 60, 40
    if not 0 < args.crash_step < args.steps:
        parser.error("--crash-step must lie within --steps")
    document = job_document(args.steps, args.crash_step, args.checkpoint_every)
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    phases = (
        "detect_s",
        "stop_s",
        "start_s",
        "to_rendezvous_s",
        "to_guardian_s",
        "guardian_to_step_s",
        "recover_s",
    )
    with tempfile.TemporaryDirectory(prefix="trainguard-recovery-local-") as scratch:
        for index in range(args.runs):
            for warm in (False, True):
                started = time.monotonic()
                result = run_once(Path(scratch) / f"{index}-{warm}", document, warm=warm)
                runs[result["mode"]].append(result)
                figures = " ".join(f"{key}={result[key]:.2f}" for key in phases)
                took = time.monotonic() - started
                print(f"{result['mode']} {index}: {figures} ({result['start_message']}; run {took:.0f} s)")
    medians = {
        mode: {key: round(statistics.median(r[key] for r in results), 3) for key in phases}
        for mode, results in runs.items()
    }
    ratio = medians["warm"]["recover_s"] / medians["cold"]["recover_s"]
    print()
    print(f"{'phase (median s)':<22}{'cold':>8}{'warm':>8}")
    for key in phases:
        print(f"{key:<22}{medians['cold'][key]:>8.2f}{medians['warm'][key]:>8.2f}")
    goal = "met" if medians["warm"]["recover_s"] <= GOAL_RECOVER_S else "missed"
    print(f"warm/cold recover_s: {ratio:.2f}; warm recover_s goal <= {GOAL_RECOVER_S} s: {goal}")
    load = os.getloadavg()[0]
    summary = {
        "runs": runs,
        "median": medians,
        "warm_over_cold": round(ratio, 3),
        "goal_recover_s": GOAL_RECOVER_S,
        "goal_met": goal == "met",
        "backoff_s": BACKOFF_SECONDS,
        "load_average": round(load, 2),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

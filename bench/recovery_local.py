"""Time to recover under ``trainguard run``: a crashed and a hung rank, restarted cold and in warm spares.

The README's demo model (``examples/tiny_lm/train.py``, two ranks, gloo) runs under the local runner
(``trainguard.local.runner.LocalRunner``, in this process) with one fault, a checkpoint every
``--checkpoint-every`` steps and a 1 s backoff. Two scenarios: ``crash@STEP:1`` (rank 1 SIGKILLs itself
before the step's backward; rank 0 then fails in its collective) and ``hang@STEP:1`` (rank 1 sleeps in
its own work; rank 0 waits in the step's collective; the sidecar catches it at the learned hang timeout,
whose floor the job sets to ``HANG_FLOOR_SECONDS``). Runs alternate cold (``warm_spares=False``: every
attempt is ``python train.py`` from scratch) and warm (the restart runs in spares that imported torch
while attempt 1 trained), ``--runs`` of each per scenario.

Phases of the one recovery, all on this machine's wall clock:

- ``detect_s``: the last step rank 0 logged in attempt 1 to the runner's failure decision;
- ``stop_s``: that decision to the old gang being stopped (the ``restart`` event; it runs within the
  backoff, which counts from the decision);
- ``wait_s``: what the stop added to the backoff (the runner starts attempt 2 at the later of the
  backoff's end and the old gang's end);
- ``to_corpus_s``: the runner starting attempt 2 to rank 0's first log line (the sidecars' and workers'
  start: a handoff, or an interpreter and its imports; the gloo rendezvous; reading the corpus); within
  it ``launch_s``, to the runner's ``start`` event (the sidecars started and listening, then the workers
  handed off or started);
- ``model_s``: to the example's ``model:`` line (model, DDP, optimizer);
- ``resume_s``: to the example's held-out loss line (the guardian, its resume from the checkpoint, the
  loader, the held-out loss);
- ``first_step_s``: to rank 0's first step in attempt 2;
- ``recover_s``: the last step of attempt 1 to the first of attempt 2, the backoff excluded. Goals for
  warm spares: ``recover_s`` <= 2 s for a crash; ``after_detect_s`` (``recover_s - detect_s``: what the
  restart adds to the detection) <= 2 s for a hang.

Rank 0 logs every step (``--log-every 1``) with millisecond timestamps; those lines are the steps'
times. The last line is one JSON object: every run, the medians per scenario and mode, and per scenario
``warm_over_cold`` (the median ``recover_s`` ratio).

``--demo`` runs the README's demo job instead (``examples/local/job.yaml`` as it is: 600 steps, a NaN
burst, a hang and a crash), cold and warm alternately, and prints what a user of it buys: its goodput
(the share of the run's wall time spent on steps the final model kept, ``trainguard run``'s summary), the
same without the backoffs, and the run's wall time, with the median ``goodput`` ratio warm/cold.

    python -m bench.recovery_local [--runs 2] [--steps 120] [--fault-step 70] [--scenario crash|hang|both]
    python -m bench.recovery_local --demo [--runs 1]
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

import yaml

from trainguard.core.spec import parse_job
from trainguard.local.runner import LocalRunner

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "tiny_lm" / "train.py"
BACKOFF_SECONDS = 1
#: The hang timeout's floor in the hang scenario (the learned timeout of a fast job sits at its floor).
HANG_FLOOR_SECONDS = 5
GOAL_RECOVER_S = 2.0
#: What a hang's restart may add to its detection.
GOAL_AFTER_DETECT_S = 2.0
SCENARIOS = ("crash", "hang")
PHASES = (
    "detect_s",
    "stop_s",
    "wait_s",
    "to_corpus_s",
    "launch_s",
    "model_s",
    "resume_s",
    "first_step_s",
    "recover_s",
    "after_detect_s",
)
_STEP_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \[rank 0\] tiny_lm: step (\d+) loss")


def job_document(steps: int, fault: str, checkpoint_every: int) -> dict[str, Any]:
    """The demo job (examples/local/job.yaml) shortened: one ``fault`` (``TRAINGUARD_FAULTS``), a 1 s
    backoff, a hang timeout's floor of ``HANG_FLOOR_SECONDS``."""
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
                            "env": [{"name": "TRAINGUARD_FAULTS", "value": fault}],
                        }
                    ]
                }
            },
            "checkpoint": {"claimName": "ckpt", "everySteps": checkpoint_every, "snapshotEverySteps": 10},
            "health": {
                "hangTimeoutSeconds": 30,
                "hangTimeoutFloorSeconds": HANG_FLOOR_SECONDS,
                "startupGraceSeconds": 120,
                "probePeriodSeconds": 1,
            },
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


class TimedRunner(LocalRunner):
    """The local runner, noting when it begins starting each attempt's gang (the backoff over)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.starting: dict[int, float] = {}

    def _start_workers(self) -> None:
        self.starting[self.attempt] = time.time()
        super()._start_workers()


def run_once(scratch: Path, document: dict[str, Any], *, scenario: str, warm: bool) -> dict[str, Any]:
    """One run of the job; its recovery's phases."""
    job = parse_job(document, "bench job")
    runner = TimedRunner(
        job,
        checkpoint_root=scratch / "volumes",
        run_dir=scratch / "run",
        stop_grace_seconds=10.0,
        warm_spares=warm,
    )
    code = runner.run()
    folder = runner.run_folder
    mode = "warm" if warm else "cold"
    if code != 0 or runner.attempt != 2 or folder is None:
        raise RuntimeError(f"{scenario} {mode} run: exit {code}, {runner.attempt} attempt(s)")
    events = {(e.kind, e.attempt): e for e in runner.events}
    failed = events[("failure", 1)].time
    restarted = events[("restart", 1)].time
    started = events[("start", 2)].time
    last_step, last_time = step_times(folder / "logs" / "attempt-1-rank-0.log")[-1]
    log = folder / "logs" / "attempt-2-rank-0.log"
    first_step, first_time = step_times(log)[0]
    corpus = first_line_time(log, "tiny_lm: corpus:")
    model = first_line_time(log, "tiny_lm: model:")
    heldout = first_line_time(log, "held-out loss")
    recover = first_time - last_time - BACKOFF_SECONDS
    return {
        "scenario": scenario,
        "mode": mode,
        "start_message": events[("start", 2)].message,
        "failure": events[("failure", 1)].message,
        "unready_spares": runner.unready_handoffs,
        "last_step": last_step,
        "first_step": first_step,
        "detect_s": round(failed - last_time, 3),
        "stop_s": round(restarted - failed, 3),
        "wait_s": round(runner.starting[2] - failed - BACKOFF_SECONDS, 3),
        "to_corpus_s": round(corpus - runner.starting[2], 3),
        "launch_s": round(started - runner.starting[2], 3),
        "model_s": round(model - corpus, 3),
        "resume_s": round(heldout - model, 3),
        "first_step_s": round(first_time - heldout, 3),
        "recover_s": round(recover, 3),
        "after_detect_s": round(recover - (failed - last_time), 3),
    }


DEMO_JOB = ROOT / "examples" / "local" / "job.yaml"
#: What ``--demo`` prints per run, from the run's summary.
DEMO_FIGURES = ("goodput", "goodput_excluding_backoff", "wall_seconds")


def demo_once(scratch: Path, *, warm: bool) -> dict[str, Any]:
    """One run of the README's demo job (its script's path made absolute, nothing else changed); the
    summary's goodput figures, attempts and final step."""
    document = yaml.safe_load(DEMO_JOB.read_text())
    command = document["spec"]["template"]["spec"]["containers"][0]["command"]
    command[1] = str(ROOT / command[1])
    job = parse_job(document, str(DEMO_JOB))
    runner = LocalRunner(job, checkpoint_root=scratch / "volumes", run_dir=scratch / "run", warm_spares=warm)
    began = time.monotonic()
    code = runner.run()
    wall = time.monotonic() - began
    summary = runner.summary().as_dict()
    if code != 0 or summary["result"] != "succeeded":
        raise RuntimeError(f"demo run ({'warm' if warm else 'cold'}): exit {code}, {summary['reason']}")
    return {
        "mode": "warm" if warm else "cold",
        "goodput": summary["goodput"],
        "goodput_excluding_backoff": summary["goodput_excluding_backoff"],
        "wall_seconds": round(wall, 1),
        "attempts": summary["attempts"],
        "final_step": summary["final_step"],
    }


def demo(runs: int) -> int:
    """Run the demo job cold and warm, alternately, ``runs`` of each; print each run, the medians and
    their goodput ratio (JSON on the last line)."""
    results: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="trainguard-demo-goodput-") as scratch:
        for index in range(runs):
            for warm in (False, True):
                result = demo_once(Path(scratch) / f"{index}-{warm}", warm=warm)
                results[result["mode"]].append(result)
                figures = " ".join(
                    f"{key}={result[key]}" for key in (*DEMO_FIGURES, "attempts", "final_step")
                )
                print(f"demo {result['mode']} {index}: {figures}", flush=True)
    medians = {
        mode: {key: round(statistics.median(r[key] for r in found), 3) for key in DEMO_FIGURES}
        for mode, found in results.items()
    }
    ratio = round(medians["warm"]["goodput"] / medians["cold"]["goodput"], 3)
    print()
    print(f"demo: {'figure (median)':<28}{'cold':>8}{'warm':>8}")
    for key in DEMO_FIGURES:
        print(f"{'':<6}{key:<28}{medians['cold'][key]:>8}{medians['warm'][key]:>8}")
    print(f"demo: warm/cold goodput {ratio:.3f}")
    summary = {
        "demo": results,
        "median": medians,
        "warm_over_cold_goodput": ratio,
        "load_average": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run each scenario cold and warm, alternately; print each run and the medians (JSON on the last
    line)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=2, help="runs of each mode (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=120, help="training steps (default: %(default)s)")
    parser.add_argument("--fault-step", type=int, default=70, help="rank 1's fault (default: %(default)s)")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="(default: %(default)s)")
    parser.add_argument("--scenario", choices=(*SCENARIOS, "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="one run of each, 60 steps: a smoke test")
    parser.add_argument("--demo", action="store_true", help="the README's demo job's goodput, cold and warm")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.demo:
        return demo(args.runs)
    if args.quick:
        args.runs, args.steps, args.fault_step = 1, 60, 40
    if not 0 < args.fault_step < args.steps:
        parser.error("--fault-step must lie within --steps")
    scenarios = SCENARIOS if args.scenario == "both" else (args.scenario,)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {"cold": [], "warm": []} for s in scenarios}
    with tempfile.TemporaryDirectory(prefix="trainguard-recovery-local-") as scratch:
        for index in range(args.runs):
            for scenario in scenarios:
                document = job_document(args.steps, f"{scenario}@{args.fault_step}:1", args.checkpoint_every)
                for warm in (False, True):
                    began = time.monotonic()
                    where = Path(scratch) / f"{scenario}-{index}-{warm}"
                    result = run_once(where, document, scenario=scenario, warm=warm)
                    runs[scenario][result["mode"]].append(result)
                    figures = " ".join(f"{key}={result[key]:.2f}" for key in PHASES)
                    took = time.monotonic() - began
                    print(
                        f"{scenario} {result['mode']} {index}: {figures} "
                        f"({result['start_message']}; run {took:.0f} s)",
                        flush=True,
                    )
    medians = {
        scenario: {
            mode: {key: round(statistics.median(r[key] for r in results), 3) for key in PHASES}
            for mode, results in by_mode.items()
        }
        for scenario, by_mode in runs.items()
    }
    ratios = {}
    goals = {}
    for scenario in scenarios:
        cold, warm_ = medians[scenario]["cold"], medians[scenario]["warm"]
        ratios[scenario] = round(warm_["recover_s"] / cold["recover_s"], 3)
        print()
        print(f"{scenario}: {'phase (median s)':<22}{'cold':>8}{'warm':>8}")
        for key in PHASES:
            print(f"{'':<{len(scenario) + 2}}{key:<22}{cold[key]:>8.2f}{warm_[key]:>8.2f}")
        if scenario == "crash":
            goals[scenario] = warm_["recover_s"] <= GOAL_RECOVER_S
            goal = f"warm recover_s <= {GOAL_RECOVER_S} s"
        else:
            goals[scenario] = warm_["after_detect_s"] <= GOAL_AFTER_DETECT_S
            goal = f"warm after_detect_s <= {GOAL_AFTER_DETECT_S} s"
        met = "met" if goals[scenario] else "missed"
        print(f"{scenario}: warm/cold recover_s {ratios[scenario]:.2f}; goal {goal}: {met}")
    summary = {
        "runs": runs,
        "median": medians,
        "warm_over_cold": ratios,
        "goal_recover_s": GOAL_RECOVER_S,
        "goal_after_detect_s": GOAL_AFTER_DETECT_S,
        "goal_met": goals,
        "backoff_s": BACKOFF_SECONDS,
        "load_average": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

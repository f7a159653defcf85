"""A gang restarted in place by ``trainguard-launch``: what a pod's recovery costs once its pod is kept.

Two ranks of the README's demo model (``examples/tiny_lm/train.py``, gloo) run on this machine, each
under its own launcher (``trainer_sidecar.launcher``) with its own status directory, as two pods would:
the same rendezvous address and port for every attempt, the checkpoint directory shared. One fault
(``crash@STEP:1``: rank 1 SIGKILLs itself; or ``hang@STEP:1``: rank 1 sleeps in its own work) ends
attempt 1; this bench then does what the operator does once it has decided to restart the gang, and
times only what follows: it writes a ``RestartOrder`` for attempt 2 (stop: kill) into both status
directories at once. For a crash it orders as soon as rank 1's launcher reports the exit; for a hang,
1 s after rank 0's last step (detection is the sidecar's, measured in ``bench.hang_detection`` and
``bench.recovery_local``, and not part of this).

Runs alternate cold (``--no-spare``: attempt 2 is ``python train.py`` from scratch, in place) and warm
(attempt 2 runs in the spare each launcher started once its worker had stepped). Phases:

- ``order_to_first_step_s``: the orders written to rank 0's first step of attempt 2 (the old workers
  killed and reaped, the new ones started or handed off, the rendezvous on the same port, the resume);
- ``recover_s``: rank 0's last step of attempt 1 to its first of attempt 2 (for a hang, this includes
  the 1 s this bench waits instead of a detection).

What it leaves out, and a cluster adds: the operator's decision and its order's round trip through the
sidecar (an HTTP request per pod), and the kubelet's view of the pod (unchanged: no container restarts).
The last line is one JSON object: every run, the medians per scenario and mode, and ``warm_over_cold``.

    python -m bench.restart_in_place [--runs 2] [--steps 120] [--fault-step 70] [--scenario crash|hang|both]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.recovery_local import TRAIN, job_document, step_times
from trainer_sidecar.contract.inplace import (
    LauncherPhase,
    RestartOrder,
    StopMode,
    read_launcher_state,
    write_order,
)
from trainguard.core.environment import worker_environment
from trainguard.core.spec import parse_job

SCENARIOS = ("crash", "hang")
PHASES = ("order_to_first_step_s", "recover_s")
RANKS = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_env(scratch: Path, document: dict[str, Any], rank: int, port: int, fault: str) -> dict[str, str]:
    """Rank ``rank``'s environment as a pod of attempt 1 has it (the renderer's variables, the rendezvous)."""
    job = parse_job(document, "bench job")
    status_dir = scratch / f"pod-{rank}"
    status_dir.mkdir(parents=True)
    variables = worker_environment(
        job,
        attempt=1,
        remediation=None,
        checkpoint_dir=str(scratch / "checkpoints"),
        status_file=str(status_dir / "status.json"),
        termination_message_path=str(status_dir / "termination-log"),
    ).variables()
    return {
        **os.environ,
        **variables,
        "TRAINGUARD_FAULTS": fault,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(RANKS),
        "RANK": str(rank),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "OMP_NUM_THREADS": "1",
    }


def run_once(scratch: Path, *, scenario: str, warm: bool, steps: int, fault_step: int) -> dict[str, Any]:
    """One run: attempt 1 until its fault, the orders, attempt 2 until its first step; the phases."""
    (scratch / "checkpoints").mkdir(parents=True)
    document = job_document(steps, f"{scenario}@{fault_step}:1", checkpoint_every=20)
    port = free_port()
    command = [sys.executable, str(TRAIN), "--max-steps", str(steps), "--log-every", "1"]
    launchers = []
    for rank in range(RANKS):
        env = rank_env(scratch, document, rank, port, f"{scenario}@{fault_step}:1")
        flags = ["--order-wait-seconds", "120", *([] if warm else ["--no-spare"])]
        with open(scratch / f"rank-{rank}.log", "wb") as log:
            launchers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "trainer_sidecar.launcher.launcher", *flags, "--", *command],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    log0 = scratch / "rank-0.log"
    try:
        ordered_at, spares_ready = _order_when_due(scratch, log0, scenario, fault_step)
        last_step = max(t for step, t in step_times(log0) if t < ordered_at)
        deadline = time.monotonic() + 300
        while not [t for _, t in step_times(log0) if t > ordered_at]:
            if time.monotonic() > deadline or any(p.poll() is not None for p in launchers):
                raise RuntimeError(f"{scenario}: attempt 2 did not step (logs in {scratch})")
            time.sleep(0.05)
        first = min(t for _, t in step_times(log0) if t > ordered_at)
    finally:
        for proc in launchers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in launchers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return {
        "scenario": scenario,
        "mode": "warm" if warm else "cold",
        "spares_ready": spares_ready,
        "order_to_first_step_s": round(first - ordered_at, 3),
        "recover_s": round(first - last_step, 3),
    }


def _order_when_due(scratch: Path, log0: Path, scenario: str, fault_step: int) -> tuple[float, int]:
    """Wait for the fault to end attempt 1 as this bench detects it, then order attempt 2 in both pods;
    when the orders were written (wall clock) and how many spares were ready then."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        states = [read_launcher_state(scratch / f"pod-{rank}").state for rank in range(RANKS)]
        steps = step_times(log0)
        if scenario == "crash":
            due = states[1] is not None and states[1].phase is LauncherPhase.EXITED
        else:
            due = bool(steps) and steps[-1][0] >= fault_step - 1 and time.time() - steps[-1][1] >= 1.0
        if due:
            ready = sum(1 for state in states if state is not None and state.spare_ready)
            ordered_at = time.time()
            for rank in range(RANKS):
                write_order(
                    scratch / f"pod-{rank}", RestartOrder(attempt=2, environment={}, stop=StopMode.KILL)
                )
            return ordered_at, ready
        time.sleep(0.02)
    raise RuntimeError(f"{scenario}: the fault did not end attempt 1 (logs in {scratch})")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the scenarios and print the phases side by side (module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m bench.restart_in_place")
    parser.add_argument("--runs", type=int, default=2, help="runs of each mode per scenario")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--fault-step", type=int, default=70)
    parser.add_argument("--scenario", choices=[*SCENARIOS, "both"], default="both")
    args = parser.parse_args(argv)
    scenarios = SCENARIOS if args.scenario == "both" else (args.scenario,)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="trainguard-inplace-") as tmp:
        for scenario in scenarios:
            for run in range(args.runs):
                for warm in (False, True):
                    scratch = Path(tmp) / f"{scenario}-{run}-{'warm' if warm else 'cold'}"
                    result = run_once(
                        scratch, scenario=scenario, warm=warm, steps=args.steps, fault_step=args.fault_step
                    )
                    runs.append(result)
                    print(json.dumps(result), flush=True)
    medians: dict[str, Any] = {}
    print(f"{'scenario':<8} {'mode':<5} " + " ".join(f"{p:>22}" for p in PHASES))
    for scenario in scenarios:
        for mode in ("cold", "warm"):
            mine = [r for r in runs if r["scenario"] == scenario and r["mode"] == mode]
            row = {p: statistics.median(r[p] for r in mine) for p in PHASES}
            medians[f"{scenario}/{mode}"] = row
            print(f"{scenario:<8} {mode:<5} " + " ".join(f"{row[p]:>22.3f}" for p in PHASES))
        cold, warm_row = medians[f"{scenario}/cold"], medians[f"{scenario}/warm"]
        medians[f"{scenario}/warm_over_cold"] = round(
            warm_row["order_to_first_step_s"] / cold["order_to_first_step_s"], 3
        )
    print(json.dumps({"runs": runs, "medians": medians}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

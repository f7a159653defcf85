"""How soon a hung rank is caught with the learned hang timeout against the fixed one, and the false alarms
of each over a long run of fast steps with checkpoints, side by side in one run.

One real guardian trains a small model in this process (a step of ``--step-seconds``, padded with a
sleep; an asynchronous checkpoint every ``--checkpoint-every`` steps, a snapshot every 10), publishing
its status file as in production. Two sidecar collectors read that same file, as a kubelet would probe
them (every ``--probe-period`` seconds, ``LIVENESS_FAILURE_THRESHOLD`` failures in a row make a rank not
alive): one learns the hang timeout (floor ``--floor``, ceiling ``--ceiling``), one keeps the fixed rule
(the ceiling). ``--contention`` busy processes load the CPU meanwhile.

Phase 1, ``--steps`` steps: every verdict of not alive is a false alarm. Phase 2: the loop stops stepping
(a hang); the time from its last step to each collector's verdict of not alive is its detection latency.
Phase 3: the job restarts: a new guardian resumes from the last checkpoint under two new collectors (the
restarted sidecars), takes ``--resumed-steps`` steps (fewer published gaps than a new job's warm-up) and
hangs again. The learned collector judges by the pace the checkpoint carried (``contract.hang``), after
the resumed run's short warm-up; a run that learned afresh would still be in its warm-up, judged by the
ceiling as the fixed rule is.

Run ``python -m bench.hang_detection`` (about 5 min: 10,000 steps, then the fixed rule's minute);
``--quick`` for a smoke test. The last line printed is JSON. Goals: ``false_alarms_learned == 0`` over
10,000 steps with checkpoints under contention, and ``detect_learned_s <= 10`` for steps of 0.1-0.5 s
(the published gaps of faster steps are the status interval's, 0.5 s, as for 0.1 s steps) with a floor
of 5 s and a probe every second.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from trainer_sidecar import CheckpointPolicy, Guardian, GuardianSettings, GuardThresholds
from trainer_sidecar.contract.hang import RESUMED_WARMUP_GAPS, WARMUP_GAPS
from trainer_sidecar.contract.status import read_status
from trainer_sidecar.sidecar.server import WorkerStatusCollector
from trainguard.local.sidecars import LIVENESS_FAILURE_THRESHOLD

_GUARDIAN_ENV = (
    "TRAINGUARD_CHECKPOINT_DIR",
    "TRAINGUARD_STATUS_FILE",
    "TRAINGUARD_FAULTS",
    "TRAINGUARD_REMEDIATION",
    "TRAINGUARD_SETTINGS",
)


@dataclass
class Prober:
    """A kubelet's view of one collector: consecutive failures, and when the threshold was reached."""

    name: str
    collector: WorkerStatusCollector
    failures: int = 0
    false_alarms: int = 0
    failed_while_stepping: int = 0
    detected_at: float | None = None
    reasons: list[str] = field(default_factory=list)
    timeouts: list[float] = field(default_factory=list)

    def probe(self, hung_since: float | None) -> None:
        """One probe: a failure counts towards the threshold; reaching it is a detection while hung, a
        false alarm otherwise (then the count starts again, as after a restart)."""
        reading = self.collector.read()
        if reading.hang_timeout_seconds is not None:
            self.timeouts.append(reading.hang_timeout_seconds)
        if reading.health.alive:
            self.failures = 0
            return
        self.failures += 1
        if hung_since is None:
            self.failed_while_stepping += 1
            if len(self.reasons) < 3:
                self.reasons.append(f"probe failed: {reading.health.reason}")
        if self.failures < LIVENESS_FAILURE_THRESHOLD:
            return
        if hung_since is None:
            self.false_alarms += 1
            self.failures = 0
        elif self.detected_at is None:
            self.detected_at = time.monotonic()


class Probing:
    """Probes ``probers`` every ``period`` seconds from a thread, while the ``with`` block runs; ``hang``
    then marks the hang's start and waits for every prober's verdict (at most the ceiling and a few
    probes)."""

    def __init__(self, probers: list[Prober], period: float) -> None:
        self.probers = probers
        self.period = period
        self.hung_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Probing:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for prober in self.probers:
                prober.probe(self.hung_since)

    def hang(self, ceiling: float) -> float:
        """The loop has stopped stepping: wait for the verdicts; when the hang began."""
        hung_since = self.hung_since = time.monotonic()
        limit = hung_since + ceiling + (LIVENESS_FAILURE_THRESHOLD + 3) * self.period
        while time.monotonic() < limit and any(p.detected_at is None for p in self.probers):
            time.sleep(0.1)
        return hung_since


def train(guardian: Guardian, model: nn.Module, steps: int, step_seconds: float) -> list[float]:
    """``steps`` steps of about ``step_seconds`` each; their durations."""
    durations = []
    for _ in range(steps):
        inputs, targets = torch.randn(32, 64), torch.randn(32, 1)
        began = time.monotonic()
        guardian.step(nn.functional.mse_loss(model(inputs), targets))
        time.sleep(max(0.0, step_seconds - (time.monotonic() - began)))
        durations.append(time.monotonic() - began)
    return durations


def _contend(count: int) -> list[subprocess.Popen[bytes]]:
    """``count`` processes that spin on a core each until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Run the benchmark; print the figures and, last, one JSON line; return the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--step-seconds", type=float, default=0.02)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--floor", type=float, default=5.0)
    parser.add_argument("--ceiling", type=float, default=60.0)
    parser.add_argument("--probe-period", type=float, default=1.0)
    parser.add_argument("--contention", type=int, default=1)
    parser.add_argument(
        "--resumed-steps",
        type=int,
        default=300,
        help="steps the resumed run takes before it hangs (default %(default)s: about 6 s of 0.02 s steps, "
        "12 published gaps, fewer than a new job's warm-up)",
    )
    parser.add_argument("--quick", action="store_true", help="600 steps, a 20 s ceiling: a smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.ceiling = 600, 20.0
    for name in _GUARDIAN_ENV:
        os.environ.pop(name, None)
    torch.set_num_threads(1)
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory(prefix="bench-hang-") as scratch:
        directory = Path(scratch)
        status_file = directory / "status.json"
        settings = GuardianSettings(
            # Spikes and rollbacks are not what is measured here: a noisy regression never converges.
            guard=GuardThresholds(loss_spike_factor=1e6, grad_norm_spike_factor=1e6),
            checkpoint=CheckpointPolicy(every_steps=args.checkpoint_every, snapshot_every_steps=10),
        )

        def start(resume: bool) -> tuple[Guardian, nn.Module]:
            model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))
            guardian = Guardian(
                model,
                torch.optim.AdamW(model.parameters(), lr=1e-3),
                checkpoint_dir=directory / "checkpoints",
                status_file=status_file,
                settings=settings,
                resume=resume,
            )
            return guardian, model

        def collector(floor: float | None) -> WorkerStatusCollector:
            return WorkerStatusCollector(
                status_file,
                hang_timeout_seconds=args.ceiling,
                startup_grace_seconds=600.0,
                job="bench",
                namespace="default",
                hang_timeout_floor_seconds=floor,
            )

        def pair() -> list[Prober]:
            return [Prober("learned", collector(args.floor)), Prober("fixed", collector(None))]

        probers = pair()
        guardian, model = start(resume=False)
        spinners = _contend(args.contention)
        started = time.monotonic()
        try:
            with Probing(probers, args.probe_period) as probing:
                step_times = train(guardian, model, args.steps, args.step_seconds)
                run_seconds = time.monotonic() - started
                published = read_status(status_file).status
                # Phase 2: the loop stops stepping; the last step's status is the last progress published.
                hung_since = probing.hang(args.ceiling)
            guardian.close()
            # Phase 3: the job restarts (a new guardian resumes from the last checkpoint, new sidecars) and
            # hangs again after --resumed-steps, fewer gaps than a new job's warm-up.
            guardian, model = start(resume=True)
            resumed = pair()
            with Probing(resumed, args.probe_period) as probing:
                train(guardian, model, args.resumed_steps, args.step_seconds)
                republished = read_status(status_file).status
                resumed_hung_since = probing.hang(args.ceiling)
            guardian.close()
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()

    learned, fixed = probers

    def detect(prober: Prober, since: float = hung_since) -> float | None:
        return None if prober.detected_at is None else round(prober.detected_at - since, 2)

    result: dict[str, object] = {
        "steps": args.steps,
        "run_s": round(run_seconds, 1),
        "step_median_s": round(sorted(step_times)[len(step_times) // 2], 4),
        "step_max_s": round(max(step_times), 3),
        "checkpoints": args.steps // args.checkpoint_every,
        "contention": args.contention,
        "probe_period_s": args.probe_period,
        "floor_s": args.floor,
        "ceiling_s": args.ceiling,
        "progress_gaps": published.progress_gaps if published else None,
        "longest_progress_gap_s": published.longest_progress_gap_seconds if published else None,
        "learned_timeout_s": learned.timeouts[-1] if learned.timeouts else None,
        "learned_timeout_max_s": max(learned.timeouts, default=None),
        "detect_learned_s": detect(learned),
        "detect_fixed_s": detect(fixed),
        "false_alarms_learned": learned.false_alarms,
        "false_alarms_fixed": fixed.false_alarms,
        "failed_probes_learned_while_stepping": learned.failed_while_stepping,
        "failed_probes_fixed_while_stepping": fixed.failed_while_stepping,
        "resumed_steps": args.resumed_steps,
        "resumed_progress_gaps": republished.progress_gaps if republished else None,
        "resumed_learned_timeout_s": resumed[0].timeouts[-1] if resumed[0].timeouts else None,
        "detect_resumed_learned_s": detect(resumed[0], resumed_hung_since),
        "detect_resumed_fixed_s": detect(resumed[1], resumed_hung_since),
        "false_alarms_resumed_learned": resumed[0].false_alarms,
    }
    print(
        f"{args.steps} steps in {run_seconds:.0f} s (median {result['step_median_s']} s, longest "
        f"{result['step_max_s']} s), a checkpoint every {args.checkpoint_every}, {args.contention} "
        f"spinning process(es); probes every {args.probe_period:g} s, {LIVENESS_FAILURE_THRESHOLD} in a row"
    )
    print(
        f"published gaps {result['progress_gaps']}, longest after the warm-up "
        f"{result['longest_progress_gap_s']} s -> learned timeout {result['learned_timeout_s']} s "
        f"(floor {args.floor:g} s, ceiling {args.ceiling:g} s)"
    )
    print(f"{'':10} {'detection (s)':>14} {'false alarms':>13}")

    def rows(of: list[Prober], since: float) -> None:
        for prober in of:
            seen = detect(prober, since)
            shown = "not caught" if seen is None else f"{seen:.1f}"
            print(f"{prober.name:10} {shown:>14} {prober.false_alarms:>13}")

    rows(probers, hung_since)
    for prober in probers:
        for reason in prober.reasons[:3]:
            print(f"  {prober.name}: {reason}")
    print(
        f"resumed, then hung after {args.resumed_steps} steps (published gaps "
        f"{result['resumed_progress_gaps']}, of which {RESUMED_WARMUP_GAPS} are the resumed run's warm-up "
        f"and {WARMUP_GAPS - RESUMED_WARMUP_GAPS} stand for the record its checkpoint carried)"
    )
    rows(resumed, resumed_hung_since)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

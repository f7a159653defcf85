"""A worker without torch for tests of ``trainguard run``'s process lifecycle: it starts in a moment.

It records itself in ``--pid-dir`` (``worker-<rank>-<pid>.json``: pid, working directory,
OMP_NUM_THREADS), then publishes a status with a new step every ``--step-sleep`` seconds for ``--steps``
steps (so its sidecar sees progress) and exits 0. Options make it misbehave on purpose:

- ``--fork-holder``: fork a child first that keeps every inherited descriptor (the checkpoint lock)
  until ``<pid-dir>/release`` exists (at most 120 s), recorded as ``holder-<rank>-<pid>.json``;
- ``--fork-detached``: fork a child first that leaves for a session of its own and closes every inherited
  descriptor but the standard ones, as torchrun's workers do, then waits like a holder; recorded as
  ``detached-<rank>-<pid>.json``;
- ``--fail MESSAGE``: write a final status whose message is MESSAGE to the termination-message file,
  print a misleading last log line, and exit 2 (a configuration error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from trainer_sidecar.contract.status import Phase, WorkerStatus, write_status, write_termination_message


def record(pid_dir: Path, role: str, rank: int) -> None:
    """Write this process's record into ``pid_dir``."""
    pid_dir.mkdir(parents=True, exist_ok=True)
    entry = {"pid": os.getpid(), "cwd": os.getcwd(), "omp": os.environ.get("OMP_NUM_THREADS")}
    final = pid_dir / f"{role}-{rank}-{os.getpid()}.json"
    temporary = final.with_suffix(".tmp")  # a reader never sees half a record
    temporary.write_text(json.dumps(entry))
    os.replace(temporary, final)


def hold(pid_dir: Path, rank: int) -> None:
    """In a forked child: keep the inherited descriptors until released."""
    record(pid_dir, "holder", rank)
    deadline = time.monotonic() + 120
    while not (pid_dir / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    os._exit(0)


def detach(pid_dir: Path, rank: int) -> None:
    """In a forked child: a session of its own, no inherited descriptor (no lock), then wait."""
    os.setsid()
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    record(pid_dir, "detached", rank)
    deadline = time.monotonic() + 120
    while not (pid_dir / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    os._exit(0)


def main() -> int:
    """See the module docstring."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--pid-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--fork-holder", action="store_true")
    parser.add_argument("--fork-detached", action="store_true")
    parser.add_argument("--fail", default="")
    args = parser.parse_args()
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if args.fork_holder and os.fork() == 0:
        hold(args.pid_dir, rank)
    if args.fork_detached and os.fork() == 0:
        detach(args.pid_dir, rank)
    record(args.pid_dir, "worker", rank)
    if args.fail:
        status = WorkerStatus(
            rank=rank, world_size=world_size, started_at=time.time(), phase=Phase.FAILED, message=args.fail
        )
        write_termination_message(Path(os.environ["TRAINGUARD_TERMINATION_MESSAGE_PATH"]), status)
        print("an unrelated last line of the log", flush=True)
        return 2
    status_file = Path(os.environ["TRAINGUARD_STATUS_FILE"])
    started = time.time()
    for step in range(1, args.steps + 1):
        time.sleep(args.step_sleep)
        now = time.time()
        write_status(
            status_file,
            WorkerStatus(
                rank=rank, world_size=world_size, pid=os.getpid(), phase=Phase.RUNNING,
                started_at=started, updated_at=now, step=step, steps_total=step, last_step_time=now,
            ),
        )  # fmt: skip
    final = WorkerStatus(
        rank=rank,
        world_size=world_size,
        pid=os.getpid(),
        phase=Phase.FINISHED,
        started_at=started,
        step=args.steps,
    )
    write_status(status_file, final)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

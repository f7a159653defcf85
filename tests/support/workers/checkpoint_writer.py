"""A checkpoint writer in a process of its own, standing in for one gang of a job.

It claims an epoch (as rank 0 does), then saves a small state tagged with its name, step after step,
printing one JSON line per event: ``{"event": "claimed", "epoch": E}``, then ``{"event": "saved",
"step": S, "epoch": E}`` for each save that returned, or ``{"event": "fenced", "step": S, "error": ...}``
when a save was refused (then it exits 0). ``--blind`` makes it miss the fence, as an old gang on a
partitioned node or behind a stale NFS cache would: it keeps committing, and readers must never trust
what it commits after the fence. ``--resume`` starts after the newest valid checkpoint, as a restarted
job does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from trainer_sidecar.checkpoint import CheckpointStore, EpochOwner, FencedError, claim_epoch
from trainer_sidecar.checkpoint import store as checkpoint_store


def say(**event: object) -> None:
    """One JSON line on stdout, flushed."""
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def state_for(step: int, name: str) -> dict[str, object]:
    """The state a writer saves at ``step``: its weights say who wrote them."""
    mark = float(sum(name.encode()))
    return {"model": {"w": torch.full((256,), mark + step)}, "writer": name, "step": step}


def main() -> int:
    """Claim, then save until fenced, ``--saves`` saves or the deadline."""
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("name")
    parser.add_argument("--start", type=int, default=1)
    parser.add_argument("--resume", action="store_true", help="start after the newest valid checkpoint")
    parser.add_argument("--saves", type=int, default=1000)
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--blind", action="store_true")
    parser.add_argument("--attempt", type=int, default=1, help="the attempt of the job it stands for")
    args = parser.parse_args()

    # Every writer stands for a gang of one job ("train"): another job is refused the directory.
    record = claim_epoch(args.root, EpochOwner(job="train", attempt=args.attempt, pid=os.getpid()))
    say(event="claimed", epoch=record.epoch, inherits=record.inherits)
    if args.blind:
        mock.patch.object(checkpoint_store, "check_fence", return_value=None).start()
    store = CheckpointStore(args.root, epoch=record.epoch, keep_clean=10_000)
    start = (store.newest_valid() or 0) + 1 if args.resume else args.start
    deadline = time.monotonic() + args.seconds
    try:
        for step in range(start, start + args.saves):
            if time.monotonic() > deadline:
                break
            try:
                store.save(step, state_for(step, args.name), {"writer": args.name})
            except FencedError as exc:
                say(event="fenced", step=step, error=str(exc))
                return 0
            say(event="saved", step=step, epoch=record.epoch)
            time.sleep(args.pause)
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

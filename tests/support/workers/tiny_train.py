"""A small, deterministic guarded training job for tests that need real processes.

Single process by default; under ``torch.distributed`` (gloo) when RANK and WORLD_SIZE are set, with
the model wrapped in DistributedDataParallel. Settings, faults, checkpoint and status locations come
from the usual TRAINGUARD_* environment variables. On success it prints one JSON line with the
guardian's counters and a SHA-256 of the final weights.

``--loop`` chooses how the loop is written: ``run`` (``guardian.run``, the default), ``steps`` (its own
batches, counted by ``guardian.steps``), ``own`` (a counter of its own, ``while iter_num < steps``) or
``dowhile`` (nanoGPT's ``iter_num += 1; if iter_num > steps: break``); the last two never call
``guardian.finish()``, as a loop that forgot it. ``--declare-max`` gives ``Guardian(max_steps=...)``;
``--raise-after-loop`` ends in an unhandled exception after the loop; ``--raise-at STEP`` raises one (the
same every time: a deterministic bug) once the guardian's step count reaches STEP. ``--num-workers N``
loads the data in N DataLoader worker processes; ``--segfault-at-batch B`` makes the worker that loads
this rank's batch B of the first epoch die by SIGSEGV at its last sample (a corrupt sample crashing a
native decoder), every time it is loaded, and every sample take ``--sample-seconds`` to load in a worker
(the data is what the loop waits for, so the crash reaches it at step B). ``--count-samples``
all-reduces each batch's sample count before its forward pass (a collective of the loop's own, as loops
that weigh their loss by the gang's samples do); ``--stall-at STEP`` makes rank ``--stall-rank`` stop in
its own loop code at that step, before that all-reduce, for an hour (a hang that is not the guardian's).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainer_sidecar import GuardedLoader, Guardian


def make_dataset(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed regression problem: y = w·x + noise."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(16, generator=generator)
    xs = torch.randn(n, 16, generator=generator)
    ys = xs @ weight + 0.1 * torch.randn(n, generator=generator)
    return [(xs[i], ys[i : i + 1]) for i in range(n)]


class SegfaultingDataset(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``samples``, slow to load in a DataLoader worker (``seconds`` each), and sample ``poisoned`` kills
    the worker that loads it by SIGSEGV (-1: none)."""

    def __init__(self, samples: list[tuple[torch.Tensor, torch.Tensor]], seconds: float) -> None:
        self.samples, self.seconds, self.poisoned = samples, seconds, -1

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.utils.data.get_worker_info() is not None:
            time.sleep(self.seconds)
            if index == self.poisoned:
                os.kill(os.getpid(), signal.SIGSEGV)
        return self.samples[index]


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's bytes, in order."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def loader_batches(loader: GuardedLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The loader's batches, epoch after epoch (a loop drawing batches of its own)."""
    while True:
        yield from (batch.data for batch in loader)


def own_loop(
    guardian: Guardian,
    model: torch.nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    shape: str,
    steps: int,
) -> None:
    """Train with a loop of one of the shapes ``steps``, ``own`` and ``dowhile`` (see the module doc)."""

    def one_step() -> None:
        x, y = next(batches)
        guardian.step(torch.nn.functional.mse_loss(model(x), y))

    if shape == "steps":
        for _ in guardian.steps(steps):
            one_step()
        return
    iter_num = guardian.step_count
    if shape == "own":
        while iter_num < steps:
            one_step()
            iter_num += 1
        return
    while True:
        one_step()
        iter_num += 1
        if iter_num > steps:
            break


def pause(seconds: float, until: Path | None) -> None:
    """Sleep ``seconds``, or until the file ``until`` exists."""
    ends = time.monotonic() + seconds
    while time.monotonic() < ends and not (until and until.exists()):
        time.sleep(0.05)


def slow_start(seconds: float, worker_id: int) -> None:
    """A loader worker's ``worker_init_fn`` that takes ``seconds`` (an epoch's slow start)."""
    time.sleep(seconds)


def compute_for(seconds: float) -> None:
    """Keep the CPU busy for ``seconds`` with real tensor work (a forward pass grown long)."""
    ends = time.monotonic() + seconds
    a = torch.full((64, 64), 0.01)
    while time.monotonic() < ends:
        a = torch.tanh(a @ a + 0.01)


def main() -> int:
    """Train for --steps steps under the guardian and report."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    parser.add_argument("--busy-at", type=int, default=-1, help="after this step, rank --busy-rank is busy")
    parser.add_argument("--busy-rank", type=int, default=0)
    parser.add_argument("--busy-seconds", type=float, default=0.0, help="how long it is busy (sleeping)")
    parser.add_argument("--busy-until", type=Path, help="busy until this file exists")
    parser.add_argument(
        "--busy-eval-mode",
        action="store_true",
        help="the busy pause is an evaluation as real loops write it: model.eval() ... model.train(), no "
        "guardian.busy",
    )
    parser.add_argument(
        "--epoch-start-seconds",
        type=float,
        default=0.0,
        help="guardian.run gets a torch DataLoader with one worker whose worker_init_fn takes this long: "
        "every epoch starts this much later",
    )
    parser.add_argument("--long-steps-from", type=int, default=-1, help="steps from here compute long")
    parser.add_argument("--long-steps", type=int, default=1, help="how many steps compute long")
    parser.add_argument("--long-step-seconds", type=float, default=0.0, help="their forward's compute")
    parser.add_argument("--loop", choices=("run", "steps", "own", "dowhile"), default="run")
    parser.add_argument("--declare-max", action="store_true", help="Guardian(..., max_steps=--steps)")
    parser.add_argument("--raise-after-loop", action="store_true")
    parser.add_argument("--raise-at", type=int, default=-1, help="raise an exception at this step")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--segfault-at-batch", type=int, default=-1, help="its loader worker dies (SIGSEGV)")
    parser.add_argument("--sample-seconds", type=float, default=0.02, help="per sample, with the above")
    parser.add_argument("--statuses", type=Path, help="write the status after every step to DIR/rank<R>.json")
    parser.add_argument("--count-samples", action="store_true", help="all-reduce each batch's sample count")
    parser.add_argument(
        "--stall-at", type=int, default=-1, help="at this step, --stall-rank stops in the loop"
    )
    parser.add_argument("--stall-rank", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if distributed:
        dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
    )
    if distributed:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.01 * step))
    guardian = Guardian(
        model, optimizer, scheduler=scheduler, max_steps=args.steps if args.declare_max else None
    )
    samples = make_dataset(args.samples, args.seed)
    if args.epoch_start_seconds:
        slow: torch.utils.data.DataLoader[tuple[torch.Tensor, torch.Tensor]] = torch.utils.data.DataLoader(
            samples,  # type: ignore[arg-type]  # a list of samples is a map-style dataset
            batch_size=args.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=1,
            worker_init_fn=functools.partial(slow_start, args.epoch_start_seconds),
        )
        loader = guardian.loader(slow, seed=args.seed)
    else:
        poisoned = SegfaultingDataset(samples, args.sample_seconds)
        dataset = poisoned if args.segfault_at_batch >= 0 else samples
        loader = guardian.loader(
            dataset, batch_size=args.batch_size, seed=args.seed, num_workers=args.num_workers
        )
        if args.segfault_at_batch >= 0:  # set before the workers start (they fork at the first batch)
            poisoned.poisoned = loader.batch_indices(0, args.segfault_at_batch)[-1]
    long_steps = range(args.long_steps_from, args.long_steps_from + args.long_steps)
    if args.loop != "run":
        own_loop(guardian, model, iter(loader_batches(loader)), args.loop, args.steps)
        if args.raise_after_loop:
            raise RuntimeError("the loop's epilogue failed")
        report = {"rank": guardian.rank, "step": guardian.step_count, "iterations": guardian.iterations,
                  "rollbacks": guardian.rollbacks, "digest": weights_digest(guardian.module)}  # fmt: skip
        print(json.dumps(report), flush=True)
        if distributed:
            dist.destroy_process_group()  # before exit, as the examples do: no collective after this
        return 0
    statuses: list[dict[str, object]] = []
    for x, y in guardian.run(loader, max_steps=args.steps):
        if guardian.step_count in long_steps:
            compute_for(args.long_step_seconds)
        if guardian.step_count == args.stall_at and guardian.rank == args.stall_rank:
            time.sleep(3600)  # stuck in the loop's own code, before its collective
        if args.count_samples and distributed:
            gang_samples = torch.tensor([len(x)])
            dist.all_reduce(gang_samples)  # the loop's own collective: the gang's samples of this step
        loss = torch.nn.functional.mse_loss(model(x), y)
        guardian.step(loss)
        if args.statuses is not None:
            statuses.append(guardian.status().to_document())
        if guardian.step_count == args.raise_at:
            raise ValueError("mat1 and mat2 shapes cannot be multiplied (8x16 and 32x1)")
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if guardian.step_count == args.busy_at and guardian.rank == args.busy_rank:
            # An evaluation only this rank runs; the others wait.
            if args.busy_eval_mode:
                model.eval()
                pause(args.busy_seconds, args.busy_until)
                model.train()
            else:
                with guardian.busy("eval", seconds=args.busy_seconds + 60):
                    pause(args.busy_seconds, args.busy_until)
    if args.statuses is not None:
        (args.statuses / f"rank{guardian.rank}.json").write_text(json.dumps(statuses))
    report = {
        "rank": guardian.rank,
        "step": guardian.step_count,
        "resumed_step": guardian.resumed_step,
        "skipped_steps": guardian.skipped_steps,
        "rollbacks": guardian.rollbacks,
        "lr_scale": guardian.lr_scale,
        "samples_dropped": loader.counters.dropped,
        "digest": weights_digest(guardian.module),
    }
    print(json.dumps(report), flush=True)
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

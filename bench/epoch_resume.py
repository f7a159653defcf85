"""A resume mid-epoch: the time to the first batch, skipping the trained batches by index
(``guardian.batches``) against loading each and dropping it (the ``continue`` of a loop of its own).

One epoch of ``--samples`` (default 100,000) samples in batches of ``--batch-size`` (100), through a
DataLoader with a DistributedSampler (shuffled, ``set_epoch``), each sample "decoded" at a cost (a
3x32x32 image made from its index: about what a small JPEG's tensor costs to build, far less than a
real decode). The epoch resumes at ``--position`` (0.9: batch 900 of 1,000). Side by side, in rotating
order, medians of ``--repetitions``:

- ``continue``: ``for i, batch in enumerate(loader): if i < start: continue`` (every skipped batch is
  loaded and collated);
- ``index``: the guardian's epoch loop with its data frontier at that batch, as a checkpoint restores
  it (``trainer_sidecar.guardian.epochs.EpochLoop``): the batch sampler is walked for indices only;
- ``index_at_start``: the same at the epoch's first batch (the time a fresh epoch takes to its first
  batch), so ``index_over_start`` says whether the time depends on the position.

The last line is one JSON object; the goal is ``index_over_start`` near 1 (independent of the position),
and ``continue_over_index`` is what a loop skipping by loading pays.

    python -m bench.epoch_resume [--samples 100000] [--position 0.9] [--repetitions 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainer_sidecar.guardian.epochs import EpochLoop


class Decoded(Dataset[torch.Tensor]):
    """Samples built from their index at a small cost each."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((3, 32, 32), float(index)).mul_(0.5).add_(1.0)


def loader_of(samples: int, batch_size: int) -> DataLoader[Any]:
    dataset = Decoded(samples)
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=1, rank=0, seed=0)
    sampler.set_epoch(0)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def by_continue(loader: DataLoader[Any], start: int) -> float:
    began = time.perf_counter()
    for i, batch in enumerate(loader):
        if i < start:
            continue
        assert batch.shape[0] > 0
        break
    return time.perf_counter() - began


def by_index(loader: DataLoader[Any], start: int) -> float:
    epochs = EpochLoop(lambda name, obj: None, lambda e, b: False, lambda e, b: None, lambda: None)
    epochs.frontier.load_state_dict({"epoch": 0, "batch": start})
    epochs.position.load_state_dict({"epoch": 0})
    began = time.perf_counter()
    for _ in epochs.epochs(1):
        for batch in epochs.batches(loader):
            assert batch.shape[0] > 0
            break
        break
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--position", type=float, default=0.9)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="10,000 samples, one repetition")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.repetitions = 10_000, 1
    if not 0 <= args.position < 1:
        parser.error(f"--position must be in [0, 1), got {args.position}")
    torch.set_num_threads(1)
    loader = loader_of(args.samples, args.batch_size)
    start = int(len(loader) * args.position)
    variants: dict[str, Callable[[], float]] = {
        "continue": lambda: by_continue(loader, start),
        "index": lambda: by_index(loader, start),
        "index_at_start": lambda: by_index(loader, 0),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for repetition in range(args.repetitions):
        for name in names[repetition % len(names) :] + names[: repetition % len(names)]:
            times[name].append(variants[name]())
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, value in medians.items():
        first = 0 if name == "index_at_start" else start
        print(f"{name:>15}: {value * 1000:9.2f} ms to the first batch (batch {first})")
    result = {
        "samples": args.samples,
        "batch_size": args.batch_size,
        "start_batch": start,
        **{f"{name}_s": value for name, value in medians.items()},
        "continue_over_index": medians["continue"] / medians["index"],
        "index_over_start": medians["index"] / medians["index_at_start"],
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

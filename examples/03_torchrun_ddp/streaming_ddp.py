"""DDP under torchrun with a loop's own streaming data: an IterableDataset read through torchdata's
StatefulDataLoader, whose position the guardian keeps in each rank's checkpoint.

    torchrun --nproc-per-node 2 examples/03_torchrun_ddp/streaming_ddp.py --steps 200

The lines marked ``# trainguard`` are the adoption: the loop keeps its epochs, its DataLoader (a
StatefulDataLoader, torchdata's resumable drop-in) and its own step counter. Rank 0 prints one JSON line
at the end: the step reached and its last losses (a resumed run repeats the uninterrupted run's losses).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from trainer_sidecar import Guardian  # trainguard


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Noisy points of a fixed curve, generated on the fly: this rank's share of an endless stream."""

    def __init__(self, rank: int, world_size: int, length: int = 1_000_000) -> None:
        self.rank, self.world_size, self.length = rank, world_size, length

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        worker = get_worker_info()
        shards, shard = self.world_size, self.rank
        if worker is not None:
            shards, shard = shards * worker.num_workers, shard * worker.num_workers + worker.id
        for index in range(shard, self.length, shards):
            generator = torch.Generator().manual_seed(index)
            x = torch.rand(8, generator=generator) * 2 - 1
            yield x, torch.sin(3 * x).sum(dim=0, keepdim=True) + 0.01 * torch.randn(1, generator=generator)


def main() -> None:
    """Train to ``--steps``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = StatefulDataLoader(Stream(rank, world_size), batch_size=32)

    guardian = Guardian(model, optimizer)  # trainguard
    guardian.track("loader", loader)  # trainguard: its position is in every checkpoint
    step, losses = guardian.step_count, []  # trainguard (was: step, losses = 0, [])
    while step < args.steps:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            guardian.step(loss)  # trainguard (was: loss.backward(); optimizer.step(); zero_grad())
            step = guardian.step_count  # trainguard (was: step += 1)
            losses.append(round(loss.item(), 6))
            if step >= args.steps:
                break
    guardian.finish()  # trainguard: a final checkpoint, then "finished"
    if rank == 0:
        print(
            json.dumps({"step": step, "last_losses": losses[-5:], "finite": all(map(math.isfinite, losses))})
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

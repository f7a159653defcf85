"""This process's place in its torch.distributed job, and the few collectives the guardian uses.

Every decision the guardian takes (skip, roll back, which checkpoint to resume) must be the same on
every rank, or the ranks fall out of step and the next all-reduce hangs. The guardian therefore agrees on
its numbers through these collectives. Without a process group the gang is one process and every
collective is the identity.

A gang made with an ``ActivityTracker`` marks its self-contained collectives (``agree_min``,
``agree_max``, ``barrier``: each returns once every rank took part, host sync included) as
``Activity.COLLECTIVE`` and puts the activity back after, so a rank waiting in one says so.
``all_reduce`` returns before the host reads the result (under NCCL, before the wait): its caller marks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainer_sidecar.contract.status import Activity
from trainer_sidecar.guardian.activity import ActivityTracker

CPU = torch.device("cpu")
log = logging.getLogger("trainguard")


@dataclass(frozen=True)
class Gang:
    """The rank, the world size, and the device collectives run on (CUDA under NCCL, else the CPU); the
    tracker its collectives mark (None: none)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = CPU
    tracker: ActivityTracker | None = field(default=None, compare=False, repr=False)

    @classmethod
    def current(cls) -> Gang:
        """The gang of the default process group, or a gang of one when there is none."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        device = CPU
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(dist.get_rank(), dist.get_world_size(), device)

    @property
    def distributed(self) -> bool:
        """Whether there are other ranks to agree with."""
        return self.world_size > 1

    def log(self, level: int, message: str, *args: object) -> None:
        """Log a decision the whole gang took alike: once, from rank 0 (the other ranks at debug level)."""
        log.log(level if self.rank == 0 else logging.DEBUG, message, *args)

    def all_reduce(
        self, values: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """``values`` reduced over the gang (a copy on the collective device; the input is untouched)."""
        reduced = values.to(self.device, copy=True)
        if self.distributed:
            dist.all_reduce(reduced, op=op)
        return reduced

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Mark ``Activity.COLLECTIVE`` on the tracker inside, the previous activity after (also when the
        collective raises: a broken collective is where the rank was)."""
        tracker = self.tracker
        if tracker is None or not self.distributed:
            yield
            return
        previous = tracker.mark(Activity.COLLECTIVE)
        yield
        tracker.mark(previous)

    def agree_min(self, values: Sequence[int]) -> list[int]:
        """The element-wise minimum of ``values`` over every rank (one collective, one host sync)."""
        tensor = torch.tensor(list(values), dtype=torch.int64)
        with self.waiting():
            return [int(v) for v in self.all_reduce(tensor, dist.ReduceOp.MIN).tolist()]

    def agree_max(self, values: Sequence[int]) -> list[int]:
        """The element-wise maximum of ``values`` over every rank (one collective, one host sync)."""
        tensor = torch.tensor(list(values), dtype=torch.int64)
        with self.waiting():
            return [int(v) for v in self.all_reduce(tensor, dist.ReduceOp.MAX).tolist()]

    def barrier(self) -> None:
        """Wait for every rank (a no-op without other ranks)."""
        if self.distributed:
            with self.waiting():
                dist.barrier()

"""The guardian's loader glue: a GuardedLoader made for this rank, and the batches ``run`` yields.

``Loading.guarded`` builds this rank's ``GuardedLoader`` (a DataLoader's settings taken over,
``feed.taken_over``) and attaches it to the data feed, whose position checkpoints keep;
``batches_until`` yields its batches epoch after epoch until the run's last step, noting each batch
in the step being accumulated (``Accumulation``) so that a bad step names the batches it came from.

Built by the Guardian with what it works on, called only by it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainer_sidecar.contract.status import Activity
from trainer_sidecar.guardian.config import ConfigError
from trainer_sidecar.guardian.counters import GuardCounters
from trainer_sidecar.guardian.data import DeadLetters, GuardedLoader, SizedDataset
from trainer_sidecar.guardian.faults import FaultInjector
from trainer_sidecar.guardian.feed import DataFeed, taken_over
from trainer_sidecar.guardian.forensics import BatchRef
from trainer_sidecar.guardian.gang import Gang

__all__ = ["Accumulation", "Loading"]


@dataclass
class Accumulation:
    """The step being accumulated: its micro-batches so far (``micro``), the sum of their losses, the
    batches they trained on, and the batch the loader yielded last (``current``)."""

    micro: int = 0
    loss_sum: torch.Tensor | None = None
    batches: list[BatchRef] = field(default_factory=list)
    current: BatchRef | None = None


class Loading:
    """The loaders the guardian makes, and the batches ``Guardian.run`` yields."""

    def __init__(
        self,
        feed: DataFeed,
        dead_letters: DeadLetters,
        faults: FaultInjector,
        counters: GuardCounters,
        gang: Gang,
        mark: Callable[[Activity], Activity],
        accumulation: Accumulation,
    ) -> None:
        self.feed, self.dead_letters, self._faults = feed, dead_letters, faults
        self.counters, self.gang, self._mark, self._acc = counters, gang, mark, accumulation

    def guarded(
        self,
        dataset: SizedDataset | DataLoader[Any],
        batch_size: int | None,
        shuffle: bool,
        seed: int,
        collate_fn: Callable[[list[Any]], Any] | None,
        num_workers: int,
        drop_last: bool,
        loading: dict[str, Any],
        pad_shards: bool,
    ) -> GuardedLoader:
        """A GuardedLoader of ``dataset`` for this rank (see ``Guardian.loader``), attached to the feed."""
        if isinstance(dataset, DataLoader):
            over = taken_over(dataset)
            dataset, batch_size, shuffle, collate_fn, num_workers, loading = over[:6]
            drop_last, pad_shards = over.drop_last, over.pad_shards
        assert not isinstance(dataset, DataLoader)
        if batch_size is None:
            raise ConfigError(
                "Guardian.loader() needs batch_size= for a dataset (a DataLoader brings its own)"
            )
        loader = GuardedLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            collate_fn=collate_fn,
            num_workers=num_workers,
            loading=loading,
            rank=self.gang.rank,
            world_size=self.gang.world_size,
            drop_last=drop_last,
            pad_shards=pad_shards,
            dead_letters=self.dead_letters,
            inject_bad_sample=self._faults.bad_sample_hook(lambda: self.counters.step)
            if self._faults.active
            else None,
        )
        self.feed.attach(loader)
        return loader

    def batches_until(self, loader: GuardedLoader, max_steps: int) -> Iterator[Any]:
        """Yield ``loader``'s batches, epoch after epoch, until ``max_steps`` steps are kept (at a step
        boundary). Raises RuntimeError when two epochs in a row yield nothing."""
        empty_epochs = 0
        mark = self._mark
        while self.counters.step < max_steps:
            yielded = False
            mark(Activity.DATA)  # an epoch's start (a shuffle, the loader's workers) is the loader's too
            batches = iter(loader)
            while True:
                mark(Activity.DATA)
                batch = next(batches, None)
                mark(Activity.LOOP)
                if batch is None:
                    break
                yielded = True
                self._acc.current = BatchRef(batch.epoch, batch.index, batch.sample_ids)
                yield batch.data
                if self.counters.step >= max_steps and self._acc.micro == 0:
                    return
            empty_epochs = 0 if yielded else empty_epochs + 1
            if empty_epochs >= 2:
                raise RuntimeError("the loader yields no batch (every batch dead-lettered or dataset empty)")

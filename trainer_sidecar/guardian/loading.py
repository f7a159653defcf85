"""The guardian's loader glue: a GuardedLoader made for this rank, and the batches ``run`` yields.

(Moved verbatim out of ``guardian.py``; reshaped into a collaborator in the next commit.)
"""
# mypy: disable-error-code="attr-defined"

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from trainer_sidecar.contract.status import Activity
from trainer_sidecar.guardian.config import ConfigError
from trainer_sidecar.guardian.data import GuardedLoader, SizedDataset
from trainer_sidecar.guardian.feed import taken_over
from trainer_sidecar.guardian.forensics import BatchRef


class LoadingMixin:
    """The Guardian's loader glue (moved verbatim)."""

    def _guarded_loader(
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
            rank=self.rank,
            world_size=self.world_size,
            drop_last=drop_last,
            pad_shards=pad_shards,
            dead_letters=self.dead_letters,
            inject_bad_sample=self._faults.bad_sample_hook(lambda: self.counters.step)
            if self._faults.active
            else None,
        )
        self.feed.attach(loader)
        return loader

    def _batches_until(self, loader: GuardedLoader, max_steps: int) -> Iterator[Any]:
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
                self._current_batch = BatchRef(batch.epoch, batch.index, batch.sample_ids)
                yield batch.data
                if self.counters.step >= max_steps and self._micro == 0:
                    return
            empty_epochs = 0 if yielded else empty_epochs + 1
            if empty_epochs >= 2:
                raise RuntimeError("the loader yields no batch (every batch dead-lettered or dataset empty)")

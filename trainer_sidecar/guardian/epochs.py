"""A loop of epochs driven by the guardian (``guardian.epochs(n)`` around, ``guardian.batches(loader)``
inside), keeping the loop's own DataLoader, sampler, ``set_epoch``, per-epoch scheduler, evaluation and
saves.

Two positions are kept, both in every checkpoint:

- ``EpochPosition``, the epoch the loop is in, goes back with the weights on a rollback like everything
  else tracked (``feed.rolls_back``): a rollback across an epoch's end takes the epoch back with the
  scheduler the loop stepped there and its best score, so that end runs again, from the state before it.
- ``DataFrontier``, the next batch of the loop's loader, never goes back: a rollback skips the window
  that led to it (as the guardian's own loader does), so an epoch rolled back into has no batch left and
  only its end runs again; the epochs after it resume at the frontier. The end of the data is the end of
  training, whatever the step count.

A resume starts a partly trained epoch at the frontier's batch by index: the loader's batch sampler is
walked for its indices only and the skipped batches are never loaded (``SkippedBatches``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

from trainer_sidecar.guardian.config import ConfigError

log = logging.getLogger(__name__)


class EpochPosition:
    """The epoch the loop is in (tracked; goes back with the weights on a rollback). ``restored`` says
    whether a checkpoint set it (then a ``start`` epoch of the loop's own does not apply)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.restored = False

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch": n}``."""
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the saved epoch (from a checkpoint, or a snapshot on a rollback)."""
        self.epoch = int(state["epoch"])
        self.restored = True


class DataFrontier:
    """The next batch of the loop's training loader: ``(epoch, batch)``, every earlier batch consumed
    (trained, skipped or dead-lettered). Tracked, but never rolled back: the data does not rewind."""

    rolls_back: ClassVar[bool] = False

    def __init__(self) -> None:
        self.epoch = 0
        self.batch = 0

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch": e, "batch": b}``."""
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's frontier."""
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])

    def first_batch(self, epoch: int) -> int | None:
        """The first batch of ``epoch`` not consumed yet (None: the whole epoch is)."""
        if self.epoch > epoch:
            return None
        return self.batch if self.epoch == epoch else 0


class SkippedBatches(Sampler[list[int]]):
    """A loader's batches from ``start`` on, without those ``dead`` says to skip: the batch sampler is
    walked for its indices only (no sample is loaded for a skipped batch). Each batch's index in the
    epoch is queued in ``indices`` as it is handed out, in the order the loader yields the batches."""

    def __init__(self, batches: Iterable[list[int]], start: int, dead: Callable[[int], bool]) -> None:
        self.batches, self.start, self.dead = batches, start, dead
        self.indices: deque[int] = deque()

    def __len__(self) -> int:
        return max(0, len(self.batches) - self.start)  # type: ignore[arg-type]  # a BatchSampler's

    def __iter__(self) -> Iterator[list[int]]:
        for index, batch in enumerate(self.batches):
            if index >= self.start and not self.dead(index):
                self.indices.append(index)
                yield list(batch)


def resumed_loader(
    loader: DataLoader[Any], start: int, dead: Callable[[int], bool]
) -> tuple[DataLoader[Any], SkippedBatches]:
    """A DataLoader like ``loader`` (its dataset, sampler order, collate function, workers and how they
    load) that yields its batches from ``start`` on, skipping the ``dead`` ones by index. Its own
    generator keeps the loop's random generators as they were restored (``loader``'s iterator drew its
    seed at the epoch's start, before the checkpoint)."""
    if loader.batch_sampler is None:
        raise ConfigError(
            "guardian.batches(loader): the DataLoader has batch_size=None, so it has no batches to skip by "
            "index; give it a batch_size (or a batch_sampler)"
        )
    skipped = SkippedBatches(loader.batch_sampler, start, dead)
    loading: dict[str, Any] = {}
    if loader.num_workers > 0:
        loading.update(prefetch_factor=loader.prefetch_factor, persistent_workers=False)
    resumed = DataLoader(
        loader.dataset,
        batch_sampler=skipped,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator if loader.generator is not None else torch.Generator().manual_seed(start),
        **loading,
    )
    return resumed, skipped


def draws_a_new_order(loader: DataLoader[Any]) -> bool:
    """Whether iterating ``loader`` again draws another order from the global random generator (a
    RandomSampler without a generator of its own): its resumed epoch is then not the interrupted one."""
    batches = loader.batch_sampler
    sampler = batches.sampler if isinstance(batches, BatchSampler) else loader.sampler
    return isinstance(sampler, RandomSampler) and sampler.generator is None


class EpochLoop:
    """The epochs and batches of a loop driven by ``guardian.epochs`` and ``guardian.batches``.

    ``track(name, obj)`` keeps an object in the checkpoints (restoring a resumed state into it);
    ``dead(epoch, batch)`` says whether a batch is to be skipped (dead-lettered); ``taken(epoch, batch)``
    tells the guardian which batch the coming step trains (for its window and dead letters);
    ``data_done()`` is called when an epoch's data runs out, before the loop's epoch end."""

    def __init__(
        self,
        track: Callable[[str, Any], None],
        dead: Callable[[int, int], bool],
        taken: Callable[[int, int], None],
        data_done: Callable[[], None],
    ) -> None:
        self.position, self.frontier = EpochPosition(), DataFrontier()
        track("epoch", self.position)
        track("data_frontier", self.frontier)
        self._dead, self._taken, self._data_done = dead, taken, data_done
        self._running = False  # inside ``epochs``
        self._served: int | None = None  # the epoch whose batches were given since it was yielded
        self._new_order_warned = False

    def epochs(self, epochs: int, start: int = 0) -> Iterator[int]:
        """Yield the epochs to run, from the checkpoint's (or ``start`` without one) to ``epochs - 1``.

        Each yielded epoch's body trains its batches (``batches``) and runs its end. After a rollback
        into an earlier epoch the body's end is that epoch's, run again from the state before it, and
        the epochs from there on are yielded again (without the batches already consumed)."""
        for name, value in (("epochs", epochs), ("start", start)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"guardian.epochs({name}=...) must be an integer >= 0, got {value!r}")
        position = self.position
        if not position.restored:
            position.epoch = start
            position.restored = True  # from now on the epoch is the guardian's
        elif start not in (0, position.epoch):
            log.warning(
                "guardian.epochs(start=%d) is not used: the guardian's own checkpoint is in epoch %d and "
                "takes over (its weights, optimizer, data position and what the loop tracks)",
                start, position.epoch,
            )  # fmt: skip
        self._running = True
        try:
            while position.epoch < epochs:
                epoch = position.epoch
                if (self.frontier.epoch, self.frontier.batch) < (epoch, 0):
                    self.frontier.epoch, self.frontier.batch = epoch, 0
                self._served = None
                yield epoch
                # The body ran the end of the epoch the loop is in: the yielded one, or the one a
                # rollback took it back into.
                position.epoch += 1
        finally:
            self._running = False

    def batches(self, loader: DataLoader[Any]) -> Iterator[Any]:
        """Yield ``loader``'s batches of the current epoch that are not consumed yet, skipping the
        dead-lettered ones by index; end when its data runs out or a rollback took the loop back into an
        earlier epoch (whose end then runs)."""
        epoch = self._check_batches(loader)
        first = self.frontier.first_batch(epoch)
        if first is not None:
            yield from self._walk(loader, epoch, first)
        self._data_done()

    def _check_batches(self, loader: DataLoader[Any]) -> int:
        if not isinstance(loader, DataLoader):
            raise ConfigError(
                f"guardian.batches() takes the loop's training DataLoader, got {type(loader).__name__}"
            )
        if isinstance(loader.dataset, IterableDataset):
            raise ConfigError(
                "guardian.batches(loader): the DataLoader is over an IterableDataset, which has no index to "
                "resume an epoch at; keep iterating it and give the guardian its state instead: torchdata's "
                "StatefulDataLoader with guardian.track(...)"
            )
        if not self._running:
            raise ConfigError(
                "guardian.batches(loader) runs inside `for epoch in guardian.epochs(n):` (the epoch it "
                "serves is the guardian's); a loop without epochs iterates guardian.run(loader, max_steps)"
            )
        epoch = self.position.epoch
        if self._served == epoch:
            raise ConfigError(
                f"guardian.batches() was called twice in epoch {epoch}: it gives the training data, once "
                "per epoch; an evaluation iterates its own loader directly"
            )
        self._served = epoch
        return epoch

    def _walk(self, loader: DataLoader[Any], epoch: int, first: int) -> Iterator[Any]:
        dead = self._dead
        plain = first == 0 and not any(dead(epoch, b) for b in range(len(loader)))
        indices: deque[int] | None = None
        if plain:
            batches: Any = loader  # exactly the loop's own iteration, its random draws included
        else:
            if first > 0 and draws_a_new_order(loader) and not self._new_order_warned:
                self._new_order_warned = True
                log.warning(
                    "epoch %d resumes at batch %d of a DataLoader whose RandomSampler draws a new order: "
                    "the rest of the epoch is not the order it was (use a DistributedSampler and "
                    "set_epoch, or a sampler with a generator seeded by the epoch)",
                    epoch, first,
                )  # fmt: skip
            batches, skipped = resumed_loader(loader, first, lambda b: dead(epoch, b))
            indices = skipped.indices
        for count, data in enumerate(batches):
            index = indices.popleft() if indices is not None else count
            self.frontier.epoch, self.frontier.batch = epoch, index + 1
            self._taken(epoch, index)
            yield data
            if self.position.epoch != epoch:
                return  # rolled back into an earlier epoch: its end runs now, then the epochs again

"""The data guard: deterministic, resumable batches with bad samples dropped before they reach the model.

``GuardedLoader`` owns the order of the data so that a resumed job continues at exactly the batch it
stopped at: each epoch's order is a permutation drawn from the seed and the epoch (identical on every
rank and every restart; computed per batch, never stored: ``guardian.permutation``), rank ``r``
of ``w`` takes every ``w``-th sample, and resuming skips consumed batches by index without loading them.
Batch ``b`` of all ranks together covers the positions ``[start + b*bs*w, start + (b+1)*bs*w)`` of the
epoch's order (``start`` is 0 but in an epoch resumed under another world size or batch size), so a
position is also a number of samples (``DataPosition.sample``): a checkpoint carries it, and a gang of
another size resumes at the same sample, neither repeating nor skipping one.
Samples that are empty or hold non-finite numbers are dropped inside the collate function (so it works
with loader worker processes) and counted.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from trainer_sidecar.checkpoint import fs
from trainer_sidecar.checkpoint.errors import CheckpointError
from trainer_sidecar.guardian.config import ConfigError
from trainer_sidecar.guardian.permutation import Permutation

log = logging.getLogger(__name__)

DEAD_LETTER_NAME = "dead-letter.jsonl"
MAX_DEAD_LETTER_BYTES = 64 << 20  # about half a million entries; a larger file is not ours


class SizedDataset(Protocol):
    """A map-style dataset: ``len`` and integer indexing."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


@dataclass
class DataPosition:
    """Where the data stream is: the epoch and the next batch index within it (same on every rank), and
    ``start``, the position in the epoch's order where batch 0 of this numbering begins (0 but in an epoch
    resumed under another world size or batch size)."""

    epoch: int = 0
    batch: int = 0
    start: int = 0

    def sample(self, samples_per_batch: int) -> int:
        """The position in the epoch's order of the next sample, over all ranks, for batches of
        ``samples_per_batch`` samples over all ranks (batch size times world size)."""
        return self.start + self.batch * samples_per_batch

    def as_dict(self) -> dict[str, int]:
        """Plain form for checkpoints and status."""
        return {"epoch": self.epoch, "batch": self.batch}


@dataclass
class DataCounters:
    """Samples seen and dropped by this rank, cumulative over the job."""

    seen: int = 0
    dropped: int = 0

    @property
    def drop_rate(self) -> float:
        """Dropped over seen; 0 before any sample."""
        return self.dropped / self.seen if self.seen else 0.0


@dataclass(frozen=True)
class GuardedBatch:
    """A collated batch of good samples and what the guard did to make it."""

    data: Any
    epoch: int
    index: int
    sample_ids: tuple[int, ...]
    seen: int
    dropped: int


def sample_is_bad(sample: Any) -> bool:
    """True when a sample is empty (None, an empty tensor/sequence/mapping) or holds a non-finite number."""
    if sample is None:
        return True
    if isinstance(sample, torch.Tensor):
        if sample.numel() == 0:
            return True
        return bool(sample.is_floating_point() and not torch.isfinite(sample).all())
    if isinstance(sample, float):
        return not math.isfinite(sample)
    if isinstance(sample, dict):
        return len(sample) == 0 or any(sample_is_bad(v) for v in sample.values())
    if isinstance(sample, (list, tuple)):
        return len(sample) == 0 or any(sample_is_bad(v) for v in sample)
    return False


def poison(sample: Any) -> Any:
    """A copy of ``sample`` with every floating tensor (or the whole sample, if it is one) set to NaN.

    Integer-only samples (token ids) have nothing to poison; they become empty instead, which the
    guard drops just the same.
    """
    if isinstance(sample, torch.Tensor):
        return torch.full_like(sample, math.nan) if sample.is_floating_point() else sample[:0]
    if isinstance(sample, dict):
        return {key: poison(value) for key, value in sample.items()}
    if isinstance(sample, (list, tuple)):
        return type(sample)(poison(value) for value in sample)
    return None


class _FilteringCollate:
    """Drops bad samples, then collates the rest with the user's function (runs in loader workers)."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, items: list[tuple[int, int, Any]]) -> tuple[int, Any, tuple[int, ...], int, int]:
        good = [(index, sample) for _, index, sample in items if not sample_is_bad(sample)]
        dropped = len(items) - len(good)
        data = self.collate([sample for _, sample in good]) if good else None
        return items[0][0], data, tuple(index for index, _ in good), len(items), dropped


class _IndexedDataset(Dataset[tuple[int, int, Any]]):
    """Fetches by ``(batch number, sample index)`` and yields ``(batch number, index, sample)``, so that
    every batch names itself and its samples (for dead letters and dropped samples)."""

    def __init__(self, dataset: SizedDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, int, Any]:
        batch, index = key
        return batch, index, self.dataset[index]


class _LazyBatches(Sampler[list[tuple[int, int]]]):
    """The batches of one epoch from a start batch on, each computed when it is asked for (the order is
    never stored), skipping dead-lettered ones."""

    def __init__(self, loader: GuardedLoader, epoch: int, start: int) -> None:
        self.loader, self.epoch, self.start = loader, epoch, start

    def __len__(self) -> int:
        return max(0, self.loader.batches_in(self.epoch) - self.start)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        loader = self.loader
        for batch in range(self.start, loader.batches_in(self.epoch)):
            if not loader.dead_letters.is_dead(self.epoch, batch, loader.span(self.epoch, batch)):
                yield [(batch, int(i)) for i in loader.batch_indices(self.epoch, batch)]


@dataclass
class DeadLetters:
    """Batches never to replay (non-finite loss, or a rolled-back window), kept beside the checkpoints.

    Keyed by (epoch, batch index), which is the same on every rank: skipping a batch on all ranks keeps
    them in lockstep; and, when the entry carries it, by the span of the epoch's order the batch covered
    over all ranks (``first``, ``end``: sample positions), which is what a gang of another world size
    skips (every batch of its own overlapping the span). Entries without a span (older files) are taken
    to be of the current world size. Rank 0 writes the file; every rank reads it at start.
    """

    path: Path | None
    skip: set[tuple[int, int]] = field(default_factory=set)
    spans: set[tuple[int, int, int]] = field(default_factory=set)

    def is_dead(self, epoch: int, batch: int, span: tuple[int, int] | None = None) -> bool:
        """Whether batch ``batch`` of ``epoch`` (covering ``span`` of the epoch's order) is to be skipped."""
        if (epoch, batch) in self.skip:
            return True
        if span is None:
            return False
        first, end = span
        return any(e == epoch and f < end and first < n for e, f, n in self.spans)

    def _remember(self, entry: dict[str, Any]) -> None:
        epoch, first, end = entry["epoch"], entry.get("first"), entry.get("end")
        if first is None or end is None:
            self.skip.add((int(epoch), int(entry["batch"])))
        else:
            self.spans.add((int(epoch), int(first), int(end)))

    def load(self) -> None:
        """Read the file; unreadable lines, or a file that is not a regular file, are logged and ignored."""
        if self.path is None:
            return
        try:
            with fs.open_side_dir(self.path.parent) as dir_fd:
                data = fs.read_if_present(dir_fd, self.path.name, MAX_DEAD_LETTER_BYTES, str(self.path))
        except CheckpointError as exc:
            log.warning("dead letters not read: %s", exc)
            return
        for number, line in enumerate((data or b"").decode(errors="replace").splitlines(), start=1):
            try:
                self._remember(json.loads(line))
            except (ValueError, KeyError, TypeError):
                log.warning("%s line %d is not a dead-letter entry; ignored", self.path, number)

    def add(
        self, epoch: int, batch: int, *, write: bool, span: tuple[int, int] | None = None, **details: Any
    ) -> None:
        """Remember a batch to skip on replay (with ``span``, the positions of the epoch's order it covered
        over all ranks); appends one JSON line when ``write`` (rank 0).

        A file that cannot be written (a planted link, a full volume) is logged: the batch is still
        skipped by this process, and a later attempt finds the anomaly again if it replays it."""
        entry: dict[str, Any] = {"epoch": epoch, "batch": batch}
        if span is not None:
            entry.update(first=span[0], end=span[1])
        self._remember(entry)
        if not write or self.path is None:
            return
        line = (json.dumps({**entry, **details}) + "\n").encode()
        try:
            with fs.open_side_dir(self.path.parent) as dir_fd:
                fs.append_durably(dir_fd, self.path.name, line, str(self.path))
        except (CheckpointError, OSError) as exc:
            log.error("dead letter (epoch %d, batch %d) not recorded: %s", epoch, batch, exc)


class GuardedLoader:
    """Resumable, rank-sharded, sample-filtering batches over a map-style dataset.

    Iterating yields ``GuardedBatch`` objects from the current position to the end of the epoch, then
    advances the epoch; ``position`` always names the next batch, so a checkpoint taken between two
    steps resumes at exactly the next batch. ``loading`` holds further ``DataLoader`` arguments on how
    batches are loaded (``worker_init_fn``, ``pin_memory``, ...), passed on unchanged.
    """

    def __init__(
        self,
        dataset: SizedDataset,
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        loading: Mapping[str, Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
        dead_letters: DeadLetters | None = None,
        inject_bad_sample: Callable[[], bool] | None = None,
        drop_last: bool = True,
        pad_shards: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(
                f"Guardian.loader(batch_size=...): batch_size must be at least 1, got {batch_size}"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.collate = _FilteringCollate(collate_fn or default_collate)
        self.num_workers = num_workers
        self.loading = dict(loading or {})
        self.rank = rank
        self.world_size = world_size
        #: Whether each rank's last batch of an epoch is dropped when it is partial (DataLoader's
        #: ``drop_last``), and whether the ranks' shards are evened out by repeating the epoch's first
        #: samples (DistributedSampler's ``drop_last=False``) rather than by dropping the last few.
        self.drop_last = drop_last
        self.pad_shards = pad_shards
        self.position = DataPosition()
        #: The epoch and start position of a resumed epoch (``DataPosition.start``), kept for that epoch
        #: after the position moved on.
        self._origin = (0, 0)
        self.counters = DataCounters()
        self.dead_letters = dead_letters or DeadLetters(None)
        #: Fault-injection hook, asked once per batch: True adds a NaN-poisoned copy of the batch's first
        #: sample, which must then be caught and counted by the same check as any bad sample.
        self.inject_bad_sample = inject_bad_sample
        self._last_good: GuardedBatch | None = None
        self._permutation: tuple[int, Permutation] | None = None
        if self.batches_per_epoch == 0:
            raise ConfigError(
                f"dataset of {len(dataset)} samples gives no "
                f"{'full ' if drop_last else ''}batch of {batch_size} per rank with {world_size} ranks"
            )

    def _per_rank(self, remaining: int) -> int:
        """Samples each rank takes of ``remaining`` positions of an epoch's order: as many on every rank."""
        return -(-remaining // self.world_size) if self.pad_shards else remaining // self.world_size

    def _batches(self, per_rank: int) -> int:
        return per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)

    @property
    def batches_per_epoch(self) -> int:
        """Batches each rank gets in a whole epoch: the same on every rank, a partial last one included
        unless ``drop_last``."""
        return self._batches(self._per_rank(len(self.dataset)))

    @property
    def samples_per_batch(self) -> int:
        """Samples in one batch of all ranks together."""
        return self.batch_size * self.world_size

    def _start(self, epoch: int) -> int:
        return self._origin[1] if epoch == self._origin[0] else 0

    def _steps_in(self, epoch: int) -> int:
        """Samples each rank takes in ``epoch`` from its start position."""
        return self._per_rank(len(self.dataset) - self._start(epoch))

    def batches_in(self, epoch: int) -> int:
        """Batches of each rank in ``epoch`` from its start position (``batches_per_epoch`` but in an
        epoch resumed under another world size or batch size)."""
        return self._batches(self._steps_in(epoch))

    def span(self, epoch: int, batch: int) -> tuple[int, int]:
        """The positions ``[first, end)`` of ``epoch``'s order that ``batch`` covers over all ranks (a
        partial last batch ends with the epoch; positions repeated to even out the shards are not
        counted)."""
        start = self._start(epoch)
        first = start + batch * self.samples_per_batch
        end = min(first + self.samples_per_batch, start + self._steps_in(epoch) * self.world_size)
        return first, min(end, len(self.dataset))

    def _order(self, epoch: int) -> Permutation | None:
        if not self.shuffle:
            return None
        if self._permutation is None or self._permutation[0] != epoch:
            self._permutation = (epoch, Permutation(len(self.dataset), self.seed * 1_000_003 + epoch))
        return self._permutation[1]

    def batch_indices(self, epoch: int, batch: int) -> list[int]:
        """The sample indices of this rank's ``batch`` in ``epoch``: position ``p`` of the epoch's order
        goes to rank ``p % world_size``. Deterministic in (seed, epoch, rank, world size); O(batch) work
        and memory whatever the dataset's size."""
        first = batch * self.batch_size
        steps = np.arange(first, min(first + self.batch_size, self._steps_in(epoch)), dtype=np.int64)
        return self._indices(epoch, self._start(epoch) + steps * self.world_size + self.rank)

    def _indices(self, epoch: int, positions: npt.NDArray[np.int64]) -> list[int]:
        """The sample index at each position of ``epoch``'s order; a position past the end (evening out
        the shards) repeats one from the epoch's start, as DistributedSampler pads."""
        positions = positions % len(self.dataset)
        order = self._order(epoch)
        return [int(i) for i in (order.at(positions) if order is not None else positions)]

    def epoch_order(self, epoch: int) -> list[int]:
        """Every sample index this rank takes in a whole ``epoch``, in order (O(dataset): for tests and
        tools)."""
        steps = np.arange(min(self._per_rank(len(self.dataset)), self.batches_per_epoch * self.batch_size))
        return self._indices(epoch, (steps * self.world_size + self.rank).astype(np.int64))

    def __iter__(self) -> Iterator[GuardedBatch]:
        epoch, start = self.position.epoch, self.position.batch
        loader = DataLoader(
            _IndexedDataset(self.dataset),
            batch_sampler=_LazyBatches(self, epoch, start),
            collate_fn=self.collate,
            num_workers=self.num_workers,
            # Without its own generator, creating the iterator draws a seed from the global torch RNG:
            # a job resumed mid-epoch would then consume that RNG at a different point than the
            # original run, and dropout masks (so the weights) would differ after the resume.
            generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch),
            **self.loading,
        )
        for b, data, ids, seen, dropped in loader:
            if self.inject_bad_sample is not None and self.inject_bad_sample():
                poisoned = poison(self.dataset[self.batch_indices(epoch, b)[0]])
                seen += 1
                dropped += int(sample_is_bad(poisoned))
            self.counters.seen += seen
            self.counters.dropped += dropped
            # After an epoch's last batch the position is the next epoch's start, so that a checkpoint
            # taken there resumes at it (a partial last batch has no next batch in its epoch).
            last = b + 1 >= self.batches_in(epoch)
            self.position = (
                DataPosition(epoch + 1, 0) if last else DataPosition(epoch, b + 1, self.position.start)
            )
            if data is None:
                if self.world_size == 1:
                    log.warning("every sample of batch %d in epoch %d was bad; batch skipped", b, epoch)
                    continue
                if self._last_good is None:
                    raise RuntimeError(
                        f"every sample of batch {b} in epoch {epoch} was bad and none came before"
                    )
                # Ranks must stay in lockstep: repeat the last good batch rather than skip a step alone.
                log.warning(
                    "every sample of batch %d in epoch %d was bad; repeating the previous batch", b, epoch
                )
                data, ids = self._last_good.data, self._last_good.sample_ids
            batch = GuardedBatch(data, epoch, b, ids, seen, dropped)
            self._last_good = batch
            yield batch
        self.position = DataPosition(epoch + 1, 0)

    def state_dict(self) -> dict[str, int]:
        """Position (also as ``sample``: the next sample's place in the epoch's order over all ranks) and
        counters, for checkpoints."""
        return {
            **self.position.as_dict(),
            "sample": self.position.sample(self.samples_per_batch),
            "seen": self.counters.seen,
            "dropped": self.counters.dropped,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position with the saved counters. A state with ``sample`` resumes at that
        sample whatever the world size and batch size that saved it (the next batch starts there); an
        older one, without it, at its batch index."""
        epoch = int(state["epoch"])
        if "sample" in state:
            sample = int(state["sample"])
            if not 0 <= sample <= len(self.dataset):
                raise ValueError(f"data position sample {sample} is outside a dataset of {len(self.dataset)}")
            batch, start = divmod(sample, self.samples_per_batch)
            self.position = DataPosition(epoch, batch, start)
        else:
            self.position = DataPosition(epoch, int(state["batch"]))
        self._origin = (self.position.epoch, self.position.start)
        self.counters = DataCounters(int(state.get("seen", 0)), int(state.get("dropped", 0)))

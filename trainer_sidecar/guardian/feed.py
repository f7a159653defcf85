"""Where the data stands, as a checkpoint keeps it: the guardian's own loader and the loop's own stateful
objects (``DataFeed``), restored on resume into whatever the loop attaches later.

A loop resumes its data exactly in one of three ways: the guardian's ``GuardedLoader`` (its position), an
object the loop asks the guardian to track (anything with ``state_dict`` and ``load_state_dict``, such
as torchdata's StatefulDataLoader), or a batch function drawing from the random generators (which the
guardian restores anyway).
"""

from __future__ import annotations

import copy
from collections.abc import MutableMapping
from typing import Any, NamedTuple, Protocol

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from trainer_sidecar.checkpoint import CheckpointError
from trainer_sidecar.checkpoint.format import serialize
from trainer_sidecar.guardian.config import ConfigError
from trainer_sidecar.guardian.data import GuardedLoader
from trainer_sidecar.tensors.tensorstate import flatten


class Stateful(Protocol):
    """What ``Guardian.track`` keeps in checkpoints."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class DataFeed:
    """The data positions of one rank: ``state()`` for a checkpoint, ``restore()`` from one. Anything
    restored before it is attached is kept and applied when it is."""

    def __init__(self) -> None:
        self.loader: GuardedLoader | None = None
        self._tracked: dict[str, Stateful] = {}
        self._pending: dict[str, Any] = {}

    def attach(self, loader: GuardedLoader) -> None:
        """Keep ``loader``'s position (restoring a resumed one into it)."""
        self.loader = loader
        if "data" in self._pending:
            loader.load_state_dict(self._pending.pop("data"))

    def span(self, epoch: int, batch: int) -> tuple[int, int] | None:
        """The positions of ``epoch``'s order that ``batch`` covers over all ranks (None without a
        loader: a loop feeding its own batches)."""
        return self.loader.span(epoch, batch) if self.loader is not None else None

    def track(self, name: str, stateful: Stateful) -> None:
        """Keep ``stateful``'s state; raises ConfigError at once when it cannot be checkpointed."""
        try:
            serialize(*flatten({name: stateful.state_dict()}))
        except CheckpointError as exc:
            raise ConfigError(f"Guardian.track({name!r}): its state cannot be checkpointed: {exc}") from exc
        self._tracked[name] = stateful
        if name in self._pending:
            stateful.load_state_dict(self._pending.pop(name))

    @property
    def tracked(self) -> tuple[Stateful, ...]:
        """What the loop gave ``track``."""
        return tuple(self._tracked.values())

    def rollback_state(self) -> dict[str, Any]:
        """The state of every tracked object that goes back with the weights on a rollback (``rolls_back``),
        by name, as the objects return it (the snapshot copies it)."""
        return {name: obj.state_dict() for name, obj in self._tracked.items() if rolls_back(obj)}

    def roll_back(self, saved: dict[str, Any]) -> None:
        """Put ``rollback_state()``'s output back into the objects still tracked under those names (a copy:
        the saved state stays as it was, for a further rollback)."""
        for name, state in saved.items():
            if name in self._tracked:
                self._tracked[name].load_state_dict(copy.deepcopy(state))

    def state(self) -> dict[str, Any]:
        """``{"data": loader position, "tracked": {name: state}}``, the parts that exist."""
        state: dict[str, Any] = {}
        if self.loader is not None:
            state["data"] = self.loader.state_dict()
        if self._tracked:
            state["tracked"] = {name: obj.state_dict() for name, obj in self._tracked.items()}
        return state

    def restore(self, state: dict[str, Any]) -> None:
        """Apply a checkpoint's ``state()`` now where attached, later where not yet."""
        if "data" in state:
            if self.loader is not None:
                self.loader.load_state_dict(state["data"])
            else:
                self._pending["data"] = state["data"]
        tracked = state.get("tracked")
        for name, saved in tracked.items() if isinstance(tracked, dict) else ():
            if name in self._tracked:
                self._tracked[name].load_state_dict(saved)
            else:
                self._pending[name] = saved


def rolls_back(stateful: object) -> bool:
    """Whether a tracked object goes back with the weights on a rollback: everything (a scheduler the loop
    steps, a best score, the loop's own counters) except a DataLoader (torchdata's StatefulDataLoader):
    a rollback does not rewind the data, it skips the window that led to it, as for the guardian's own
    loader (and a DataLoader's restored state would only apply to its next epoch's iterator), nor an
    object that says it does not (``rolls_back = False``: the epoch loop's data frontier)."""
    return not isinstance(stateful, DataLoader) and getattr(stateful, "rolls_back", True) is not False


class Variables:
    """Variables of a namespace (a module's ``globals()``: PyTorch's ImageNet example keeps ``best_acc1``
    there) as one tracked object: ``guardian.track("best", Variables(globals(), "best_acc1"))`` checkpoints
    them, and a resume or a rollback assigns them back in the namespace."""

    def __init__(self, namespace: MutableMapping[str, Any], *names: str) -> None:
        if not names:
            raise ConfigError("Variables(namespace, *names) needs at least one variable name")
        self.namespace, self.names = namespace, names

    def state_dict(self) -> dict[str, Any]:
        """The variables' current values, by name (an unset one is refused, naming it)."""
        missing = [name for name in self.names if name not in self.namespace]
        if missing:
            raise ConfigError(f"Variables: {', '.join(missing)} not set in the namespace given")
        return {name: self.namespace[name] for name in self.names}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Assign the saved values back."""
        for name in self.names:
            if name in state:
                self.namespace[name] = state[name]


class TakenOver(NamedTuple):
    """What the guardian keeps of a DataLoader it replaces with its own resumable order."""

    dataset: Any
    batch_size: int
    shuffle: bool
    collate_fn: Any
    num_workers: int
    #: How its batches are loaded, passed on unchanged: worker_init_fn, pin_memory, timeout, the
    #: multiprocessing context and, with workers, the prefetch factor.
    loading: dict[str, Any]
    #: Its ``drop_last``: whether an epoch's last, partial batch is dropped (else it is trained).
    drop_last: bool = False
    #: Whether the ranks' shards are evened out by repeating samples (a DistributedSampler's default,
    #: and what the guardian does when it shards a plain DataLoader) rather than by dropping the tail.
    pad_shards: bool = True


def taken_over(source: DataLoader[Any]) -> TakenOver:
    """What the guardian keeps of a DataLoader it replaces with its own resumable order: the dataset, the
    batch size, whether it shuffles, the collate function, the workers and how they load, and which
    samples an epoch trains (its ``drop_last``, and its DistributedSampler's). Raises ConfigError for one
    it cannot replace (an IterableDataset, a dataset without ``__len__``, ``batch_size=None``, a sampler
    that chooses samples), saying what to do."""
    if isinstance(source.dataset, IterableDataset):
        raise ConfigError(
            "Guardian.loader(): a DataLoader over an IterableDataset has no index to resume at; keep it and "
            "give the guardian its state instead: torchdata's StatefulDataLoader with guardian.track(...)"
        )
    if source.batch_sampler is None:
        raise ConfigError(
            "Guardian.loader(): the DataLoader has batch_size=None (each sample is its own batch, not "
            "collated); the guardian's order is of batches: give it batch_size=1 (and take the batch's "
            "first element), or keep the loader and give the guardian its state instead: torchdata's "
            "StatefulDataLoader with guardian.track(...)"
        )
    if source.batch_size is None:
        raise ConfigError(
            "Guardian.loader(): the DataLoader has a batch sampler of its own; pass batch_size="
        )
    try:
        len(source.dataset)  # type: ignore[arg-type]  # may have none: that is the check
    except TypeError as exc:
        raise ConfigError(
            f"Guardian.loader(): the DataLoader's dataset ({type(source.dataset).__name__}) has no length "
            f"({exc}); the guardian's order is a permutation of the whole dataset, so it needs __len__: "
            "define it, or keep the loader and give the guardian its state instead: torchdata's "
            "StatefulDataLoader with guardian.track(...)"
        ) from exc
    loading: dict[str, Any] = {
        "worker_init_fn": source.worker_init_fn,
        "pin_memory": source.pin_memory,
        "timeout": source.timeout,
        "multiprocessing_context": source.multiprocessing_context,
    }
    if source.num_workers > 0:
        loading["prefetch_factor"] = source.prefetch_factor
    sampler = source.sampler
    return TakenOver(
        source.dataset,
        source.batch_size,
        _shuffles(sampler),
        source.collate_fn,
        source.num_workers,
        loading,
        drop_last=bool(source.drop_last),
        pad_shards=not (isinstance(sampler, DistributedSampler) and sampler.drop_last),
    )


def _shuffles(sampler: object) -> bool:
    """Whether a DataLoader's sampler shuffles, for a sampler whose epoch is a permutation of the whole
    dataset (what the guardian's order is); ConfigError for one that chooses samples otherwise: its
    choice would be silently dropped."""
    if isinstance(sampler, SequentialSampler):
        return False
    if isinstance(sampler, DistributedSampler):  # the guardian shards by rank itself
        return bool(sampler.shuffle)
    if isinstance(sampler, RandomSampler):
        if not sampler.replacement and sampler.num_samples == len(sampler.data_source):
            return True
        what = "draws with replacement" if sampler.replacement else f"draws {sampler.num_samples} samples"
    else:
        what = f"is a {type(sampler).__name__}"
    raise ConfigError(
        f"Guardian.loader(): the DataLoader's sampler {what}, which chooses the samples an epoch sees; the "
        "guardian's order (each epoch a permutation of the whole dataset) would silently drop that "
        "choice. Give it a dataset of exactly those samples (torch.utils.data.Subset for a subset), or "
        "keep the loader and give the guardian its state instead: torchdata's StatefulDataLoader with "
        "guardian.track(...)"
    )

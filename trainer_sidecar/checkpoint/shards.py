"""Reading one rank's view of a checkpoint, written by a world of any size, without reading the rest.

A checkpoint's files (see ``format``): rank 0's holds the state every rank shares (counters, scheduler,
scaler, the optimizer's hyperparameters, the tensors of a replicated model) and, of a sharded model, its
own shards; every other rank's holds its shards, its random generators and its data position. A tensor
sharded over the ranks that wrote it is one name in several files, each with the box it holds.

``CheckpointReader`` opens the files and parses their headers only. Its ``state`` is rank 0's state
tree with every tensor a ``SavedTensor``, read on demand: ``SavedTensor.read(box)`` reads the bytes of
just that box from the files whose shards overlap it (the rows of each, for a tensor sharded along its
first dimension as FSDP2 shards, exactly the bytes needed), so a rank of a new world size gathers its
own shard from the old shards and never holds the whole model. The state of the rank's own (random
generators, data position, tracked objects: ``PER_RANK_KEYS``) comes from its own file when the writing
world had that rank; a rank it did not have starts those afresh, but for the data position, which is the
same on every rank and is taken from rank 0's (without rank 0's sample counters).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from trainer_sidecar.checkpoint import fs
from trainer_sidecar.checkpoint.errors import CheckpointError
from trainer_sidecar.checkpoint.format import Layout, TensorSpec, pread_exact, read_layout
from trainer_sidecar.checkpoint.layout import data_file_name
from trainer_sidecar.tensors.sharding import Box, read_all
from trainer_sidecar.tensors.tensorstate import unflatten

log = logging.getLogger(__name__)

PER_RANK_KEYS = ("rng", "data", "tracked")
"""Top-level keys of a checkpoint's state that each rank writes of its own."""

_RANK_COUNTERS = ("seen", "dropped")  # a data position's per-rank counters


@dataclass(frozen=True)
class Part:
    """One file's piece of a saved tensor: the open file, where the bytes lie, and the box they hold."""

    fd: int
    spec: TensorSpec
    where: str

    @property
    def box(self) -> Box:
        """The part of the global tensor this piece holds."""
        return self.spec.extent


class SavedTensor:
    """A tensor of a checkpoint, not read yet: its global shape and dtype, and the pieces that hold it.

    Satisfies ``sharding.Readable``. ``read`` raises CheckpointError when the pieces do not cover the box
    asked for, overlap each other, or a file ends early.
    """

    def __init__(self, name: str, parts: list[Part]) -> None:
        first = parts[0]
        self.name = name
        self._parts = parts
        self._shape = first.box.global_shape
        self._dtype = first.spec.dtype
        for part in parts[1:]:
            if part.box.global_shape != self._shape or part.spec.dtype != self._dtype:
                raise CheckpointError(
                    f"{part.where}: shard {name!r} is {part.spec.dtype} of {list(part.box.global_shape)}, "
                    f"but {first.where} has it {self._dtype} of {list(self._shape)}"
                )

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape."""
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        """The element type."""
        return self._dtype

    def __repr__(self) -> str:
        return f"SavedTensor({self.name!r}, {self._dtype}, {list(self._shape)}, {len(self._parts)} parts)"

    def read(self, box: Box | None = None) -> torch.Tensor:
        """The values of ``box`` of the global tensor (all of it when None), read from the pieces that
        overlap it, as a new contiguous CPU tensor."""
        target = box if box is not None else Box.whole(self._shape)
        if target.global_shape != self._shape:
            raise CheckpointError(f"{self.name!r} is {list(self._shape)}, not {list(target.global_shape)}")
        out = torch.empty(target.shape, dtype=self._dtype)
        used: list[Box] = []
        covered = 0
        for part in self._parts:
            overlap = part.box.intersect(target)
            if overlap is None or overlap in used:  # the same box twice: a replica of a shard
                continue
            if any(other.intersect(overlap) is not None for other in used):
                raise CheckpointError(f"{part.where}: shard {self.name!r} overlaps another shard of it")
            out[overlap.within(target)] = _read_box(part, overlap)
            used.append(overlap)
            covered += overlap.numel
        if covered != target.numel:
            raise CheckpointError(
                f"{self._parts[0].where}: the saved shards of {self.name!r} do not cover "
                f"{list(target.shape)} at {list(target.offset)} of {list(self._shape)}"
            )
        return out


def _check_tiling(name: str, parts: list[Part]) -> None:
    """The distinct boxes of ``parts`` (a replica's box counts once) must tile the global tensor exactly:
    no overlap, no gap. Checked from the tables alone, before anything is allocated, so the bytes a read
    of the global tensor allocates are those of distinct pieces the files hold: never more than their
    own bytes on disk, whatever global shape a shard table claims. CheckpointError naming a file."""
    boxes: dict[Box, Part] = {}
    for part in parts:
        boxes.setdefault(part.box, part)
    # Sweep along the first dimension, so row shards (FSDP2's) cost n log n, not n squared.
    ordered = sorted(boxes.items(), key=lambda item: item[0].offset[:1])
    active: list[Box] = []
    covered = 0
    for box, part in ordered:
        if box.shape:
            active = [a for a in active if a.offset[0] + a.shape[0] > box.offset[0]]
        if any(other.intersect(box) is not None for other in active):
            raise CheckpointError(f"{part.where}: shard {name!r} overlaps another shard of it")
        active.append(box)
        covered += box.numel
    first = parts[0]
    if covered != math.prod(first.box.global_shape):
        raise CheckpointError(
            f"{first.where}: the saved shards of {name!r} hold {covered} of the "
            f"{math.prod(first.box.global_shape)} elements of its global shape "
            f"{list(first.box.global_shape)} (a damaged shard table, or a shard file missing)"
        )


def _read_box(part: Part, box: Box) -> torch.Tensor:
    """The values of ``box`` (inside ``part``'s box) from ``part``'s file: the rows of the first dimension
    it spans, then sliced in memory along the other dimensions."""
    spec = part.spec
    index = box.within(part.box)
    row_shape: tuple[int, ...] = ()
    if not spec.shape:
        rows, first = 1, 0
    else:
        first, rows, row_shape = index[0].start, index[0].stop - index[0].start, spec.shape[1:]
    row_bytes = math.prod(row_shape) * spec.dtype.itemsize
    raw = torch.empty(rows * row_bytes, dtype=torch.uint8)
    if raw.numel():
        pread_exact(part.fd, raw.numpy().data, spec.offset + first * row_bytes, part.where)
    if spec.dtype == torch.bool:
        raw.clamp_(max=1)  # any non-zero byte is True; a bool tensor must hold only 0 and 1
    values = raw.view(spec.dtype).reshape((rows, *row_shape) if spec.shape else ())
    return values[(slice(None), *index[1:])] if spec.shape else values


class CheckpointReader:
    """The data files of one checkpoint, open and their headers parsed, for one rank to read from."""

    def __init__(self, step_fd: int, where: str, world_size: int, stack: ExitStack) -> None:
        self._step_fd = step_fd
        self._where = where
        self._world_size = world_size
        self._stack = stack
        self._layouts: dict[int, tuple[int, Layout, str]] = {}

    def _file(self, rank: int) -> tuple[int, Layout, str] | None:
        """Rank ``rank``'s open data file and its layout (None when there is no such file)."""
        if rank in self._layouts:
            return self._layouts[rank]
        name = data_file_name(rank)
        if fs.kind(self._step_fd, name) is None:
            return None
        path = f"{self._where}/{name}"
        fd, _ = fs.open_regular(self._step_fd, name, path)
        self._stack.callback(os.close, fd)
        self._layouts[rank] = (fd, read_layout(fd, path), path)
        return self._layouts[rank]

    def _tree(self, rank: int, parts: dict[str, list[Part]] | None) -> dict[str, Any]:
        """Rank ``rank``'s state tree with SavedTensors; a shard gets the pieces of ``parts`` by name."""
        found = self._file(rank)
        if found is None:
            raise CheckpointError(f"{self._where}/{data_file_name(rank)}: missing")
        fd, layout, path = found
        tensors = []
        for spec in layout.tensors:
            shard_parts = parts.get(spec.name) if parts is not None and spec.box is not None else None
            if shard_parts:
                _check_tiling(spec.name, shard_parts)  # before the training sees its shape or reads it
            tensors.append(SavedTensor(spec.name, shard_parts or [Part(fd, spec, path)]))
        tree: dict[str, Any] = unflatten(layout.skeleton, tensors)
        return tree

    def _shard_index(self) -> dict[str, list[Part]]:
        """Every shard of every rank's file, by the name of the tensor it is a shard of."""
        index: dict[str, list[Part]] = {}
        for rank in range(self._world_size):
            found = self._file(rank)
            if found is None:
                raise CheckpointError(f"{self._where}/{data_file_name(rank)}: missing (a sharded checkpoint)")
            fd, layout, path = found
            for spec in layout.tensors:
                if spec.box is not None:
                    index.setdefault(spec.name, []).append(Part(fd, spec, path))
        return index

    def state(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s view: rank 0's shared state, every shard by its global tensor, and the rank's
        own generators, data position and tracked objects (read; the rest is read on demand)."""
        first = self._file(0)
        if first is None:
            raise CheckpointError(f"{self._where}/{data_file_name(0)}: missing")
        sharded = any(spec.box is not None for spec in first[1].tensors)
        state = self._tree(0, self._shard_index() if sharded else None)
        if rank == 0:
            return _read_own(state)
        for key in PER_RANK_KEYS:
            state.pop(key, None)
        own = self._file(rank) if rank < self._world_size else None
        if own is not None:
            mine = self._tree(rank, None)
            state.update({key: mine[key] for key in PER_RANK_KEYS if key in mine})
        else:
            log.warning(
                "%s was written by %d ranks: rank %d starts its random generators and tracked data afresh, "
                "at the data position of the gang",
                self._where, self._world_size, rank,
            )  # fmt: skip
            data = self._tree(0, None).get("data")
            if isinstance(data, dict):
                state["data"] = {k: v for k, v in data.items() if k not in _RANK_COUNTERS}
        return _read_own(state)


def _read_own(state: dict[str, Any]) -> dict[str, Any]:
    """The per-rank parts read now (they are small); the rest stays to be read on demand."""
    for key in PER_RANK_KEYS:
        if key in state:
            state[key] = read_all(state[key])
    return state


@contextmanager
def open_reader(step_fd: int, where: str, world_size: int) -> Iterator[CheckpointReader]:
    """A reader of the checkpoint whose directory is open at ``step_fd`` (written by ``world_size``
    ranks); its files are closed on leaving. Every tensor of its states must be read inside."""
    with ExitStack() as stack:
        yield CheckpointReader(step_fd, where, world_size, stack)

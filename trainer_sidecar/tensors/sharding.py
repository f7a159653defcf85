"""Tensors that are shards of a larger one (FSDP2's and HSDP's ``DTensor``), seen from one rank.

A parameter of a model wrapped by ``fully_shard`` is a ``DTensor``: a global shape, and on each rank a
local tensor holding one box of it (``Shard`` placements cut a dimension in contiguous chunks;
``Replicate`` placements copy it across a mesh dimension, as HSDP does). The guardian only ever works on
the local tensor (``local_tensor``): norms, finiteness, snapshots and checkpoints touch a rank's own
bytes, never the whole model. What it needs to know about the rest of the world is here: which box of
the global tensor a rank holds (``box_of``), how many ranks hold the same values (``copies_of``, for a
global norm that counts every value once), and which of those copies writes it to a checkpoint
(``writes_shard``). Only ``Shard`` and ``Replicate`` placements are supported (``check_placements``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

# The one private helper used: where a rank's chunk starts in the global tensor (DCP uses it too).
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as _local_chunk


class ShardingError(ValueError):
    """A sharded tensor whose layout the guardian cannot handle (named in the message)."""


@dataclass(frozen=True)
class Box:
    """The part of a global tensor a local tensor holds: ``offset`` and ``shape`` in every dimension."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> Box:
        """The box covering a whole tensor of ``shape``."""
        return cls(tuple(shape), (0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        """Elements in the box."""
        return math.prod(self.shape)

    @property
    def is_whole(self) -> bool:
        """Whether the box covers the whole global tensor."""
        return self.shape == self.global_shape

    def intersect(self, other: Box) -> Box | None:
        """The part of the global tensor both boxes cover (None when it is empty)."""
        begin = tuple(max(a, b) for a, b in zip(self.offset, other.offset, strict=True))
        end = tuple(
            min(a + n, b + m)
            for a, n, b, m in zip(self.offset, self.shape, other.offset, other.shape, strict=True)
        )
        if any(e <= b for b, e in zip(begin, end, strict=True)):
            return None
        return Box(self.global_shape, begin, tuple(e - b for b, e in zip(begin, end, strict=True)))

    def within(self, outer: Box) -> tuple[slice, ...]:
        """The index of this box inside the local tensor of ``outer`` (which must contain it)."""
        return tuple(
            slice(a - o, a - o + n) for a, o, n in zip(self.offset, outer.offset, self.shape, strict=True)
        )


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (a shard, or a replica over a device mesh)."""
    return isinstance(tensor, DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own tensor: a DTensor's local tensor (sharing its storage), else ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def check_placements(tensor: DTensor, where: str) -> None:
    """Raise ShardingError unless every placement of ``tensor`` is ``Shard`` or ``Replicate``."""
    for placement in tensor.placements:
        if type(placement) not in (Shard, Replicate):
            raise ShardingError(
                f"{where}: placement {placement} is not supported (only Shard and Replicate, as FSDP2 and "
                "HSDP make them)"
            )


def box_of(tensor: torch.Tensor, where: str = "tensor") -> Box:
    """The box of the global tensor this rank's local tensor holds (the whole tensor when not sharded)."""
    if not isinstance(tensor, DTensor):
        return Box.whole(tuple(tensor.shape))
    check_placements(tensor, where)
    shape, offset = _local_chunk(tensor.shape, tensor.device_mesh, tensor.placements)
    return Box(tuple(tensor.shape), tuple(int(o) for o in offset), tuple(int(s) for s in shape))


def copies_of(tensor: torch.Tensor, world_size: int) -> int:
    """How many ranks of the world hold this rank's values of ``tensor`` (at least 1).

    A plain tensor is a replica on every rank (DDP). A DTensor is copied along its mesh's ``Replicate``
    dimensions, and on every group of ranks outside its mesh (the mesh is taken to tile the world, as
    an HSDP mesh built by hand from a DDP group around an FSDP mesh does).
    """
    if not isinstance(tensor, DTensor):
        return max(1, world_size)
    mesh = tensor.device_mesh
    copies = math.prod(
        mesh.size(dim) for dim, placement in enumerate(tensor.placements) if isinstance(placement, Replicate)
    )
    return max(1, copies * max(1, world_size // mesh.size()))


def writes_shard(tensor: torch.Tensor) -> bool:
    """Whether this rank writes its values of ``tensor`` to a sharded checkpoint: the first replica of
    each shard does (coordinate 0 along every ``Replicate`` dimension), so a shard is written once."""
    if not isinstance(tensor, DTensor):
        return False
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return False
    replicated = [dim for dim, placement in enumerate(tensor.placements) if isinstance(placement, Replicate)]
    return all(coordinate[dim] == 0 for dim in replicated)


@dataclass(frozen=True)
class Layout:
    """How a DTensor is laid out: enough to wrap a local tensor of the same box back into one."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, tensor: DTensor) -> Layout:
        """The layout of a live DTensor."""
        return cls(tensor.device_mesh, tuple(tensor.placements), tuple(tensor.shape), tuple(tensor.stride()))

    def wrap(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's box) as a DTensor of this layout, sharing its storage."""
        shape = torch.Size(self.shape)
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=shape, stride=self.stride
        )


def layout_of(tensor: torch.Tensor) -> Layout | None:
    """The layout of a DTensor, None for a plain tensor."""
    return Layout.of(tensor) if isinstance(tensor, DTensor) else None


@runtime_checkable
class Readable(Protocol):
    """A saved tensor not read yet (a checkpoint's, see ``checkpoint.shards``): any box of it on demand."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape."""

    @property
    def dtype(self) -> torch.dtype:
        """The element type."""

    def read(self, box: Box | None = None) -> torch.Tensor:
        """The values of ``box`` (the whole tensor when None) as a new contiguous CPU tensor."""


def fit_to(value: Any, like: Any) -> Any:
    """``value`` (a saved tensor: ``Readable`` or a plain tensor) in the form the live ``like`` holds: for
    a DTensor of the same global shape, this rank's box of it wrapped in ``like``'s layout (only that box
    is read); otherwise the whole tensor. Anything else is returned as it is."""
    sharded = isinstance(like, DTensor) and tuple(like.shape) == tuple(getattr(value, "shape", ()))
    if isinstance(value, DTensor):
        return value
    if isinstance(value, Readable) and not isinstance(value, torch.Tensor):
        if not sharded:
            return value.read()
        box = box_of(like)
        return Layout.of(like).wrap(value.read(box).to(like.device))
    if isinstance(value, torch.Tensor) and sharded:
        box = box_of(like)
        return Layout.of(like).wrap(value[box.within(Box.whole(box.global_shape))].clone().to(like.device))
    return value


def read_all(state: Any) -> Any:
    """``state`` with every ``Readable`` read whole (nested dicts, lists and tuples)."""
    if isinstance(state, Readable) and not isinstance(state, torch.Tensor):
        return state.read()
    if isinstance(state, dict):
        return {key: read_all(value) for key, value in state.items()}
    if isinstance(state, list):
        return [read_all(value) for value in state]
    if isinstance(state, tuple):
        return tuple(read_all(value) for value in state)
    return state

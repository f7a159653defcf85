"""The values a step's collective agrees on, by name: one layout for packing and for reading them back.

Each rank packs its own numbers into one float64 tensor (``pack``); in a gang the collective sums it
over the ranks; one host sync reads it back (``read_local`` alone, ``read_reduced`` in a gang, where this
rank's own non-finite flag rides along in the same sync). Summing is what each value needs: the losses
(their mean is the sum over the world size), the count of ranks whose loss was non-finite, the squared
norm parts (their sum is the squared global norm), flags (any rank set) and the checkpoint interval rank
0 proposes (one integer and zeros). Alone, the norm parts are the norms themselves.

The layout only names positions; it adds no collective and no host sync, and works on any device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields

import torch

__all__ = ["StepValues", "pack", "read_local", "read_reduced"]


@dataclass(frozen=True)
class StepValues:
    """The numbers of one step as the collective carries them, in this order (``FIELDS``).

    Alone these are this rank's own; read back from the reduced tensor they are sums over the gang."""

    #: The step's loss (the sum over the ranks, in a gang).
    loss: float
    #: How many ranks saw a non-finite loss.
    nonfinite: float
    #: The norm of the gradients as they are now (alone), or the sum of the ranks' squared parts.
    norm: float
    #: The same for the gradients as the backward left them (before a clip of the loop's own).
    pre_clip_norm: float
    #: Ranks told to stop (or deferring a stop).
    stop: float
    #: Ranks whose checkpoint time cadence is due.
    time_due: float
    #: Ranks whose last forward pass did not keep the random generators.
    rng_missing: float
    #: The checkpoint interval proposed (rank 0's; 0 elsewhere).
    interval: float

    @classmethod
    def size(cls) -> int:
        """How many values the layout holds."""
        return len(_POSITIONS)

    @classmethod
    def index(cls, name: str) -> int:
        """The position of the value named ``name`` in the packed tensor (KeyError for no such value)."""
        return _POSITIONS[name]

    @classmethod
    def from_values(cls, values: Sequence[float]) -> StepValues:
        """The layout read from the first ``size()`` numbers of ``values`` (a host list)."""
        return cls(*values[: cls.size()])

    def as_tuple(self) -> tuple[float, ...]:
        """The values in layout order."""
        return astuple(self)


_POSITIONS: dict[str, int] = {field.name: at for at, field in enumerate(fields(StepValues))}


def pack(
    loss: torch.Tensor,
    norm: torch.Tensor,
    pre_clip_norm: torch.Tensor,
    *,
    stop: bool,
    time_due: bool,
    rng_missing: bool,
    interval: int,
) -> torch.Tensor:
    """This rank's values in ``StepValues`` order: one float64 tensor on ``loss``'s device (no host sync:
    the flags are host numbers moved with one copy)."""
    device = loss.device
    loss = loss.double()
    flags = torch.tensor(
        [float(stop), float(time_due), float(rng_missing), float(interval)], dtype=torch.float64
    ).to(device)
    measured = [
        loss,
        (~torch.isfinite(loss)).double(),
        norm.double().to(device),
        pre_clip_norm.double().to(device),
    ]
    return torch.cat([torch.stack(measured), flags])


def read_local(local: torch.Tensor) -> tuple[StepValues, bool]:
    """Alone: the packed values and whether this rank's loss was non-finite (one host sync)."""
    values = StepValues.from_values(local.tolist())
    return values, values.nonfinite > 0


def read_reduced(reduced: torch.Tensor, local: torch.Tensor) -> tuple[StepValues, bool]:
    """In a gang: the summed values and whether this rank's own loss was non-finite, in one host sync
    (this rank's flag is appended to the reduced tensor first)."""
    at = StepValues.index("nonfinite")
    values = torch.cat([reduced, local[at : at + 1].to(reduced.device)]).tolist()
    return StepValues.from_values(values), values[StepValues.size()] > 0

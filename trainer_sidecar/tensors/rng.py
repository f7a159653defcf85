"""Every random number generator a training step may draw from, as checkpoint state and back.

A resumed job must draw the same random numbers (dropout masks, data augmentation) as the run it
continues, so a checkpoint holds Python's, NumPy's, torch's and (when present) CUDA's generator states.
The saved form holds only plain values and tensors (a checkpoint never pickles); restoring validates it,
because a checkpoint is input.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RngStateError(ValueError):
    """A saved generator state is not in the form ``rng_state`` writes."""


def rng_state() -> dict[str, Any]:
    """The state of every generator (python, numpy, torch, cuda)."""
    np_state: tuple[Any, ...] = tuple(np.random.get_state(legacy=True))
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Any) -> None:
    """Restore ``rng_state``'s output. Raises RngStateError (nothing restored) when it is malformed."""
    try:
        version, internal, gauss = state["python"]
        python = (int(version), tuple(int(x) for x in internal), gauss)
        saved = state["numpy"]
        keys = saved["keys"]
        if not isinstance(keys, torch.Tensor) or keys.shape != (624,):
            raise RngStateError("numpy keys must be a tensor of 624 values")
        numpy = ("MT19937", keys.numpy().astype(np.uint32), int(saved["pos"]), int(saved["has_gauss"]),
                 float(saved["cached_gaussian"]))  # fmt: skip
        generator = state["torch"]
        if not isinstance(generator, torch.Tensor) or generator.dtype != torch.uint8:
            raise RngStateError("the torch generator state must be a uint8 tensor")
        probe = random.Random()
        probe.setstate(python)  # validates before anything global changes
    except RngStateError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise RngStateError(f"malformed generator state: {type(exc).__name__}: {exc}") from exc
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(generator)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

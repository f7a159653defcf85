"""Helpers for the checkpoint tests and benchmarks: small trainings, deep state comparison, file surgery."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer_sidecar.checkpoint import format as checkpoint_format
from trainer_sidecar.checkpoint import step_dir_name
from trainer_sidecar.tensors.tensorstate import flatten


def make_training(seed: int = 0, lr: float | torch.Tensor = 3e-3) -> tuple[nn.Module, torch.optim.AdamW]:
    """A small model with parameters and buffers (BatchNorm, including an int64 counter) and its AdamW
    (``lr`` may be a tensor, as torch allows)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Linear(24, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    return model, optimizer


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    """``steps`` AdamW steps on seeded random batches; returns the losses."""
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        inputs = torch.randn(16, 12, generator=generator)
        targets = torch.randn(16, 3, generator=generator)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        torch.autograd.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return losses


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """What a rank-0 checkpoint holds, in small."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}


def clone_state(state: Any) -> Any:
    """A deep copy with every tensor cloned (what the state was at this moment)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, Mapping):
        return {key: clone_state(value) for key, value in state.items()}
    if isinstance(state, list):
        return [clone_state(value) for value in state]
    if isinstance(state, tuple):
        return tuple(clone_state(value) for value in state)
    return state


def assert_same_state(actual: Any, expected: Any, where: str = "state") -> None:
    """Bit-exact equality of nested states: tensors by torch.equal (and dtype), the rest by ==."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert torch.equal(actual, expected), f"{where}: tensor contents differ"
    elif isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{where}: expected a mapping, got {type(actual).__name__}"
        assert set(actual) == set(expected), f"{where}: keys {set(actual)} != {set(expected)}"
        for key in expected:
            assert_same_state(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected)}"
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_state(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def small_state(value: float) -> dict[str, Any]:
    """A tiny state whose tensors and step are all derived from ``value``."""
    return {"model": {"w": torch.full((4, 3), value), "b": torch.arange(3) + int(value)}, "step": int(value)}


def step_files(root: Path, step: int) -> tuple[Path, Path]:
    """Rank 0's data file and manifest of ``step``."""
    directory = root / step_dir_name(step)
    return directory / "rank-0.safetensors", directory / "rank-0.json"


def flip_one_bit(path: Path, offset: int | None = None) -> None:
    """Flip one bit of the file (in the middle unless ``offset``)."""
    data = bytearray(path.read_bytes())
    index = len(data) // 2 if offset is None else offset
    data[index] ^= 0x10
    path.write_bytes(bytes(data))


def serialize(state: Any) -> bytes:
    """The bytes the store writes for ``state``: header and raw tensor data."""
    skeleton, tensors = flatten(state)
    pieces = checkpoint_format.serialize(skeleton, tensors).pieces
    return b"".join(bytes(view) for piece in pieces for view in piece.views)


def split_file(data: bytes) -> tuple[dict[str, Any], bytes]:
    """A checkpoint file's JSON header (trailing padding stripped) and its data section."""
    (length,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + length])
    assert (8 + length) % 64 == 0, "the data does not start at a multiple of 64 bytes"
    return header, data[8 + length :]


def join_file(header: Any, data_section: bytes, *, raw_header: bytes | None = None) -> bytes:
    """A checkpoint file from a header (any JSON value, or raw bytes, padded to 64) and a data section."""
    text = json.dumps(header).encode() if raw_header is None else raw_header
    text += b" " * (-(8 + len(text)) % 64)
    return struct.pack("<Q", len(text)) + text + data_section


def header_state(header: dict[str, Any]) -> Any:
    """The state tree a header's metadata holds."""
    return json.loads(header["__metadata__"]["state"])


def with_state(header: dict[str, Any], node: Any) -> dict[str, Any]:
    """``header`` with its metadata's state tree replaced by ``node``."""
    return {**header, "__metadata__": {**header["__metadata__"], "state": json.dumps(node)}}


def same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads included; works for dtypes torch.equal lacks)."""
    return (
        actual.dtype == expected.dtype
        and actual.shape == expected.shape
        and bytes(actual.contiguous().reshape(-1).view(torch.uint8).numpy())
        == bytes(expected.contiguous().reshape(-1).view(torch.uint8).numpy())
    )


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes as a tensor of ``dtype`` (floats include NaN and Inf bit patterns)."""
    numel = math.prod(shape)
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def reseal(step_dir: Path, rank: int) -> None:
    """Make rank ``rank``'s manifest in ``step_dir`` describe its data file as it is now (size, SHA-256):
    damage that a writer's bug, or anyone able to write the volume, leaves with a matching manifest."""
    data = (step_dir / f"rank-{rank}.safetensors").read_bytes()
    manifest_path = step_dir / f"rank-{rank}.json"
    manifest = json.loads(manifest_path.read_bytes())
    entry = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest["files"][f"rank-{rank}.safetensors"] = entry
    manifest_path.write_text(json.dumps(manifest))


def claim_global_shape(step_dir: Path, ranks: int, name: str, shape: list[int]) -> None:
    """Rewrite the shard table of every rank's file in ``step_dir`` so that the sharded tensor ``name``
    claims the global ``shape`` (each shard keeps its own bytes and offset), and reseal the manifests."""
    for rank in range(ranks):
        path = step_dir / f"rank-{rank}.safetensors"
        header, data = split_file(path.read_bytes())
        table = json.loads(header["__metadata__"]["shards"])
        table[name]["shape"] = shape
        header["__metadata__"]["shards"] = json.dumps(table)
        path.write_bytes(join_file(header, data))
        reseal(step_dir, rank)


def sharded_names(step_dir: Path) -> list[str]:
    """The names of the sharded tensors of rank 0's file in ``step_dir``."""
    header, _ = split_file((step_dir / "rank-0.safetensors").read_bytes())
    return sorted(json.loads(header["__metadata__"].get("shards", "{}")))

"""The clean-checkpoint store on real files: round trips, manifests, corruption, retention, safety.

Also a kill test: a real child process saving ~24 MB checkpoints is SIGKILLed at random moments, and
after every kill the newest valid checkpoint must verify and load with exactly the state of its step.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import pickle
import queue
import random
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from tests.support.paths import REPO_ROOT
from trainer_sidecar import checkpoint as checkpoint_module
from trainer_sidecar.checkpoint import CheckpointError, CheckpointStore, step_dir_name
from trainer_sidecar.tensorstate import flatten

REPO_ROOT = REPO_ROOT


# --- helpers -------------------------------------------------------------------------------------------


def make_training(seed: int = 0) -> tuple[nn.Module, torch.optim.AdamW]:
    """A small model with parameters and buffers (BatchNorm, including an int64 counter) and its AdamW."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Linear(24, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
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
    return {"model": {"w": torch.full((4, 3), value), "b": torch.arange(3) + int(value)}, "step": int(value)}


def step_files(root: Path, step: int) -> tuple[Path, Path]:
    directory = root / step_dir_name(step)
    return directory / "rank-0.pt", directory / "rank-0.json"


def flip_one_bit(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    index = len(data) // 2 if offset is None else offset
    data[index] ^= 0x10
    path.write_bytes(bytes(data))


def serialize(state: Any) -> bytes:
    """The bytes the store writes for ``state``: header and raw tensor data."""
    skeleton, tensors = flatten(state)
    pieces = checkpoint_module._serialize(skeleton, tensors).pieces
    return b"".join(bytes(view) for piece in pieces for view in piece.views)


_PREFIX = len(checkpoint_module.MAGIC) + 12  # magic, uint32 version, uint64 header length


def split_file(data: bytes) -> tuple[dict[str, Any], bytes]:
    """A checkpoint file's JSON header and its data section."""
    assert data.startswith(checkpoint_module.MAGIC)
    version, length = struct.unpack_from("<IQ", data, len(checkpoint_module.MAGIC))
    assert version == checkpoint_module.FORMAT_VERSION
    header = json.loads(data[_PREFIX : _PREFIX + length])
    data_start = -(-(_PREFIX + length) // 64) * 64
    assert data[_PREFIX + length : data_start] == bytes(data_start - _PREFIX - length)
    return header, data[data_start:]


def join_file(
    header: Any, data_section: bytes, *, raw_header: bytes | None = None, version: int = 2
) -> bytes:
    """A checkpoint file from a header (any JSON value, or raw bytes) and a data section."""
    text = json.dumps(header).encode() if raw_header is None else raw_header
    prefix = checkpoint_module.MAGIC + struct.pack("<IQ", version, len(text)) + text
    return prefix + bytes(-len(prefix) % 64) + data_section


def same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads included; works for dtypes torch.equal lacks)."""
    return (
        actual.dtype == expected.dtype
        and actual.shape == expected.shape
        and bytes(actual.contiguous().reshape(-1).view(torch.uint8).numpy())
        == bytes(expected.contiguous().reshape(-1).view(torch.uint8).numpy())
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    created = CheckpointStore(tmp_path / "ckpt", keep_clean=3)
    yield created
    created.close()


# --- round trip and manifest ---------------------------------------------------------------------------


def test_save_then_load_round_trips_model_and_adamw_bit_exactly(store: CheckpointStore) -> None:
    model, optimizer = make_training()
    train(model, optimizer, 5, seed=1)
    expected = clone_state(training_state(model, optimizer, 5))
    assert len(optimizer.state) > 0

    ref = store.save(5, training_state(model, optimizer, 5), {"loss": 0.25})
    assert ref is not None
    assert ref.step == 5
    assert ref.path == str(store.root / step_dir_name(5))

    loaded = store.load(5)
    assert_same_state(loaded, expected)

    # The loaded state resumes training exactly where the original would have gone.
    resumed_model, resumed_optimizer = make_training(seed=99)
    resumed_model.load_state_dict(loaded["model"])
    resumed_optimizer.load_state_dict(loaded["optimizer"])
    assert train(resumed_model, resumed_optimizer, 3, seed=2) == train(model, optimizer, 3, seed=2)
    assert_same_state(resumed_model.state_dict(), model.state_dict())


def test_manifest_records_step_time_world_size_and_the_files_size_and_sha256(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, rank=0, world_size=1)
    before = time.time()
    ref = store.save(42, small_state(42.0), {"loss": 1.5, "clean": True})
    after = time.time()
    store.close()

    data_path, manifest_path = step_files(tmp_path, 42)
    manifest = json.loads(manifest_path.read_text())
    assert manifest["step"] == 42
    assert manifest["rank"] == 0
    assert manifest["world_size"] == 1
    assert manifest["format"] == checkpoint_module.FORMAT_VERSION
    assert before <= manifest["time"] <= after
    assert manifest["loss"] == 1.5
    assert manifest["clean"] is True
    entry = manifest["files"]["rank-0.pt"]
    assert entry["size"] == data_path.stat().st_size > 0
    assert entry["sha256"] == hashlib.sha256(data_path.read_bytes()).hexdigest()
    assert ref is not None
    assert ref.sha256 == entry["sha256"]
    assert ref.time == manifest["time"]
    # Nothing but the two published files is left behind (no temp files).
    assert sorted(p.name for p in data_path.parent.iterdir()) == ["rank-0.json", "rank-0.pt"]


# --- the file format ----------------------------------------------------------------------------------


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes as a tensor of ``dtype`` (floats include NaN and Inf bit patterns)."""
    numel = math.prod(shape)
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def test_every_supported_dtype_round_trips_bit_exactly_in_any_shape_and_layout(
    store: CheckpointStore,
) -> None:
    assert {"bfloat16", "bool", "int64", "float16", "float32", "float64", "uint8", "int32"} <= set(
        checkpoint_module.DTYPES
    )
    state: dict[str, Any] = {}
    for index, (name, dtype) in enumerate(checkpoint_module.DTYPES.items()):
        base = _random_tensor(dtype, (4, 6), seed=index)
        state[name] = {
            "zero-d": _random_tensor(dtype, (), seed=100 + index),
            "empty": _random_tensor(dtype, (0,), seed=0),
            "empty-2d": _random_tensor(dtype, (3, 0), seed=0),
            "full": base,
            "transposed": base.t(),
            "strided": base[:, ::2],
            "expanded": base[0].expand(3, 6),
            "big": _random_tensor(dtype, (300_000 // dtype.itemsize + 3,), seed=200 + index),  # > coalesced
        }
    expected = clone_state(state)
    assert not state["float32"]["transposed"].is_contiguous()

    store.save(1, state, {})
    loaded = store.load(1)

    assert set(loaded) == set(expected)
    pointers = set()
    for name, tensors in expected.items():
        assert set(loaded[name]) == set(tensors)
        for key, tensor in tensors.items():
            got = loaded[name][key]
            assert same_bits(got, tensor), f"{name}/{key}"
            assert got.is_contiguous()
            if got.numel():
                # Each tensor owns exactly its bytes: no view into a buffer shared with the others.
                assert got.untyped_storage().nbytes() == got.numel() * got.element_size()
                pointers.add(got.data_ptr())
    assert len(pointers) == sum(1 for t in expected.values() for v in t.values() if v.numel())
    loaded["float32"]["full"].add_(1)  # writable, and independent of its former neighbours
    assert same_bits(loaded["float32"]["transposed"], expected["float32"]["transposed"])


def test_plain_values_keep_their_types_including_nan_inf_tuples_and_non_string_keys(
    store: CheckpointStore,
) -> None:
    model, optimizer = make_training()
    train(model, optimizer, 2, seed=7)
    generator = random.Random(11)
    generator.random()
    state = {
        "floats": [math.nan, math.inf, -math.inf, -0.0, 0.1, 1e308, 5e-324, 1.0],
        "ints": [0, -1, 2**63, -(2**100), True, False],
        "none": None,
        "text": ["", "héllo ✓", 'line\nbreak "quoted" \\ back', "\udcff"],
        "tuple": (1, (2.5, "x"), [3], ()),
        "empty": {"list": [], "dict": {}, "tuple": ()},
        "keys": {0: "int", 1.5: "float", None: "none", True: "bool", ("a", 1): "tuple", "s": "str"},
        "python_rng": generator.getstate(),
        "numpy": [np.float64(0.5), np.int64(7), np.bool_(True), np.float32(0.25)],
        "optimizer": optimizer.state_dict(),
    }
    expected = clone_state(state)

    store.save(1, state, {})
    loaded = store.load(1)

    floats = loaded["floats"]
    assert all(type(value) is float for value in floats)
    assert math.isnan(floats[0])
    assert floats[1:3] == [math.inf, -math.inf]
    assert math.copysign(1.0, floats[3]) == -1.0
    assert floats[4:] == expected["floats"][4:]
    assert loaded["ints"] == expected["ints"]
    assert [type(v) for v in loaded["ints"]] == [int, int, int, int, bool, bool]
    for key in ("none", "text", "tuple", "empty", "keys", "python_rng", "optimizer"):
        assert_same_state(loaded[key], expected[key], key)
    assert [type(key) for key in loaded["keys"]] == [int, float, type(None), bool, tuple, str]
    assert loaded["numpy"] == [0.5, 7, True, 0.25]
    assert [type(v) for v in loaded["numpy"]] == [float, int, bool, float]

    # The states come back usable: python's RNG needs a tuple, AdamW's betas are a tuple, its
    # per-parameter state is keyed by int.
    restored = random.Random()
    restored.setstate(loaded["python_rng"])
    assert restored.random() == generator.random()
    assert isinstance(loaded["optimizer"]["param_groups"][0]["betas"], tuple)
    assert sorted(loaded["optimizer"]["state"]) == sorted(optimizer.state_dict()["state"])
    _, fresh = make_training(seed=3)
    fresh.load_state_dict(loaded["optimizer"])


def test_the_file_is_magic_version_json_header_and_aligned_raw_tensor_bytes(store: CheckpointStore) -> None:
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    flags = torch.tensor([True, False, True])
    store.save(1, {"model": {"w": weight, "flags": flags}, "step": 1, "lr": math.inf}, {})
    data_path, _ = step_files(store.root, 1)
    data = data_path.read_bytes()

    header, section = split_file(data)
    assert header["byteorder"] == "little"
    assert header["data_bytes"] == len(section)
    assert header["state"] == {
        "dict": [
            ["model", {"dict": [["w", {"tensor": 0}], ["flags", {"tensor": 1}]]}],
            ["step", 1],
            ["lr", {"float": "inf"}],
        ]
    }
    specs = header["tensors"]
    assert [(s["dtype"], s["shape"], s["nbytes"]) for s in specs] == [
        ("float32", [3, 4], 48),
        ("bool", [3], 3),
    ]
    assert all(s["offset"] % 64 == 0 for s in specs)
    assert (len(data) - len(section)) % 64 == 0
    assert section[specs[0]["offset"] : specs[0]["offset"] + 48] == weight.numpy().tobytes()
    assert section[specs[1]["offset"] : specs[1]["offset"] + 3] == b"\x01\x00\x01"


def test_parallel_and_serial_hashing_write_identical_files(tmp_path: Path) -> None:
    state = {
        "model": {"big": _random_tensor(torch.float32, (5_000_000,), seed=1), "small": torch.arange(5)},
        "step": 3,
    }
    digests = []
    for parallel in (True, False):
        store = CheckpointStore(tmp_path / str(parallel), parallel_hash=parallel)
        try:
            ref = store.save(3, state, {})
        finally:
            store.close()
        assert ref is not None
        data_path, _ = step_files(store.root, 3)
        assert ref.sha256 == hashlib.sha256(data_path.read_bytes()).hexdigest()
        digests.append(ref.sha256)
    assert digests[0] == digests[1]


def test_short_writes_are_resumed_where_they_stopped(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_writev = os.writev

    def short_writev(fd: int, buffers: Sequence[memoryview]) -> int:
        return real_writev(fd, [memoryview(buffers[0])[:777]])  # at most 777 bytes of the first view

    state = {
        "model": {"w": torch.randn(30_000, generator=torch.Generator().manual_seed(4)), "b": torch.arange(5)}
    }
    expected = clone_state(state)
    monkeypatch.setattr(os, "writev", short_writev)
    ref = store.save(1, state, {})
    monkeypatch.undo()
    assert ref is not None
    assert store.verify(1).valid
    assert_same_state(store.load(1), expected)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (object, "a object cannot be stored"),
        (lambda: b"raw bytes", "a bytes cannot be stored"),
        (lambda: {1, 2}, "a set cannot be stored"),
        (lambda: torch.float32, "a dtype cannot be stored"),
        (lambda: {frozenset(): 1}, "a dict key of type frozenset"),
        (lambda: torch.zeros(2, dtype=torch.complex32), "dtype torch.complex32 cannot be stored"),
    ],
)
def test_a_state_that_cannot_be_stored_fails_on_wait_naming_the_value(
    store: CheckpointStore, make: Callable[[], Any], message: str
) -> None:
    store.save_async(1, {"model": {"w": torch.ones(2)}, "extra": {"bad": make()}}, {})
    with pytest.raises(CheckpointError, match=message) as caught:
        store.wait()
    assert "state['extra']['bad']" in str(caught.value)
    assert str(step_files(store.root, 1)[0]) in str(caught.value)
    assert store.steps() == []  # nothing was written, not even the directory
    assert store.save(2, small_state(2.0), {}) is not None  # and the store still works
    assert store.verify(2).valid


def _header_cases() -> dict[str, Any]:
    """Edits of a valid header (a function of the header, returning the new one) that must be refused."""

    def tensor(edit: dict[str, Any]) -> Any:
        return lambda h: {**h, "tensors": [{**h["tensors"][0], **edit}, *h["tensors"][1:]]}

    def state(node: Any) -> Any:
        return lambda h: {**h, "state": node}

    deep: Any = 0
    for _ in range(150):  # beyond the reader's limit of 100 levels
        deep = {"list": [deep]}
    return {
        "offset-past-end": tensor({"offset": 1 << 20}),
        "offset-negative": tensor({"offset": -64}),
        "offset-unaligned": tensor({"offset": 8}),
        "offset-float": tensor({"offset": 0.0}),
        "nbytes-wrong": tensor({"nbytes": 4}),
        "nbytes-bool": tensor({"nbytes": True}),
        "dtype-unknown": tensor({"dtype": "float128"}),
        "dtype-object": tensor({"dtype": "object"}),
        "dtype-not-a-name": tensor({"dtype": 7}),
        "shape-negative": tensor({"shape": [-1, 3]}),
        "shape-huge": tensor({"shape": [1 << 40, 1 << 40]}),
        "shape-zero-times-huge": tensor({"shape": [0, 1 << 61, 1 << 61], "nbytes": 0}),
        "shape-string": tensor({"shape": "3x4"}),
        "shape-too-many-dims": tensor({"shape": [1] * 65}),
        "tensor-extra-key": tensor({"pickle": "x"}),
        "tensors-not-a-list": lambda h: {**h, "tensors": {}},
        "data-bytes-wrong": lambda h: {**h, "data_bytes": h["data_bytes"] + 64},
        "data-bytes-negative": lambda h: {**h, "data_bytes": -1},
        "byteorder-big": lambda h: {**h, "byteorder": "big"},
        "missing-state": lambda h: {k: v for k, v in h.items() if k != "state"},
        "header-a-list": lambda h: [h],
        "top-level-list": state({"list": []}),
        "top-level-tensor": state({"tensor": 0}),
        "tensor-ref-out-of-range": state({"dict": [["w", {"tensor": 99}]]}),
        "tensor-ref-negative": state({"dict": [["w", {"tensor": -1}]]}),
        "tensor-ref-bool": state({"dict": [["w", {"tensor": True}]]}),
        "unknown-tag": state({"dict": [["w", {"pickle": "cos\nsystem"}]]}),
        "two-key-node": state({"dict": [["w", {"list": [], "tuple": []}]]}),
        "bare-array": state({"dict": [["w", [1, 2]]]}),
        "bad-float": state({"dict": [["w", {"float": "nanx"}]]}),
        "pair-of-three": state({"dict": [["w", 1, 2]]}),
        "list-as-key": state({"dict": [[{"list": []}, 1]]}),
        "tensor-as-key": state({"dict": [[{"tensor": 0}, 1]]}),
        "dict-as-key": state({"dict": [[{"dict": []}, 1]]}),
        "list-body-not-array": state({"dict": [["w", {"list": 3}]]}),
        "deep-nesting": state({"dict": [["w", deep]]}),
    }


_HEADER_CASES = _header_cases()


@pytest.mark.parametrize("case", sorted(_HEADER_CASES))
def test_a_malformed_header_is_refused_naming_the_file(tmp_path: Path, case: str) -> None:
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "flags": torch.tensor([True, False])}, "n": 1}
    header, section = split_file(serialize(state))
    path = tmp_path / "rank-0.pt"
    path.write_bytes(join_file(_HEADER_CASES[case](header), section))
    with pytest.raises(CheckpointError) as caught:
        checkpoint_module.read_state(path)
    assert str(path) in str(caught.value)


def _byte_cases(data: bytes) -> dict[str, bytes]:
    header, section = split_file(data)
    magic = checkpoint_module.MAGIC
    text = json.dumps(header).encode()
    flags = header["tensors"][1]["offset"]
    return {
        "empty": b"",
        "truncated-in-magic": data[:10],
        "truncated-in-preamble": data[: len(magic) + 5],
        "truncated-in-header": data[: _PREFIX + 5],
        "truncated-in-data": data[:-1],
        "trailing-bytes": data + b"\0",
        "bad-magic": b"\x88" + data[1:],
        "zip-archive": b"PK\x03\x04" + data[4:],
        "version-1": join_file(header, section, version=1),
        "version-3": join_file(header, section, version=3),
        "header-length-huge": magic + struct.pack("<IQ", 2, 1 << 63) + data[_PREFIX:],
        "header-not-json": join_file(None, section, raw_header=b"{" + b"x" * (len(text) - 1)),
        "header-not-utf8": join_file(None, section, raw_header=b'{"\xff\xfe": 1}'),
        "nan-literal": join_file(None, section, raw_header=text.replace(b'"n", 1', b'"n", NaN')),
        "huge-float-literal": join_file(None, section, raw_header=text.replace(b'"n", 1', b'"n", 1e999')),
        "huge-int-literal": join_file(
            None, section, raw_header=text.replace(b'"n", 1', b'"n", ' + b"9" * 5000)
        ),
        "deep-json": join_file(None, section, raw_header=b'{"state": ' + b"[" * 100_000),
        "bool-byte-2": join_file(header, section[:flags] + b"\x02" + section[flags + 1 :]),
    }


def test_truncated_or_garbled_bytes_are_refused_naming_the_file(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "flags": torch.tensor([True, False])}, "n": 1}
    data = serialize(state)
    assert b'"n", 1' in json.dumps(split_file(data)[0]).encode()
    for case, payload in _byte_cases(data).items():
        path = tmp_path / f"{case}.pt"
        path.write_bytes(payload)
        with pytest.raises(CheckpointError) as caught:
            checkpoint_module.read_state(path)
        assert str(path) in str(caught.value), case
    with pytest.raises(CheckpointError, match="cannot be opened"):
        checkpoint_module.read_state(tmp_path / "missing.pt")


_JUNK: list[Any] = [
    -1, 0, 1, 63, 64, 1 << 62, 1 << 64, 1.5, -0.0, "", "float32", "bool", None, True, False,
    [], [0], [-1], [1 << 62, 4], {}, {"tensor": 0}, {"list": 5}, {"dict": [[1]]}, {"float": "inf"},
]  # fmt: skip


def _subtrees(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield from _subtrees(child, (*path, key))


def _replaced(node: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    copy = dict(node) if isinstance(node, dict) else list(node)
    copy[path[0]] = _replaced(node[path[0]], path[1:], value)
    return copy


def _load_outcome(path: Path) -> str:
    """ "ok" or "refused"; anything but CheckpointError escapes (and fails the test)."""
    try:
        loaded = checkpoint_module.read_state(path)
    except CheckpointError as exc:
        message = str(exc)
    else:
        assert isinstance(loaded, dict)
        return "ok"
    assert str(path) in message
    return "refused"


@pytest.mark.timeout(180)
def test_fuzzed_files_only_ever_load_or_raise_checkpoint_error(
    store: CheckpointStore, tmp_path: Path
) -> None:
    """Hundreds of random mutations of a real checkpoint: bytes anywhere (mostly in the header),
    truncations, insertions, and subtrees of the JSON header replaced by junk."""
    model, optimizer = make_training()
    train(model, optimizer, 2, seed=1)
    state = {**training_state(model, optimizer, 2), "rng": {"python": random.Random(3).getstate()}}
    store.save(2, state, {})
    data = step_files(store.root, 2)[0].read_bytes()
    header, section = split_file(data)
    header_end = len(data) - len(section)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    path = tmp_path / "fuzzed.pt"
    outcomes: dict[str, int] = {"ok": 0, "refused": 0}
    started = time.monotonic()

    for trial in range(400):
        mutated = bytearray(data)
        kind = trial % 4
        if kind == 0:  # a few bytes in the header
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(header_end)] = rng.randrange(256)
        elif kind == 1:  # a few bytes anywhere
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
        elif kind == 2:  # truncated
            del mutated[rng.randrange(len(mutated)) :]
        else:  # a run of bytes inserted into or deleted from the header
            at = rng.randrange(header_end)
            if rng.random() < 0.5:
                mutated[at:at] = rng.randbytes(rng.randint(1, 8))
            else:
                del mutated[at : at + rng.randint(1, 8)]
        path.write_bytes(bytes(mutated))
        outcomes[_load_outcome(path)] += 1

    subtrees = list(_subtrees(header))
    for _ in range(300):
        edited = _replaced(header, rng.choice(subtrees), rng.choice(_JUNK))
        path.write_bytes(join_file(edited, section))
        outcomes[_load_outcome(path)] += 1

    assert outcomes["refused"] > 300, f"seed {seed}: {outcomes}"
    assert outcomes["ok"] > 20, f"seed {seed}: {outcomes}"  # flips in tensor bytes still parse
    assert time.monotonic() - started < 120, f"seed {seed}: fuzzing took too long"


# --- corruption and fallback ---------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "bit-flip"])
def test_damaged_data_file_is_detected_and_newest_valid_falls_back(
    store: CheckpointStore, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    store.save(10, small_state(10.0), {})
    store.save(20, small_state(20.0), {})
    assert store.newest_valid() == 20
    data_path, _ = step_files(store.root, 20)
    if damage == "truncate":
        with open(data_path, "r+b") as handle:
            handle.truncate(data_path.stat().st_size // 2)
    else:
        flip_one_bit(data_path)

    verdict = store.verify(20)
    assert not verdict.valid
    assert verdict.step == 20
    assert str(data_path) in verdict.reason
    assert ("truncated" if damage == "truncate" else "SHA-256") in verdict.reason
    assert store.verify(10).valid

    with caplog.at_level(logging.WARNING, logger=checkpoint_module.__name__):
        assert store.newest_valid() == 10
    assert any(str(data_path) in record.getMessage() for record in caplog.records)
    assert_same_state(store.load(10), small_state(10.0))


def test_missing_data_file_is_detected(store: CheckpointStore) -> None:
    store.save(10, small_state(10.0), {})
    store.save(20, small_state(20.0), {})
    data_path, _ = step_files(store.root, 20)
    data_path.unlink()
    verdict = store.verify(20)
    assert not verdict.valid
    assert str(data_path) in verdict.reason
    assert store.newest_valid() == 10


def test_corrupt_manifest_is_skipped_with_a_reason_naming_it(store: CheckpointStore) -> None:
    store.save(10, small_state(10.0), {})
    store.save(20, small_state(20.0), {})
    _, manifest_path = step_files(store.root, 20)
    manifest_path.write_text("{this is not json")

    verdict = store.verify(20)
    assert not verdict.valid
    # The reason must point at the file that is broken: the manifest, which is present but unreadable.
    assert str(manifest_path) in verdict.reason, verdict.reason
    assert store.newest_valid() == 10


def test_manifest_of_another_step_is_rejected(store: CheckpointStore) -> None:
    store.save(10, small_state(10.0), {})
    store.save(20, small_state(20.0), {})
    _, manifest_path = step_files(store.root, 20)
    manifest = json.loads(manifest_path.read_text())
    manifest["step"] = 30
    manifest_path.write_text(json.dumps(manifest))
    verdict = store.verify(20)
    assert not verdict.valid
    assert str(manifest_path) in verdict.reason
    assert store.newest_valid() == 10


def test_incomplete_checkpoint_is_neither_complete_nor_chosen(tmp_path: Path) -> None:
    rank0 = CheckpointStore(tmp_path, rank=0, world_size=2)
    rank1 = CheckpointStore(tmp_path, rank=1, world_size=2)
    try:
        rank0.save(10, small_state(10.0), {})
        rank1.save(10, {"rng": torch.arange(4) + 10, "data": {"index": 10}}, {})
        assert rank0.is_complete(10)

        rank0.save(20, small_state(20.0), {})
        assert (tmp_path / step_dir_name(20) / "rank-0.json").exists()
        assert not (tmp_path / step_dir_name(20) / "rank-1.json").exists()
        assert not rank0.is_complete(20)
        verdict = rank0.verify(20)
        assert not verdict.valid
        assert "incomplete" in verdict.reason
        assert rank0.newest_valid() == 10
        assert rank1.newest_valid() == 10

        # Once rank 1 publishes its part the checkpoint is complete and both ranks choose it.
        rank1.save(20, {"rng": torch.arange(4) + 20, "data": {"index": 20}}, {})
        assert rank0.is_complete(20)
        assert rank0.newest_valid() == 20
        assert rank1.newest_valid() == 20
        merged = rank1.load(20)
        assert_same_state(merged["model"], small_state(20.0)["model"])
        assert_same_state(merged["rng"], torch.arange(4) + 20)
        assert merged["data"] == {"index": 20}
        assert "rng" not in rank0.load(20)

        # Rank 1 also checks rank 0's file, which holds the model it loads.
        flip_one_bit(tmp_path / step_dir_name(20) / "rank-0.pt")
        assert not rank1.verify(20).valid
        assert rank1.newest_valid() == 10
    finally:
        rank0.close()
        rank1.close()


def test_a_rank_beyond_the_writers_world_size_can_resume_from_rank_0s_files(tmp_path: Path) -> None:
    """A job restarted with more ranks: the new rank has no file of its own, and load() supports that
    (it starts the rank's RNG and data position afresh), so verify() must accept the checkpoint too;
    otherwise the ranks disagree and the job's agreed resume step (a MIN over ranks) is "none"."""
    writer = CheckpointStore(tmp_path, rank=0, world_size=1)
    writer.save(10, {**small_state(10.0), "rng": torch.arange(3)}, {})
    writer.close()
    new_rank = CheckpointStore(tmp_path, rank=1, world_size=2)
    try:
        loaded = new_rank.load(10)
        assert_same_state(loaded["model"], small_state(10.0)["model"])
        assert "rng" not in loaded
        verdict = new_rank.verify(10)
        assert verdict.valid, verdict.reason
        assert new_rank.newest_valid() == 10
    finally:
        new_rank.close()


# --- never overwrite; move aside what is broken ------------------------------------------------------


def test_saving_a_step_that_already_has_a_valid_checkpoint_does_not_rewrite_it(
    store: CheckpointStore,
) -> None:
    store.save(7, small_state(7.0), {})
    data_path, manifest_path = step_files(store.root, 7)
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in (data_path, manifest_path)}
    listing = sorted(p.name for p in data_path.parent.iterdir())
    time.sleep(0.01)

    ref = store.save(7, small_state(99.0), {"different": True})

    assert ref is not None
    assert ref.step == 7
    after = {p: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in (data_path, manifest_path)}
    assert after == before
    assert sorted(p.name for p in data_path.parent.iterdir()) == listing
    assert_same_state(store.load(7), small_state(7.0))


@pytest.mark.parametrize("damage", ["bit-flip", "truncate", "garbage-manifest"])
def test_corrupted_existing_step_is_moved_aside_and_rewritten(store: CheckpointStore, damage: str) -> None:
    store.save(7, small_state(7.0), {})
    data_path, manifest_path = step_files(store.root, 7)
    if damage == "bit-flip":
        flip_one_bit(data_path)
    elif damage == "truncate":
        with open(data_path, "r+b") as handle:
            handle.truncate(10)
    else:
        manifest_path.write_text("not json at all")
    damaged = {p.name: p.read_bytes() for p in (data_path, manifest_path)}
    assert not store.verify(7).valid

    ref = store.save(7, small_state(8.0), {})

    assert ref is not None
    assert ref.step == 7
    assert store.verify(7).valid
    assert_same_state(store.load(7), small_state(8.0))
    # The damaged files were kept, renamed, byte for byte.
    for name, content in damaged.items():
        aside = sorted(data_path.parent.glob(f"{name}.corrupt-*"))
        assert len(aside) == 1, f"{name} was not moved aside: {sorted(data_path.parent.iterdir())}"
        assert aside[0].read_bytes() == content


# --- the checkpoint root -------------------------------------------------------------------------------


def test_root_that_is_a_regular_file_raises_naming_the_path(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    with pytest.raises(CheckpointError, match="checkpoint directory") as caught:
        CheckpointStore(afile)
    assert str(afile) in str(caught.value)
    assert afile.read_text() == "not a directory"


def test_root_that_cannot_be_created_raises_naming_the_path(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    root = afile / "sub"
    with pytest.raises(CheckpointError) as caught:
        CheckpointStore(root)
    assert str(root) in str(caught.value)


def test_existing_directory_that_is_not_writable_raises_naming_the_path() -> None:
    # chmod does not stop root, so use a directory no process can create files in: procfs.
    root = Path("/proc")
    assert root.is_dir()
    with pytest.raises(CheckpointError, match="not writable") as caught:
        CheckpointStore(root)
    assert str(root) in str(caught.value)


# --- loading never runs code ---------------------------------------------------------------------------


class _RunsCodeWhenUnpickled:
    """Unpickling this calls ``open(marker, "w")``: a stand-in for arbitrary code in a hostile file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def _publish_crafted(store: CheckpointStore, step: int, payload: bytes) -> Path:
    """Place ``payload`` as rank-0.pt of ``step`` with a manifest that matches it (size and SHA-256)."""
    directory = store.root / step_dir_name(step)
    directory.mkdir()
    data_path = directory / "rank-0.pt"
    data_path.write_bytes(payload)
    manifest = {
        "format": checkpoint_module.FORMAT_VERSION,
        "step": step,
        "rank": 0,
        "world_size": 1,
        "time": time.time(),
        "files": {"rank-0.pt": {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}},
    }
    (directory / "rank-0.json").write_text(json.dumps(manifest))
    return data_path


def _hostile_torch_save(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.ones(2)}, "payload": _RunsCodeWhenUnpickled(marker)}, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("kind", ["torch.save", "pickle"])
def test_load_refuses_a_manifested_file_whose_pickle_would_run_code(
    store: CheckpointStore, tmp_path: Path, kind: str
) -> None:
    marker = tmp_path / "code-ran"
    hostile = _RunsCodeWhenUnpickled(marker)
    payload = _hostile_torch_save(marker) if kind == "torch.save" else pickle.dumps({"model": hostile})
    data_path = _publish_crafted(store, 3, payload)
    # The manifest matches, so the checkpoint verifies: only the parser stands between it and the loader.
    assert store.verify(3).valid

    with pytest.raises(CheckpointError, match="not a trainguard checkpoint") as caught:
        store.load(3)
    assert str(data_path) in str(caught.value)
    assert not marker.exists()

    # Control: the same bytes loaded by pickle really do run the code.
    if kind == "torch.save":
        torch.load(data_path, weights_only=False)
    else:
        pickle.loads(payload)  # the point of the control
    assert marker.exists()


def test_load_refuses_a_pickle_behind_valid_magic_and_header(store: CheckpointStore, tmp_path: Path) -> None:
    """A well-formed header whose data section holds a pickle: the bytes are only ever tensor bytes."""
    marker = tmp_path / "code-ran"
    pickled = pickle.dumps({"model": _RunsCodeWhenUnpickled(marker)})
    state = {"model": {"blob": torch.frombuffer(bytearray(pickled), dtype=torch.uint8)}}
    payload = serialize(state)
    _publish_crafted(store, 3, payload)
    loaded = store.load(3)
    assert bytes(loaded["model"]["blob"].numpy()) == pickled
    assert not marker.exists()


def test_load_rejects_a_file_that_is_not_a_checkpoint_dict(store: CheckpointStore) -> None:
    directory = store.root / step_dir_name(4)
    directory.mkdir()
    torch.save(torch.zeros(3), directory / "rank-0.pt")
    with pytest.raises(CheckpointError, match="not a trainguard checkpoint"):
        store.load(4)
    (directory / "rank-0.pt").write_bytes(serialize([torch.zeros(3), 1]))  # a v2 file, but a list
    with pytest.raises(CheckpointError, match=r"not a trainguard checkpoint \(top level is list\)"):
        store.load(4)


def test_a_format_1_checkpoint_is_skipped_as_an_unknown_format(store: CheckpointStore) -> None:
    store.save(10, small_state(10.0), {})
    directory = store.root / step_dir_name(20)
    directory.mkdir()
    buffer = io.BytesIO()
    torch.save(small_state(20.0), buffer)
    (directory / "rank-0.pt").write_bytes(buffer.getvalue())
    manifest = {
        "format": 1,
        "step": 20,
        "world_size": 1,
        "time": time.time(),
        "files": {
            "rank-0.pt": {
                "size": len(buffer.getvalue()),
                "sha256": hashlib.sha256(buffer.getvalue()).hexdigest(),
            }
        },
    }
    (directory / "rank-0.json").write_text(json.dumps(manifest))
    verdict = store.verify(20)
    assert not verdict.valid
    assert "unknown checkpoint format 1" in verdict.reason
    assert str(directory / "rank-0.json") in verdict.reason
    assert store.newest_valid() == 10


# --- asynchronous saves --------------------------------------------------------------------------------


def test_back_to_back_save_async_each_store_the_state_at_their_call(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = make_training()
    train(model, optimizer, 2, seed=3)
    live = training_state(model, optimizer, 2)
    at_first_call = clone_state(live)

    # Hold the first background write inside its file write until released, so it is surely in flight.
    gate = threading.Event()
    original_write = checkpoint_module._write_all

    def gated_write(fd: int, views: Sequence[memoryview]) -> None:
        assert gate.wait(timeout=30), "the gate was never opened"
        original_write(fd, views)

    monkeypatch.setattr(checkpoint_module, "_write_all", gated_write)

    store.save_async(2, live, {"n": 1})
    assert store.busy
    # Mutate the live state in place while the first write is in flight.
    train(model, optimizer, 3, seed=4)
    live_after = training_state(model, optimizer, 5)
    at_second_call = clone_state(live_after)
    assert not torch.equal(at_first_call["model"]["0.weight"], at_second_call["model"]["0.weight"])

    releaser = threading.Timer(0.3, gate.set)
    releaser.start()
    try:
        assert store.busy
        store.save_async(5, live_after, {"n": 2})  # issued while the first is still being written
        # Mutate again straight after the second call returned: must not reach the second checkpoint.
        train(model, optimizer, 1, seed=5)
        ref = store.wait()
    finally:
        gate.set()
        releaser.join()

    assert ref is not None
    assert ref.step == 5
    assert store.verify(2).valid
    assert store.verify(5).valid
    assert_same_state(store.load(2), at_first_call)
    assert_same_state(store.load(5), at_second_call)


def test_write_errors_surface_on_wait_as_checkpoint_error(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_write(fd: int, views: Sequence[memoryview]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "_write_all", failing_write)
    store.save_async(1, small_state(1.0), {})
    with pytest.raises(CheckpointError, match="No space left") as caught:
        store.wait()
    assert str(store.root) in str(caught.value)
    assert store.newest_valid() is None
    # The temp file is removed; the hashing thread has stopped.
    assert [p.name for p in store.root.rglob("*") if p.is_file()] == []
    assert not [t for t in threading.enumerate() if t.name == "trainguard-hash"]


# --- retention -----------------------------------------------------------------------------------------

_KINDS = ("complete", "incomplete-world-2", "data-only")


def _build(root: Path, plan: dict[int, str]) -> None:
    """Create checkpoints per ``plan`` (step -> kind), in its order, without any pruning."""
    # Pruning runs in the stores' janitor threads: they must be closed while it is still patched out.
    with mock.patch.object(CheckpointStore, "prune", return_value=[]):
        single = CheckpointStore(root, world_size=1)
        partial = CheckpointStore(root, rank=0, world_size=2)
        try:
            for step, kind in plan.items():
                if kind == "complete":
                    single.save(step, small_state(float(step)), {})
                elif kind == "incomplete-world-2":
                    partial.save(step, small_state(float(step)), {})
                else:  # a crash mid-write: a data file, no manifest
                    directory = root / step_dir_name(step)
                    directory.mkdir()
                    (directory / "rank-0.pt").write_bytes(b"half a checkpoint")
        finally:
            single.close()
            partial.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=st.dictionaries(st.integers(0, 60), st.sampled_from(_KINDS), min_size=1, max_size=9),
    keep=st.integers(1, 4),
)
def test_prune_keeps_exactly_the_newest_complete_checkpoints(plan: dict[int, str], keep: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        _build(root, plan)
        complete = sorted(step for step, kind in plan.items() if kind == "complete")
        assert sorted(plan) == sorted(int(p.name.removeprefix("step-")) for p in root.glob("step-*"))

        store = CheckpointStore(root, keep_clean=keep)
        try:
            deleted = store.prune()
            remaining = store.steps()
            remaining_complete = [step for step in remaining if store.is_complete(step)]
            if complete:
                kept = complete[-keep:]
                assert remaining_complete == kept
                assert len(remaining_complete) <= keep
                assert complete[-1] in remaining
                assert store.verify(complete[-1]).valid
                assert store.newest_valid() == complete[-1]
                # Incomplete directories newer than the oldest kept may still be being written.
                assert remaining == [step for step in sorted(plan) if step >= kept[0]]
            else:
                assert deleted == []
                assert remaining == sorted(plan)
                assert store.newest_valid() is None
            assert sorted(deleted) == sorted(set(plan) - set(remaining))
            assert store.prune() == []  # idempotent
        finally:
            store.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(st.integers(0, 100), min_size=1, max_size=10, unique=True),
    keep=st.integers(1, 3),
)
def test_saving_prunes_as_it_goes_and_never_loses_the_newest(steps: list[int], keep: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        store = CheckpointStore(Path(directory), keep_clean=keep)
        try:
            saved: list[int] = []
            for step in steps:
                store.save(step, small_state(float(step)), {})
                store.wait_for_pruning()  # pruning runs after the save is durable, in the background
                saved.append(step)
                complete = [s for s in store.steps() if store.is_complete(s)]
                assert complete == sorted(saved)[-keep:]
                assert store.newest_valid() == max(saved)
            newest = max(saved)
            assert_same_state(store.load(newest), small_state(float(newest)))
        finally:
            store.close()


def _gate_prune(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make every prune wait for the returned ``release`` event; ``entered`` is set when one starts."""
    entered, release = threading.Event(), threading.Event()
    original = CheckpointStore.prune

    def gated(self: CheckpointStore) -> list[int]:
        entered.set()
        assert release.wait(timeout=30), "the prune was never released"
        return original(self)

    monkeypatch.setattr(CheckpointStore, "prune", gated)
    return entered, release


def test_pruning_is_off_the_path_wait_waits_on_and_close_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path, keep_clean=1)
    entered, release = _gate_prune(monkeypatch)
    try:
        assert store.save(1, small_state(1.0), {}) is not None
        assert entered.wait(timeout=10)
        # The pruning after step 1 is stuck, yet the next save completes and is durable.
        ref = store.save(2, small_state(2.0), {})
        assert ref is not None
        assert ref.step == 2
        assert store.verify(2).valid
        assert store.steps() == [1, 2]

        closer = threading.Thread(target=store.close)
        closer.start()
        closer.join(timeout=0.3)
        assert closer.is_alive(), "close() returned while pruning was still pending"
    finally:
        release.set()
    closer.join(timeout=30)
    assert not closer.is_alive()
    assert store.steps() == [2]


def test_a_failing_prune_is_logged_and_the_store_keeps_working(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def failing(self: CheckpointStore) -> list[int]:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(CheckpointStore, "prune", failing)
    with caplog.at_level(logging.ERROR, logger=checkpoint_module.__name__):
        assert store.save(1, small_state(1.0), {}) is not None
        store.wait_for_pruning()
        assert store.save(2, small_state(2.0), {}) is not None
        store.wait_for_pruning()
    failures = [r for r in caplog.records if "pruning old checkpoints" in r.getMessage()]
    assert len(failures) == 2
    assert "Input/output error" in caplog.text
    assert store.newest_valid() == 2


def test_pruning_never_deletes_a_step_while_this_store_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path, keep_clean=1)
    try:
        store.save(10, small_state(10.0), {})
        store.save(20, small_state(20.0), {})
        store.wait_for_pruning()
        assert store.steps() == [20]

        gate = threading.Event()
        original_write = checkpoint_module._write_all

        def gated_write(fd: int, views: Sequence[memoryview]) -> None:
            assert gate.wait(timeout=30), "the gate was never opened"
            original_write(fd, views)

        monkeypatch.setattr(checkpoint_module, "_write_all", gated_write)
        store.save_async(5, small_state(5.0), {})  # older than the newest complete: a prune target
        deadline = time.monotonic() + 10
        while not (tmp_path / step_dir_name(5)).is_dir():
            assert time.monotonic() < deadline, "the write of step 5 never started"
            time.sleep(0.005)
        assert store.prune() == []  # step 5 is being written: left alone
        assert (tmp_path / step_dir_name(5)).is_dir()
        gate.set()
        ref = store.wait()
        assert ref is not None
        assert ref.step == 5
        store.wait_for_pruning()  # now it is complete and older than the newest: pruned as usual
        assert store.steps() == [20]
        assert store.newest_valid() == 20
    finally:
        store.close()


# --- SIGKILL during writes -----------------------------------------------------------------------------

# A "zygote": imports torch once, then forks a fresh worker process per run (so a restart costs
# milliseconds, not a torch import). The worker saves a checkpoint per step, forever, printing
# "saved N" after each save returned. The zygote is the worker's parent, so it kills and reaps it:
# a killed PID is never reused before the kill.
_ZYGOTE = r"""
import os
import signal
import sys
from pathlib import Path

import torch

from trainer_sidecar.checkpoint import CheckpointStore

root, numel, tensors, keep = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])


def say(text):
    os.write(1, (text + "\n").encode())


def state_for(step):
    model = {f"w{k}": torch.full((numel,), float(step) + k) for k in range(tensors)}
    return {"model": model, "step": step, "tag": f"step {step}"}


def work(start):
    torch.set_num_threads(1)
    store = CheckpointStore(root, keep_clean=keep)
    step = start
    while True:
        store.save(step, state_for(step), {"kill_test": True})
        say(f"saved {step}")
        step += 1


say("ready")
worker = None
while True:
    line = sys.stdin.readline()
    if not line:
        break
    command, *args = line.split()
    if command == "run":
        worker = os.fork()
        if worker == 0:
            try:
                work(int(args[0]))
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(3)
        say(f"pid {worker}")
    elif command == "kill":
        os.kill(worker, signal.SIGKILL)
        _, status = os.waitpid(worker, 0)
        worker = None
        say(f"exit {status}")
if worker is not None:
    os.kill(worker, signal.SIGKILL)
    os.waitpid(worker, 0)
"""

_NUMEL = 1_500_000  # 4 tensors of float32: 24 MB per checkpoint
_TENSORS = 4
_KEEP = 2
_KILLS = 24


class _Zygote:
    """Drives the zygote over its stdin and collects its (and its workers') stdout lines."""

    def __init__(self, script: Path, root: Path, stderr: IO[bytes]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(script), str(root), str(_NUMEL), str(_TENSORS), str(_KEEP)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=REPO_ROOT,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.last_saved: int | None = None
        self.saved_times: list[float] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            self.lines.put(raw.decode().strip())
        self.lines.put(None)

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{command}\n".encode())
        self.process.stdin.flush()

    def expect(self, prefix: str, timeout: float = 30.0) -> str:
        """The next line starting with ``prefix``, noting every "saved N" seen on the way."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line from the zygote within {timeout} s") from None
            if line is None:
                raise AssertionError(f"the zygote exited while waiting for {prefix!r}")
            if line.startswith("saved "):
                self.last_saved = int(line.split()[1])
                self.saved_times.append(time.monotonic())
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
            if line.startswith("exit "):
                raise AssertionError(f"the worker died on its own (wait status {line.split()[1]})")

    def close(self) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _expected_kill_state(step: int) -> dict[str, Any]:
    model = {f"w{k}": torch.full((_NUMEL,), float(step) + k) for k in range(_TENSORS)}
    return {"model": model, "step": step, "tag": f"step {step}"}


@pytest.mark.slow
def test_sigkill_at_random_moments_never_leaves_the_store_without_a_loadable_newest(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    root = tmp_path / "ckpt"
    script = tmp_path / "zygote.py"
    script.write_text(_ZYGOTE)
    stderr_path = tmp_path / "zygote.stderr"

    with open(stderr_path, "wb") as stderr:
        zygote = _Zygote(script, root, stderr)
        try:
            zygote.expect("ready", timeout=60)
            checker = CheckpointStore(root, keep_clean=_KEEP)
            start = 0
            period = 0.0
            mid_write_kills = 0
            newest_history: list[int] = []
            for kill in range(_KILLS):
                zygote.send(f"run {start}")
                zygote.expect("pid ")
                launched = time.monotonic()
                if kill == 0:
                    # Let the first checkpoint complete, and time a save to aim the kills at.
                    zygote.expect("saved ")
                    zygote.expect("saved ")
                    period = zygote.saved_times[-1] - zygote.saved_times[-2]
                    launched = time.monotonic()
                elif kill % 4 == 3:
                    # Every few runs, let one save of this run finish first: on a loaded machine a
                    # restart can take longer than the kill window, and the store must still be seen
                    # to make progress across restarts.
                    zygote.expect("saved ")
                    launched = time.monotonic()
                # Uniform over a few save periods from the (re)start: covers the store's start-up,
                # torch.save, fsync, the renames, the manifest and the pruning of old checkpoints.
                delay = rng.uniform(0, 2.5 * period)
                time.sleep(max(0.0, launched + delay - time.monotonic()))
                zygote.send("kill")
                status = int(zygote.expect("exit "))
                context = f"seed {seed}, kill {kill}, delay {delay:.3f} s (save period {period:.3f} s)"
                assert os.WIFSIGNALED(status), f"{context}: worker exited with {status}"
                assert os.WTERMSIG(status) == signal.SIGKILL, context

                newest = checker.newest_valid()
                assert newest is not None, f"{context}: no valid checkpoint left"
                assert zygote.last_saved is not None
                assert newest >= zygote.last_saved, f"{context}: saved {zygote.last_saved} is gone"
                verdict = checker.verify(newest)
                assert verdict.valid, f"{context}: {verdict.reason}"
                assert_same_state(checker.load(newest), _expected_kill_state(newest), f"step {newest}")
                newest_history.append(newest)

                leftovers = [p for p in root.rglob("*") if ".tmp-" in p.name]
                if any(step > newest for step in checker.steps()) or leftovers:
                    mid_write_kills += 1
                start = newest + 1

            # Kills must have hit writes in progress, not only the gaps between them.
            assert mid_write_kills >= 3, f"seed {seed}: only {mid_write_kills} kills landed mid-write"
            assert newest_history[-1] > newest_history[0], f"seed {seed}: no progress across restarts"

            # Whatever the kills left behind, the next prune restores the retention policy.
            checker.prune()
            complete = [step for step in checker.steps() if checker.is_complete(step)]
            assert len(complete) == _KEEP
            assert checker.newest_valid() == newest_history[-1]
            checker.close()
        finally:
            zygote.close()
            sys.stderr.write(stderr_path.read_text())  # shown with a failure: the worker's traceback
    assert stderr_path.read_text() == "", stderr_path.read_text()

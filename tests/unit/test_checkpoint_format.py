"""The checkpoint data file: every dtype and value round-trips, and no malformed file loads."""

from __future__ import annotations

import json
import math
import random
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.checkpoints import (
    PREFIX,
    assert_same_state,
    clone_state,
    join_file,
    make_training,
    random_tensor,
    same_bits,
    serialize,
    small_state,
    split_file,
    step_files,
    train,
    training_state,
)
from trainer_sidecar.checkpoint import CheckpointError, CheckpointStore
from trainer_sidecar.checkpoint import format as checkpoint_format


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    created = CheckpointStore(tmp_path / "ckpt", keep_clean=3)
    yield created
    created.close()


def test_every_supported_dtype_round_trips_bit_exactly_in_any_shape_and_layout(
    store: CheckpointStore,
) -> None:
    assert {"bfloat16", "bool", "int64", "float16", "float32", "float64", "uint8", "int32"} <= set(
        checkpoint_format.DTYPES
    )
    state: dict[str, Any] = {}
    for index, (name, dtype) in enumerate(checkpoint_format.DTYPES.items()):
        base = random_tensor(dtype, (4, 6), seed=index)
        state[name] = {
            "zero-d": random_tensor(dtype, (), seed=100 + index),
            "empty": random_tensor(dtype, (0,), seed=0),
            "empty-2d": random_tensor(dtype, (3, 0), seed=0),
            "full": base,
            "transposed": base.t(),
            "strided": base[:, ::2],
            "expanded": base[0].expand(3, 6),
            "big": random_tensor(dtype, (300_000 // dtype.itemsize + 3,), seed=200 + index),  # > coalesced
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
        checkpoint_format.read_state(path)
    assert str(path) in str(caught.value)


def _byte_cases(data: bytes) -> dict[str, bytes]:
    header, section = split_file(data)
    magic = checkpoint_format.MAGIC
    text = json.dumps(header).encode()
    flags = header["tensors"][1]["offset"]
    return {
        "empty": b"",
        "truncated-in-magic": data[:10],
        "truncated-in-preamble": data[: len(magic) + 5],
        "truncated-in-header": data[: PREFIX + 5],
        "truncated-in-data": data[:-1],
        "trailing-bytes": data + b"\0",
        "bad-magic": b"\x88" + data[1:],
        "zip-archive": b"PK\x03\x04" + data[4:],
        "version-1": join_file(header, section, version=1),
        "version-3": join_file(header, section, version=3),
        "header-length-huge": magic + struct.pack("<IQ", 2, 1 << 63) + data[PREFIX:],
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
            checkpoint_format.read_state(path)
        assert str(path) in str(caught.value), case
    with pytest.raises(CheckpointError, match="cannot be opened"):
        checkpoint_format.read_state(tmp_path / "missing.pt")


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
        loaded = checkpoint_format.read_state(path)
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

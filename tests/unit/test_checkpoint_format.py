"""The checkpoint data file: every dtype and value round-trips, and no malformed file loads."""

from __future__ import annotations

import enum
import json
import math
import os
import random
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import safetensors.torch as safetensors_torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.checkpoints import (
    assert_same_state,
    clone_state,
    header_state,
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
    with_state,
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


def test_the_file_is_a_safetensors_header_with_the_state_in_its_metadata_and_raw_bytes(
    store: CheckpointStore,
) -> None:
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    flags = torch.tensor([True, False, True])
    counter = torch.tensor(7, dtype=torch.int64)
    store.save(1, {"model": {"w": weight, "flags": flags, "n": counter}, "step": 1, "lr": math.inf}, {})
    data = step_files(store.root, 1)[0].read_bytes()

    header, section = split_file(data)
    metadata = header.pop("__metadata__")
    assert metadata["format"] == "pt"
    assert metadata["trainguard"] == str(checkpoint_format.FORMAT_VERSION)
    assert header_state({"__metadata__": metadata}) == {
        "dict": [
            ["model", {"dict": [["w", {"tensor": "model/w"}], ["flags", {"tensor": "model/flags"}],
                                ["n", {"tensor": "model/n"}]]}],
            ["step", 1],
            ["lr", {"float": "inf"}],
        ]
    }  # fmt: skip
    # Largest item size first, back to back, the data starting at a multiple of 64.
    assert header == {
        "model/n": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]},
        "model/w": {"dtype": "F32", "shape": [3, 4], "data_offsets": [8, 56]},
        "model/flags": {"dtype": "BOOL", "shape": [3], "data_offsets": [56, 59]},
    }
    assert len(section) == 59
    assert (len(data) - len(section)) % 64 == 0
    assert section[8:56] == weight.numpy().tobytes()
    assert section[56:59] == b"\x01\x00\x01"


def test_every_tensor_starts_at_a_multiple_of_its_item_size(store: CheckpointStore) -> None:
    state = {
        f"{name}-{size}": random_tensor(dtype, (size,), seed=size)
        for size in (1, 3, 5)
        for name, dtype in checkpoint_format.DTYPES.items()
    }
    store.save(1, state, {})
    data = step_files(store.root, 1)[0].read_bytes()
    header, section = split_file(data)
    data_start = len(data) - len(section)
    itemsizes = {name: dtype.itemsize for name, dtype in checkpoint_format.DTYPES.items()}
    for name, entry in header.items():
        if name != "__metadata__":
            assert (data_start + entry["data_offsets"][0]) % itemsizes[name.split("-")[0]] == 0, name


def test_the_real_safetensors_package_opens_a_checkpoint_by_meaningful_names(store: CheckpointStore) -> None:
    model, optimizer = make_training()
    train(model, optimizer, 2, seed=5)
    state = {
        **training_state(model, optimizer, 2),
        "spectrum": torch.randn(3, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(1)),
    }
    expected = clone_state(state)
    store.save(2, state, {})

    opened = safetensors_torch.load_file(str(step_files(store.root, 2)[0]))

    names = {
        **{f"model/{key}": value for key, value in expected["model"].items()},
        **{
            f"optimizer/state/{index}/{key}": value
            for index, moments in expected["optimizer"]["state"].items()
            for key, value in moments.items()
        },
    }
    assert set(opened) == {*names, "spectrum"}
    for name, tensor in names.items():
        assert same_bits(opened[name], tensor), name
    # complex128, which safetensors cannot name, reads as float64 pairs (real, imaginary).
    assert same_bits(opened["spectrum"], torch.view_as_real(expected["spectrum"]))
    header, _ = split_file(step_files(store.root, 2)[0].read_bytes())
    assert json.loads(header["__metadata__"]["dtypes"]) == {"spectrum": "complex128"}
    assert_same_state(store.load(2), expected)


def test_a_file_written_by_the_safetensors_package_with_our_metadata_loads(tmp_path: Path) -> None:
    weight = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
    state_tree = {"dict": [["model", {"dict": [["w", {"tensor": "model/w"}]]}], ["step", 9]]}
    path = tmp_path / "theirs.safetensors"
    safetensors_torch.save_file(
        {"model/w": weight}, str(path), metadata={"trainguard": "3", "state": json.dumps(state_tree)}
    )
    loaded = checkpoint_format.read_state(path)
    assert_same_state(loaded, {"model": {"w": weight}, "step": 9})


def test_names_taken_twice_get_a_suffix_and_never_the_metadata_key(store: CheckpointStore) -> None:
    state = {
        "a/b": torch.zeros(1),
        "a": {"b": torch.ones(1)},
        "__metadata__": torch.full((1,), 2.0),
        "n": {0: torch.full((1,), 3.0), "0": torch.full((1,), 4.0)},
    }
    expected = clone_state(state)
    store.save(1, state, {})
    header, _ = split_file(step_files(store.root, 1)[0].read_bytes())
    assert set(header) == {"__metadata__", "a/b", "a/b#2", "__metadata__#2", "n/0", "n/0#2"}
    assert_same_state(store.load(1), expected)


def test_a_format_2_file_is_refused_naming_the_file_and_the_format(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.pt"
    path.write_bytes(checkpoint_format.LEGACY_MAGIC + struct.pack("<IQ", 2, 2) + b"{}")
    with pytest.raises(CheckpointError, match="format 2 checkpoint") as caught:
        checkpoint_format.read_state(path)
    assert str(path) in str(caught.value)


def test_bool_bytes_other_than_0_read_as_true(tmp_path: Path) -> None:
    header, _ = split_file(serialize({"flags": torch.tensor([True, False, True])}))
    path = tmp_path / "bools.safetensors"
    path.write_bytes(join_file(header, b"\x02\x00\xff"))
    flags = checkpoint_format.read_state(path)["flags"]
    assert flags.tolist() == [True, False, True]
    assert flags.view(torch.uint8).tolist() == [1, 0, 1]


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
        return lambda h: {**h, "model/w": {**h["model/w"], **edit}}

    def state(node: Any) -> Any:
        return lambda h: with_state(h, node)

    def metadata(edit: dict[str, Any]) -> Any:
        return lambda h: {**h, "__metadata__": {**h["__metadata__"], **edit}}

    deep: Any = 0
    for _ in range(150):  # beyond the reader's limit of 100 levels
        deep = {"list": [deep]}
    return {
        "offsets-past-end": tensor({"data_offsets": [1 << 20, (1 << 20) + 24]}),
        "offsets-negative": tensor({"data_offsets": [-24, 0]}),
        "offsets-reversed": tensor({"data_offsets": [24, 0]}),
        "offsets-float": tensor({"data_offsets": [0.0, 24.0]}),
        "offsets-bool": tensor({"data_offsets": [False, 24]}),
        "offsets-three": tensor({"data_offsets": [0, 24, 48]}),
        "offsets-length-wrong": tensor({"data_offsets": [0, 20]}),
        "offsets-overlap": tensor({"data_offsets": [2, 26]}),
        "dtype-unknown": tensor({"dtype": "F128"}),
        "dtype-torch-name": tensor({"dtype": "float32"}),
        "dtype-not-a-name": tensor({"dtype": 7}),
        "shape-negative": tensor({"shape": [-1, 3]}),
        "shape-huge": tensor({"shape": [1 << 40, 1 << 40]}),
        "shape-zero-times-huge": tensor({"shape": [0, 1 << 61, 1 << 61]}),
        "shape-string": tensor({"shape": "3x4"}),
        "shape-too-many-dims": tensor({"shape": [1] * 65}),
        "tensor-extra-key": tensor({"pickle": "x"}),
        "tensor-not-an-object": lambda h: {**h, "model/w": [0, 24]},
        "tensor-unnamed-by-state": lambda h: {
            **h,
            "extra": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]},
        },
        "tensor-missing": lambda h: {k: v for k, v in h.items() if k != "model/w"},
        "no-metadata": lambda h: {k: v for k, v in h.items() if k != "__metadata__"},
        "metadata-not-strings": metadata({"extra": 1}),
        "metadata-version-2": metadata({"trainguard": "2"}),
        "metadata-no-state": lambda h: {**h, "__metadata__": {"trainguard": "3"}},
        "metadata-state-not-json": metadata({"state": "{"}),
        "metadata-dtypes-unknown": metadata({"dtypes": json.dumps({"model/w": "float32"})}),
        "metadata-dtypes-wrong-shape": metadata({"dtypes": json.dumps({"model/w": "complex128"})}),
        "header-a-list": lambda h: [h],
        "top-level-list": state({"list": []}),
        "top-level-tensor": state({"tensor": "model/w"}),
        "tensor-ref-unknown": state({"dict": [["w", {"tensor": "nope"}]]}),
        "tensor-ref-int": state({"dict": [["w", {"tensor": 0}]]}),
        "tensor-ref-twice": state(
            {
                "dict": [
                    ["w", {"tensor": "model/w"}],
                    ["v", {"tensor": "model/w"}],
                    ["f", {"tensor": "model/flags"}],
                ]
            }
        ),
        "unknown-tag": state({"dict": [["w", {"pickle": "cos\nsystem"}]]}),
        "two-key-node": state({"dict": [["w", {"list": [], "tuple": []}]]}),
        "bare-array": state({"dict": [["w", [1, 2]]]}),
        "bad-float": state({"dict": [["w", {"float": "nanx"}]]}),
        "pair-of-three": state({"dict": [["w", 1, 2]]}),
        "list-as-key": state({"dict": [[{"list": []}, 1]]}),
        "tensor-as-key": state({"dict": [[{"tensor": "model/w"}, 1]]}),
        "dict-as-key": state({"dict": [[{"dict": []}, 1]]}),
        "list-body-not-array": state({"dict": [["w", {"list": 3}]]}),
        "deep-nesting": state({"dict": [["w", deep]]}),
    }


_HEADER_CASES = _header_cases()


@pytest.mark.parametrize("case", sorted(_HEADER_CASES))
def test_a_malformed_header_is_refused_naming_the_file(tmp_path: Path, case: str) -> None:
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "flags": torch.tensor([True, False])}, "n": 1}
    header, section = split_file(serialize(state))
    path = tmp_path / "rank-0.safetensors"
    path.write_bytes(join_file(_HEADER_CASES[case](header), section))
    with pytest.raises(CheckpointError) as caught:
        checkpoint_format.read_state(path)
    assert str(path) in str(caught.value)


def _byte_cases(data: bytes) -> dict[str, bytes]:
    header, section = split_file(data)
    text = json.dumps(header).encode()
    n_item = b'[\\"n\\",1]'  # the state's ["n", 1], as the header's text escapes it
    assert n_item in text

    def raw(header_text: bytes) -> bytes:
        return join_file(None, section, raw_header=header_text)

    duplicate = text[:-1] + b', "model/w": ' + json.dumps(header["model/w"]).encode() + b"}"
    return {
        "empty": b"",
        "truncated-in-length": data[:5],
        "truncated-in-header": data[:20],
        "truncated-in-data": data[:-1],
        "trailing-bytes": data + b"\0",
        "zip-archive": b"PK\x03\x04" + data[4:],
        "header-length-huge": struct.pack("<Q", 1 << 63) + data[8:],
        "header-length-zero": struct.pack("<Q", 0) + data[8:],
        "header-length-past-end": struct.pack("<Q", len(data)) + data[8:],
        "header-not-an-object": raw(b"[" + text[1:-1] + b"]"),
        "header-not-json": raw(b"{" + b"x" * (len(text) - 1)),
        "header-not-utf8": raw(b'{"\xff\xfe": 1}'),
        "duplicate-key": raw(duplicate),
        "nan-literal": raw(text.replace(b'"model/w": {', b'"x": NaN, "model/w": {')),
        "huge-float-state": raw(text.replace(n_item, b'[\\"n\\",1e999]')),
        "huge-int-state": raw(text.replace(n_item, b'[\\"n\\",' + b"9" * 5000 + b"]")),
        "deep-json": raw(b'{"state": ' + b"[" * 100_000),
    }


def test_truncated_or_garbled_bytes_are_refused_naming_the_file(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "flags": torch.tensor([True, False])}, "n": 1}
    data = serialize(state)
    for case, payload in _byte_cases(data).items():
        path = tmp_path / f"{case}.safetensors"
        path.write_bytes(payload)
        with pytest.raises(CheckpointError) as caught:
            checkpoint_format.read_state(path)
        assert str(path) in str(caught.value), case
    with pytest.raises(CheckpointError, match="cannot be opened"):
        checkpoint_format.read_state(tmp_path / "missing.safetensors")


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
    path = tmp_path / "fuzzed.safetensors"
    outcomes: dict[str, int] = {"ok": 0, "refused": 0}

    for trial in range(500):
        mutated = bytearray(data)
        kind = trial % 5
        if kind == 0:  # a few bytes in the header
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(header_end)] = rng.randrange(256)
        elif kind == 1:  # a few bytes anywhere
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
        elif kind == 2:  # truncated
            del mutated[rng.randrange(len(mutated)) :]
        elif kind == 3:  # a run of bytes inserted into or deleted from the header
            at = rng.randrange(header_end)
            if rng.random() < 0.5:
                mutated[at:at] = rng.randbytes(rng.randint(1, 8))
            else:
                del mutated[at : at + rng.randint(1, 8)]
        else:  # bits of the tensors' bytes: still a well-formed file (the SHA-256 is what catches these)
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(header_end, len(mutated))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(mutated))
        outcome = _load_outcome(path)
        outcomes[outcome] += 1
        assert kind != 4 or outcome == "ok", f"seed {seed}: a flip in tensor bytes was refused"

    subtrees = list(_subtrees(header))
    for _ in range(300):
        edited = _replaced(header, rng.choice(subtrees), rng.choice(_JUNK))
        path.write_bytes(join_file(edited, section))
        outcomes[_load_outcome(path)] += 1

    state_tree = header_state(header)
    state_subtrees = list(_subtrees(state_tree))
    for _ in range(300):
        edited_tree = _replaced(state_tree, rng.choice(state_subtrees), rng.choice(_JUNK))
        path.write_bytes(join_file(with_state(header, edited_tree), section))
        outcomes[_load_outcome(path)] += 1

    assert outcomes["refused"] > 500, f"seed {seed}: {outcomes}"
    assert outcomes["ok"] >= 100, f"seed {seed}: {outcomes}"


# --- what a file can make the reader allocate ------------------------------------------------------------


class _AllocationMeter:
    """Counts the bytes the reader asks for, tensor by tensor (see ``format._allocate``)."""

    def __init__(self) -> None:
        self.requested = 0
        self._real = checkpoint_format._allocate

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.requested += nbytes
        return self._real(nbytes)


def _in_memory_file(payload: bytes) -> int:
    fd = os.memfd_create("checkpoint-fuzz")
    os.write(fd, payload)
    return fd


def test_overlapping_tensors_cannot_make_the_reader_allocate_beyond_the_file() -> None:
    """1,000 entries over one 1 MiB region: the reader refuses the file before allocating anything."""
    region = 1 << 20
    names = [f"t{i}" for i in range(1000)]
    header: dict[str, Any] = {
        name: {"dtype": "U8", "shape": [region], "data_offsets": [0, region]} for name in names
    }
    tree = {"dict": [[name, {"tensor": name}] for name in names]}
    header["__metadata__"] = {"trainguard": "3", "state": json.dumps(tree)}
    payload = join_file(header, bytes(region))
    meter = _AllocationMeter()
    fd = _in_memory_file(payload)
    try:
        with (
            mock.patch.object(checkpoint_format, "_allocate", meter),
            pytest.raises(CheckpointError, match="overlaps"),
        ):
            checkpoint_format.read_state_fd(fd, "crafted")
    finally:
        os.close(fd)
    assert meter.requested == 0


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**65), 2**65)
    | st.floats(allow_nan=False)
    | st.text(max_size=6)
)
_JSON = st.recursive(
    _SCALARS,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)
_ENTRY = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "U8", "BOOL", "I64", "F64", "C64", "F16"]) | _SCALARS,
        "shape": st.lists(st.integers(-1, 40), max_size=3) | _JSON,
        "data_offsets": st.lists(st.integers(-8, 600), min_size=2, max_size=2) | _JSON,
    }
)


_ITEM_SIZES = {"F64": 8, "I64": 8, "F32": 4, "F16": 2, "U8": 1, "BOOL": 1}


@st.composite
def _near_valid_layouts(draw: st.DrawFn) -> tuple[dict[str, Any], int]:
    """Entries laid out back to back, then perhaps one shifted (a gap or an overlap), and a data size
    that is exact or a little off: most such files are valid, the rest are off by a little."""
    entries: dict[str, Any] = {}
    cursor = 0
    for index in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(sorted(_ITEM_SIZES)))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        nbytes = math.prod(shape) * _ITEM_SIZES[kind]
        entries[f"t{index}"] = {"dtype": kind, "shape": shape, "data_offsets": [cursor, cursor + nbytes]}
        cursor += nbytes
    shifted: bool = draw(st.booleans())
    if entries and shifted:
        entry = entries[draw(st.sampled_from(sorted(entries)))]
        shift = draw(st.integers(-cursor, cursor))
        entry["data_offsets"] = [offset + shift for offset in entry["data_offsets"]]
    return entries, max(0, cursor + draw(st.sampled_from([0, 0, 0, -1, 1, 8])))


def _outcome_of(entries: dict[str, Any], data_size: int, tree: Any, metadata_extra: dict[str, Any]) -> Any:
    """Build the file, read it while counting what it makes the reader allocate: (outcome, file size)."""
    if tree is None:  # the state names every entry: only the entries' own defects remain
        tree = {"dict": [[name, {"tensor": name}] for name in entries]}
    metadata = {"trainguard": "3", "state": json.dumps(tree), **metadata_extra}
    filler = bytes(range(256)) * (data_size // 256 + 1)  # exactly data_size bytes of data, whatever it is
    payload = join_file({**entries, "__metadata__": metadata}, filler[:data_size])
    meter = _AllocationMeter()
    fd = _in_memory_file(payload)
    try:
        with mock.patch.object(checkpoint_format, "_allocate", meter):
            try:
                outcome: Any = checkpoint_format.read_state_fd(fd, "fuzzed")
            except CheckpointError as exc:
                outcome = str(exc)
    finally:
        os.close(fd)
    assert isinstance(outcome, dict) or "fuzzed" in outcome
    assert meter.requested <= len(payload)
    return outcome


@settings(max_examples=300, deadline=None)
@given(layout=_near_valid_layouts())
def test_a_layout_loads_exactly_when_its_tensors_tile_the_data(layout: tuple[dict[str, Any], int]) -> None:
    entries, data_size = layout
    cursor, tiled = 0, True
    for begin, end in sorted(tuple(entry["data_offsets"]) for entry in entries.values()):
        tiled = tiled and begin == cursor
        cursor = end
    tiled = tiled and cursor == data_size
    outcome = _outcome_of(entries, data_size, None, {})
    assert isinstance(outcome, dict) == tiled, outcome
    if tiled:
        assert {name: list(outcome[name].shape) for name in entries} == {
            name: entry["shape"] for name, entry in entries.items()
        }


@settings(max_examples=400, deadline=None)
@given(
    entries=st.dictionaries(st.text(min_size=1, max_size=5), _ENTRY | _JSON, max_size=6),
    data_size=st.integers(0, 1000),
    tree=st.none() | _JSON,
    metadata_extra=st.dictionaries(st.sampled_from(["trainguard", "dtypes", "format"]), _SCALARS, max_size=2),
)
def test_any_header_gives_a_state_or_a_checkpoint_error_and_never_allocates_beyond_the_file(
    entries: dict[str, Any], data_size: int, tree: Any, metadata_extra: dict[str, Any]
) -> None:
    """Random headers (entries of any shape, state trees naming them or not, metadata of any kind)."""
    _outcome_of(entries, data_size, tree, metadata_extra)


class _Small(enum.IntEnum):
    ONE = 1


@given(
    st.lists(st.one_of(st.integers(), st.booleans(), st.just(_Small.ONE), st.just(np.int64(3))), max_size=30)
)
def test_a_sequence_of_integers_is_encoded_as_each_of_its_values_would_be(values: list[Any]) -> None:
    # Sequences of plain ints take a shortcut (Python's generator state, in every checkpoint): it must
    # write exactly the nodes the element-by-element path writes, bools and int subclasses included.
    encoder = checkpoint_format._Encoder([])
    for sequence, kind in ((values, "list"), (tuple(values), "tuple")):
        expected = {kind: [encoder.node(value, "state") for value in sequence]}
        encoded = encoder.node(sequence, "state")
        assert json.dumps(encoded) == json.dumps(expected)
        assert [type(v) for v in encoded[kind]] == [type(v) for v in expected[kind]]

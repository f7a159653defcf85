"""The checkpoint data file: a nested training state to bytes and back, with no I/O but reading a given fd.

A data file is a valid safetensors file, so standard tools open it (``safetensors.torch.load_file``),
and it holds no pickle: a file on a shared volume can at worst fail to parse, never run code::

    N        8 bytes, little-endian unsigned: the length of the header
    header   N bytes of strict UTF-8 JSON, starting with "{", padded with spaces so that the data
             starts at a multiple of 64 bytes
    data     every tensor's C-contiguous little-endian bytes, back to back: no gap, no overlap, and
             the file ends where the last tensor does

The header maps each tensor's name to ``{"dtype": "F32", "shape": [...], "data_offsets": [BEGIN, END]}``
(offsets relative to the start of the data) and holds ``"__metadata__"``, an object of strings:
``"format": "pt"``, ``"trainguard": "3"`` (FORMAT_VERSION) and ``"state"``, the JSON text of the state
tree. The tree's nodes: JSON ``null``, booleans, integers, finite floats and strings stand for
themselves; every other node is an object with one key: ``{"float": "nan" | "inf" | "-inf"}``,
``{"list": [NODE, ...]}``, ``{"tuple": [NODE, ...]}``, ``{"dict": [[KEY, NODE], ...]}`` (keys: scalars or
tuples of them, so integer keys such as the optimizer's parameter ids survive) and ``{"tensor": NAME}``.
Every tensor of the header is named by exactly one node.

Names are the tensor's path in the state, joined by "/" (``model/encoder.weight``,
``optimizer/state/0/exp_avg``); a path taken twice gets a suffix ``#2``, ``#3``... Tensors are laid out by
item size, largest first, so that each starts at a multiple of its own item size (the data starts at a
multiple of 64). ``complex128``, which safetensors has no name for, is stored as ``F64`` with a last
dimension of 2 (real, imaginary; what ``torch.view_as_real`` gives) and listed in the metadata's
``"dtypes"`` (the JSON text of ``{NAME: "complex128"}``), which the reader uses to restore it.

A tensor that is one rank's shard of a larger tensor (a DTensor of FSDP2 or HSDP) is stored as that
rank's local tensor and listed in the metadata's ``"shards"`` (the JSON text of ``{NAME: {"shape":
GLOBAL_SHAPE, "offset": OFFSET}}``): the global tensor's shape and where the local box starts in it. The
shards of one global tensor, in the files of several ranks, share its name.

A reader checks the whole layout before it allocates anything: the tensors must cover the data exactly,
so the bytes a file can make the reader allocate are bounded by the file's own size. Files of the
trainguard format 2 (magic ``\\x89trainguard checkpoint``) are refused naming that format.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer_sidecar.checkpoint.errors import CheckpointError
from trainer_sidecar.tensors.sharding import Box
from trainer_sidecar.tensors.tensorstate import Slot, unflatten

FORMAT_VERSION = 3
"""The version of the data files (in their metadata) and of the manifests that describe them."""

ALIGN = 64
"""The data section starts at a multiple of this many bytes from the start of the file."""

MAX_HEADER_BYTES = 100_000_000
"""The longest header a reader accepts (the limit the safetensors library sets itself)."""

LEGACY_MAGIC = b"\x89trainguard checkpoint\r\n\x1a\n"
"""The first bytes of a data file of trainguard's format 2, which this version refuses by name."""

MAX_GATHER = 512
"""Views per piece at most (one ``writev`` each; Linux allows 1024)."""

_CHUNK = 8 << 20  # large tensors are cut into pieces of this size (the unit of writing and hashing)
_COALESCE = 256 << 10  # tensors smaller than this are gathered (many to one writev)
_LENGTH = struct.Struct("<Q")
_MAX_DEPTH = 100  # nesting of the state: far beyond any real one, well within Python's recursion limit
_MAX_DIMS = 64
_MAX_ELEMENTS = 1 << 62
_METADATA = "__metadata__"

_SAFETENSORS_NAMES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "complex64": "C64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
}
# Dtypes safetensors cannot name, stored as another dtype with one more dimension of this length.
_STORED_AS = {"complex128": ("float64", 2)}

DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name in (*_SAFETENSORS_NAMES, *_STORED_AS)
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}
"""The tensor dtypes a checkpoint may hold, by their torch name."""
_NAME_OF_DTYPE = {dtype: name for name, dtype in DTYPES.items()}
_DTYPE_OF_SAFETENSORS = {
    _SAFETENSORS_NAMES[name]: dtype for name, dtype in DTYPES.items() if name in _SAFETENSORS_NAMES
}


# --- encoding ------------------------------------------------------------------------------------------


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (any dtype: viewed as uint8 first)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _as_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a plain contiguous CPU tensor; the store's host buffers already are (no copy)."""
    host = tensor.detach()
    if host.device.type != "cpu":
        host = host.cpu()
    if host.is_conj() or host.is_neg():
        host = host.resolve_conj().resolve_neg()
    return host.contiguous()


def _encode_float(value: float) -> Any:
    if math.isfinite(value):
        return value
    return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


def _name_part(key: Any) -> str:
    return key if isinstance(key, str) else str(key) if isinstance(key, int) else repr(key)


class _Encoder:
    """Turns a skeleton (``tensorstate.flatten``) into state nodes, naming every tensor by its path."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = tensors
        self.names: dict[int, str] = {}
        self._taken = {_METADATA}

    def _name(self, index: int, path: tuple[str, ...], where: str) -> str:
        dtype = self._tensors[index].dtype
        if dtype not in _NAME_OF_DTYPE:
            raise CheckpointError(f"{where}: tensors of dtype {dtype} cannot be stored")
        base = "/".join(path) or "tensor"
        name, copy = base, 1
        while name in self._taken:
            copy += 1
            name = f"{base}#{copy}"
        self._taken.add(name)
        self.names[index] = name
        return name

    def node(self, value: Any, where: str, path: tuple[str, ...] = (), depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise CheckpointError(f"{where}: nested deeper than {_MAX_DEPTH} levels")
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, str):
            return str(value)
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return _encode_float(float(value))
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":
            return self.node(value.item(), where, path, depth)
        if isinstance(value, Slot):
            return {"tensor": self._name(value.index, path, where)}
        if isinstance(value, dict):
            items = []
            for key, item in value.items():
                node = self.node(item, f"{where}[{key!r}]", (*path, _name_part(key)), depth + 1)
                items.append([self._key(key, where, depth + 1), node])
            return {"dict": items}
        if isinstance(value, (list, tuple)):
            kind = "tuple" if isinstance(value, tuple) else "list"
            if all(type(v) is int for v in value):
                # Python's generator state is 625 of them, in every checkpoint: each is its own node, as
                # below, without a path built for each (the writer thread holds the GIL while it encodes).
                return {kind: list(value)}
            nodes = [self.node(v, f"{where}[{i}]", (*path, str(i)), depth + 1) for i, v in enumerate(value)]
            return {kind: nodes}
        raise CheckpointError(
            f"{where}: a {type(value).__qualname__} cannot be stored in a checkpoint (only dicts, lists,"
            " tuples, str, int, float, bool, None and tensors)"
        )

    def _key(self, key: Any, where: str, depth: int) -> Any:
        if isinstance(key, tuple):
            return {"tuple": [self._key(item, where, depth + 1) for item in key]}
        if key is None or isinstance(key, (bool, str, int, float, np.generic)):
            return self.node(key, where, (), depth)
        raise CheckpointError(f"{where}: a dict key of type {type(key).__qualname__} cannot be stored")


@dataclass(frozen=True)
class Piece:
    """Consecutive bytes of a file, written with one ``writev``."""

    views: list[memoryview]

    @property
    def nbytes(self) -> int:
        """The bytes of all views."""
        return sum(view.nbytes for view in self.views)


@dataclass(frozen=True)
class Serialized:
    """A checkpoint file as a sequence of pieces of views: nothing but the header is copied."""

    pieces: list[Piece]
    size: int


def _entry(host: torch.Tensor, begin: int) -> dict[str, Any]:
    """The header entry of one tensor whose bytes start ``begin`` bytes into the data."""
    name = _NAME_OF_DTYPE[host.dtype]
    shape = list(host.shape)
    if name in _STORED_AS:
        name, last = _STORED_AS[name]
        shape.append(last)
    nbytes = host.numel() * host.element_size()
    return {"dtype": _SAFETENSORS_NAMES[name], "shape": shape, "data_offsets": [begin, begin + nbytes]}


def _header(
    node: Any,
    names: dict[int, str],
    hosts: Sequence[torch.Tensor],
    order: Sequence[int],
    boxes: Sequence[Box | None],
) -> bytes:
    """The length-prefixed, space-padded JSON header of a file holding ``hosts`` in ``order``."""
    metadata = {"format": "pt", "trainguard": str(FORMAT_VERSION), "state": _dumps(node)}
    shards = {
        names[i]: {"shape": list(box.global_shape), "offset": list(box.offset)}
        for i, box in enumerate(boxes)
        if box is not None
    }
    if shards:
        metadata["shards"] = _dumps(shards)
    stored_as = {
        names[i]: _NAME_OF_DTYPE[hosts[i].dtype]
        for i in order
        if _NAME_OF_DTYPE[hosts[i].dtype] in _STORED_AS
    }
    if stored_as:
        metadata["dtypes"] = _dumps(stored_as)
    header: dict[str, Any] = {_METADATA: metadata}
    cursor = 0
    for index in order:
        header[names[index]] = entry = _entry(hosts[index], cursor)
        cursor = entry["data_offsets"][1]
    text = _dumps(header).encode()
    text += b" " * (-(_LENGTH.size + len(text)) % ALIGN)
    return _LENGTH.pack(len(text)) + text


def _dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=False, separators=(",", ":"))


def _pieces(prefix: bytes, views: Sequence[memoryview]) -> list[Piece]:
    """The header and the tensors' bytes as pieces: small ones gathered, large ones cut into chunks."""
    pieces: list[Piece] = []
    gathered: list[memoryview] = [memoryview(prefix)]
    gathered_bytes = len(prefix)
    for view in views:
        if view.nbytes < _COALESCE:
            if view.nbytes:
                gathered.append(view)
                gathered_bytes += view.nbytes
            if gathered_bytes >= _CHUNK or len(gathered) >= MAX_GATHER:
                pieces.append(Piece(gathered))
                gathered, gathered_bytes = [], 0
        else:
            if gathered:
                pieces.append(Piece(gathered))
                gathered, gathered_bytes = [], 0
            pieces.extend(Piece([view[at : at + _CHUNK]]) for at in range(0, view.nbytes, _CHUNK))
    if gathered:
        pieces.append(Piece(gathered))
    return pieces


def serialize(
    skeleton: Any, tensors: Sequence[torch.Tensor], boxes: Sequence[Box | None] | None = None
) -> Serialized:
    """Lay out the file: header, then every tensor's bytes, largest item size first, back to back.

    The pieces are views of the tensors (no copy), which must not change until they are written. A
    state holding a value or dtype a checkpoint cannot store raises CheckpointError naming it.
    ``boxes``: for each tensor that is a shard of a larger one, where it lies in it (None for the others).
    """
    encoder = _Encoder(tensors)
    node = encoder.node(skeleton, "state")
    hosts = [_as_host(t) for t in tensors]
    boxes = list(boxes) if boxes is not None else [None] * len(hosts)
    for host, box in zip(hosts, boxes, strict=True):
        if box is not None and box.shape != tuple(host.shape):
            raise CheckpointError(f"a shard of shape {tuple(host.shape)} does not fill its box {box.shape}")
    order = sorted(range(len(hosts)), key=lambda i: -hosts[i].element_size())
    prefix = _header(node, encoder.names, hosts, order, boxes)
    pieces = _pieces(prefix, [_byte_view(hosts[i]) for i in order])
    size = len(prefix) + sum(h.numel() * h.element_size() for h in hosts)
    if sum(piece.nbytes for piece in pieces) != size:  # pragma: no cover - a layout bug, not bad input
        raise AssertionError("checkpoint layout does not add up")
    return Serialized(pieces, size)


# --- decoding ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor's bytes lie in a file (``offset`` from the start of the file) and what they are;
    ``box``: where it lies in the global tensor it is a shard of (None: it is a whole tensor)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    box: Box | None = None

    @property
    def extent(self) -> Box:
        """The part of the global tensor this one holds (all of it when it is not a shard)."""
        return self.box if self.box is not None else Box.whole(self.shape)


@dataclass(frozen=True)
class Layout:
    """A data file's parsed and checked header: its tensors cover its data exactly, no more, no less."""

    size: int
    data_start: int
    tensors: tuple[TensorSpec, ...]
    skeleton: dict[Any, Any]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate keys in an object")
    return result


def loads_strict(text: str | bytes) -> Any:
    """Strict JSON: no NaN/Infinity literals, no duplicate keys."""
    return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)


def _malformed(where: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: malformed checkpoint header: {what}")


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Decoder:
    """State nodes back to a skeleton with ``Slot``\\ s; every malformation is a CheckpointError."""

    def __init__(self, where: str, names: Sequence[str]) -> None:
        self._where = where
        self._index = {name: index for index, name in enumerate(names)}
        self.used: set[str] = set()

    def node(self, value: Any, depth: int = 0, *, key: bool = False) -> Any:
        if depth > _MAX_DEPTH:
            raise _malformed(self._where, f"state nested deeper than {_MAX_DEPTH} levels")
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            if not math.isfinite(value):  # a literal such as 1e999 (the writer never makes one)
                raise _malformed(self._where, f"float literal out of range ({value})")
            return value
        if not isinstance(value, dict) or len(value) != 1:
            raise _malformed(
                self._where, f"a node must be a scalar or an object with one key, not {_brief(value)}"
            )
        ((tag, body),) = value.items()
        if tag == "float":
            if body not in ("nan", "inf", "-inf"):
                raise _malformed(self._where, f"unknown float {_brief(body)}")
            return float(body)
        if tag in ("list", "tuple"):
            if not isinstance(body, list):
                raise _malformed(self._where, f"{tag} body is {_brief(body)}, not an array")
            if tag == "list" and key:
                raise _malformed(self._where, "a list cannot be a dict key")
            items = [self.node(item, depth + 1, key=key) for item in body]
            return tuple(items) if tag == "tuple" else items
        if tag == "dict" and not key:
            return self._dict(body, depth)
        if tag == "tensor" and not key:
            return self._tensor(body)
        raise _malformed(self._where, f"unknown node {_brief(tag)}" + (" as a dict key" if key else ""))

    def _dict(self, body: Any, depth: int) -> dict[Any, Any]:
        if not isinstance(body, list):
            raise _malformed(self._where, f"dict body is {_brief(body)}, not an array")
        result: dict[Any, Any] = {}
        for pair in body:
            if not isinstance(pair, list) or len(pair) != 2:
                raise _malformed(self._where, f"a dict item must be a [key, value] pair, not {_brief(pair)}")
            result[self.node(pair[0], depth + 1, key=True)] = self.node(pair[1], depth + 1)
        return result

    def _tensor(self, name: Any) -> Slot:
        if not isinstance(name, str) or name not in self._index:
            raise _malformed(self._where, f"the state names a tensor the header lacks: {_brief(name)}")
        if name in self.used:
            raise _malformed(self._where, f"the state names tensor {_brief(name)} twice (aliased)")
        self.used.add(name)
        return Slot(self._index[name])


def _stored_as(metadata: dict[str, Any], where: str) -> dict[str, torch.dtype]:
    """The tensors stored as another dtype (see the module's docstring), by name."""
    if "dtypes" not in metadata:
        return {}
    try:
        table = loads_strict(metadata["dtypes"])
    except (ValueError, RecursionError) as exc:
        raise _malformed(where, f"metadata dtypes: {exc}") from exc
    if not isinstance(table, dict) or not all(isinstance(v, str) and v in _STORED_AS for v in table.values()):
        raise _malformed(where, f"metadata dtypes {_brief(table)}")
    return {name: DTYPES[value] for name, value in table.items() if value in DTYPES}


def _tensor_spec(
    name: str, entry: Any, data_start: int, stored_as: dict[str, torch.dtype], where: str
) -> TensorSpec:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise _malformed(where, f"tensor {_brief(name)} is not a dtype/shape/data_offsets object")
    kind, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    dtype = _DTYPE_OF_SAFETENSORS.get(kind) if isinstance(kind, str) else None
    if dtype is None:
        raise _malformed(where, f"tensor {_brief(name)} has an unsupported dtype {_brief(kind)}")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_DIMS
        or not all(_is_int(d) and 0 <= d < _MAX_ELEMENTS for d in shape)
        or math.prod(d for d in shape if d) >= _MAX_ELEMENTS
    ):
        raise _malformed(where, f"tensor {_brief(name)} has an invalid shape {_brief(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise _malformed(where, f"tensor {_brief(name)} has invalid data_offsets {_brief(offsets)}")
    begin, end = offsets
    if not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
        raise _malformed(where, f"tensor {_brief(name)}: bytes {begin}-{end} do not hold {kind} {shape}")
    if name in stored_as:
        real = stored_as[name]
        if not shape or shape[-1] * dtype.itemsize != real.itemsize:
            raise _malformed(where, f"tensor {_brief(name)} cannot hold {real} as {kind} {shape}")
        dtype, shape = real, shape[:-1]
    return TensorSpec(name, dtype, tuple(shape), data_start + begin, end - begin)


def _shard_box(name: str, entry: Any, local: tuple[int, ...], where: str) -> Box:
    """The box of a shard's metadata entry, checked against the local tensor's shape."""
    if not isinstance(entry, dict) or set(entry) != {"shape", "offset"}:
        raise _malformed(where, f"shard {_brief(name)} is not a shape/offset object")
    shape, offset = entry["shape"], entry["offset"]
    valid = (
        isinstance(shape, list)
        and isinstance(offset, list)
        and len(shape) == len(offset) == len(local)
        and all(_is_int(d) and 0 <= d < _MAX_ELEMENTS for d in shape)
        and all(_is_int(o) and o >= 0 for o in offset)
        and all(o + n <= d for o, n, d in zip(offset, local, shape, strict=True))
    )
    if not valid:
        raise _malformed(
            where, f"shard {_brief(name)}: a {list(local)} box at {_brief(offset)} is not in {_brief(shape)}"
        )
    return Box(tuple(shape), tuple(offset), local)


def _with_shards(specs: list[TensorSpec], metadata: dict[str, Any], where: str) -> list[TensorSpec]:
    """``specs`` with the boxes of the metadata's ``"shards"`` (see the module's docstring)."""
    if "shards" not in metadata:
        return specs
    try:
        table = loads_strict(metadata["shards"])
    except (ValueError, RecursionError) as exc:
        raise _malformed(where, f"metadata shards: {exc}") from exc
    by_name = {spec.name: spec for spec in specs}
    if not isinstance(table, dict) or not set(table) <= set(by_name):
        raise _malformed(where, "metadata shards must map tensors of the file to their boxes")
    return [
        replace(spec, box=_shard_box(spec.name, table[spec.name], spec.shape, where))
        if spec.name in table
        else spec
        for spec in specs
    ]


def _check_coverage(specs: list[TensorSpec], data_start: int, size: int, where: str) -> None:
    """The tensors must tile the data section exactly: no gap, no overlap, nothing beyond the file."""
    cursor = data_start
    for spec in sorted(specs, key=lambda s: (s.offset, s.nbytes)):
        if spec.offset != cursor:
            what = "overlaps another" if spec.offset < cursor else "leaves a gap before it"
            raise _malformed(
                where, f"tensor {_brief(spec.name)} {what} (bytes from {spec.offset - data_start})"
            )
        cursor += spec.nbytes
    if cursor != size:
        what = "truncated" if cursor > size else "has trailing bytes"
        raise CheckpointError(f"{where}: {what} ({size} bytes, its header says {cursor})")


def _metadata(header: dict[str, Any], where: str) -> dict[str, Any]:
    metadata = header.pop(_METADATA, None)
    if not isinstance(metadata, dict) or "trainguard" not in metadata:
        raise CheckpointError(
            f"{where}: a safetensors file, but not a trainguard checkpoint (no trainguard metadata)"
        )
    if not all(isinstance(value, str) for value in metadata.values()):
        raise _malformed(where, "metadata values must be strings")
    if metadata["trainguard"] != str(FORMAT_VERSION):
        raise CheckpointError(
            f"{where}: trainguard checkpoint format {_brief(metadata['trainguard'])}"
            f" (this version reads format {FORMAT_VERSION})"
        )
    if "state" not in metadata:
        raise _malformed(where, "no state in the metadata")
    return metadata


def parse_header(raw: bytes, size: int, where: str) -> Layout:
    """Check a data file's header (``raw``: the bytes after the 8-byte length) against the file's ``size``.

    Pure: every defect raises CheckpointError naming ``where``; nothing is allocated beyond the header's
    own parse, and a returned layout's tensors cover the data section exactly.
    """
    if not raw.startswith(b"{"):
        raise _malformed(where, "the header is not a JSON object")
    try:
        header = loads_strict(raw.decode("utf-8"))
        metadata = _metadata(header, where) if isinstance(header, dict) else None
        state = loads_strict(metadata["state"]) if metadata is not None else None
    except (ValueError, RecursionError) as exc:
        raise _malformed(where, str(exc)) from exc
    if metadata is None:
        raise _malformed(where, "the header is not a JSON object")
    data_start = _LENGTH.size + len(raw)
    stored_as = _stored_as(metadata, where)
    specs = [_tensor_spec(name, entry, data_start, stored_as, where) for name, entry in header.items()]
    specs = _with_shards(specs, metadata, where)
    _check_coverage(specs, data_start, size, where)
    decoder = _Decoder(where, [spec.name for spec in specs])
    skeleton = decoder.node(state)
    if not isinstance(skeleton, dict):
        kind = "a tensor" if isinstance(skeleton, Slot) else type(skeleton).__name__
        raise CheckpointError(f"{where}: not a trainguard checkpoint (top level is {kind})")
    if len(decoder.used) != len(specs):
        unused = sorted({spec.name for spec in specs} - decoder.used)
        raise _malformed(where, f"tensors no state refers to: {_brief(unused)}")
    return Layout(size, data_start, tuple(specs), skeleton)


def pread_exact(fd: int, view: memoryview, offset: int, where: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; CheckpointError naming ``where`` if the file ends first."""
    while view.nbytes:
        count = os.preadv(fd, [view], offset)
        if count <= 0:
            raise CheckpointError(f"{where}: ended while reading (was it changed during the load?)")
        view = view[count:]
        offset += count


def read_layout(fd: int, where: str) -> Layout:
    """Read and check the header of the data file open at ``fd`` (see ``parse_header``)."""
    if sys.byteorder != "little":  # pragma: no cover - no big-endian machine in CI
        raise CheckpointError(f"{where}: little-endian tensor data cannot be loaded on this big-endian host")
    size = os.fstat(fd).st_size
    first = os.pread(fd, len(LEGACY_MAGIC), 0)
    if first == LEGACY_MAGIC:
        raise CheckpointError(
            f"{where}: a trainguard format 2 checkpoint; this version reads format {FORMAT_VERSION}"
            " (safetensors) only"
        )
    if len(first) < _LENGTH.size:
        raise CheckpointError(f"{where}: not a trainguard checkpoint (truncated: {size} bytes)")
    (length,) = _LENGTH.unpack(first[: _LENGTH.size])
    if length > min(size - _LENGTH.size, MAX_HEADER_BYTES):
        raise CheckpointError(
            f"{where}: not a trainguard checkpoint (a {length}-byte header in a {size}-byte file)"
        )
    raw = bytearray(length)
    pread_exact(fd, memoryview(raw), _LENGTH.size, where)
    return parse_header(bytes(raw), size, where)


def _allocate(nbytes: int) -> torch.Tensor:
    """The buffer one tensor is read into (one place, so tests can count what a file makes us allocate)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def read_tensors(fd: int, layout: Layout, where: str) -> dict[str, Any]:
    """The state of a checked layout, its tensors read from ``fd`` into independent contiguous CPU tensors."""
    tensors: list[torch.Tensor] = []
    for spec in layout.tensors:
        raw = _allocate(spec.nbytes)
        if spec.nbytes:
            pread_exact(fd, raw.numpy().data, spec.offset, where)
        if spec.dtype == torch.bool:
            raw.clamp_(max=1)  # any non-zero byte is True; a bool tensor must hold only 0 and 1
        tensors.append(raw.view(spec.dtype).reshape(spec.shape))
    state: dict[str, Any] = unflatten(layout.skeleton, tensors)
    return state


def read_state_fd(fd: int, where: str) -> dict[str, Any]:
    """Read the data file open at ``fd`` (a regular file) into a nested state; see ``read_state``."""
    try:
        return read_tensors(fd, read_layout(fd, where), where)
    except CheckpointError:
        raise
    except (OSError, ValueError, TypeError, OverflowError, RecursionError, RuntimeError) as exc:
        raise CheckpointError(f"{where}: cannot be loaded: {type(exc).__name__}: {exc}") from exc


def read_state(path: Path) -> dict[str, Any]:
    """Read a checkpoint data file into a nested state of independent, contiguous CPU tensors.

    Only data is ever interpreted (JSON and raw tensor bytes), so no file can run code. Anything that
    is not a well-formed checkpoint, or not a regular file, raises CheckpointError naming ``path``, and
    nothing is allocated beyond the file's own size.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be opened: {exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path}: not a regular file")
        return read_state_fd(fd, str(path))
    finally:
        os.close(fd)

"""trainguard's checkpoint data format 2, kept only as the baseline of ``bench/checkpoint.py``.

The product reads and writes format 3 (a safetensors file, see ``trainer_sidecar/checkpoint/format.py``)
and refuses format 2. This is the format 2 encoder and decoder as they were, so the benchmark can time
both formats side by side through the same writer: a magic, a version, a JSON header listing each
tensor's dtype, shape, offset and length, and each tensor's raw bytes at a 64-byte aligned offset.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer_sidecar.checkpoint.errors import CheckpointError
from trainer_sidecar.checkpoint.format import Piece, Serialized
from trainer_sidecar.tensors.tensorstate import Slot, unflatten

FORMAT_VERSION = 2
"""The version of the data files and of the manifests that describe them."""

MAGIC = b"\x89trainguard checkpoint\r\n\x1a\n"
"""The first bytes of every checkpoint data file (the high byte and line endings catch text mangling)."""

ALIGN = 64
"""Every tensor's bytes start at a multiple of this many bytes from the start of the file."""

_CHUNK = 8 << 20  # large tensors are cut into pieces of this size (the unit of writing and hashing)
_COALESCE = 256 << 10  # tensors smaller than this are gathered (many to one writev)
_MAX_GATHER = 512
_ZEROS = memoryview(bytes(ALIGN))
_PREAMBLE = struct.Struct("<IQ")  # version, header length
_PREFIX_LEN = len(MAGIC) + _PREAMBLE.size
_MAX_DEPTH = 100  # nesting of the state: far beyond any real one, well within Python's recursion limit
_MAX_DIMS = 64
_MAX_ELEMENTS = 1 << 62

_DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "complex128",
    "complex64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)
DTYPES: dict[str, torch.dtype] = {
    name: dtype for name in _DTYPE_NAMES if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}
"""The tensor dtypes a checkpoint may hold, by the name the header uses."""
_NAME_OF_DTYPE = {dtype: name for name, dtype in DTYPES.items()}


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


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


class _Encoder:
    """Turns a skeleton (``tensorstate.flatten``) into header nodes, checking every tensor's dtype."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = tensors

    def node(self, value: Any, where: str, depth: int = 0) -> Any:
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
            return self.node(value.item(), where, depth)
        if isinstance(value, Slot):
            dtype = self._tensors[value.index].dtype
            if dtype not in _NAME_OF_DTYPE:
                raise CheckpointError(f"{where}: tensors of dtype {dtype} cannot be stored")
            return {"tensor": value.index}
        if isinstance(value, dict):
            return {
                "dict": [
                    [self._key(key, where, depth + 1), self.node(item, f"{where}[{key!r}]", depth + 1)]
                    for key, item in value.items()
                ]
            }
        if isinstance(value, (list, tuple)):
            kind = "tuple" if isinstance(value, tuple) else "list"
            return {kind: [self.node(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]}
        raise CheckpointError(
            f"{where}: a {type(value).__qualname__} cannot be stored in a checkpoint (only dicts, lists,"
            " tuples, str, int, float, bool, None and tensors)"
        )

    def _key(self, key: Any, where: str, depth: int) -> Any:
        if isinstance(key, tuple):
            return {"tuple": [self._key(item, where, depth + 1) for item in key]}
        if key is None or isinstance(key, (bool, str, int, float, np.generic)):
            return self.node(key, where, depth)
        raise CheckpointError(f"{where}: a dict key of type {type(key).__qualname__} cannot be stored")


def serialize(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Serialized:
    """Lay out the file: header, then every tensor's bytes at an aligned offset.

    The pieces are views of the tensors (no copy), which must not change until they are written. Small
    tensors and the padding between them are gathered into shared pieces, so that a state of many
    small tensors is still written in few system calls; large tensors are cut into ``_CHUNK`` pieces.
    """
    node = _Encoder(tensors).node(skeleton, "state")
    hosts = [_as_host(t) for t in tensors]
    specs: list[dict[str, Any]] = []
    cursor = 0
    for host in hosts:
        cursor = _align(cursor)
        nbytes = host.numel() * host.element_size()
        specs.append(
            {
                "dtype": _NAME_OF_DTYPE[host.dtype],
                "shape": list(host.shape),
                "offset": cursor,
                "nbytes": nbytes,
            }
        )
        cursor += nbytes
    header = json.dumps(
        {"byteorder": "little", "data_bytes": cursor, "tensors": specs, "state": node},
        allow_nan=False,
        separators=(",", ":"),
    ).encode()
    prefix = MAGIC + _PREAMBLE.pack(FORMAT_VERSION, len(header)) + header
    prefix += bytes(_align(len(prefix)) - len(prefix))

    pieces: list[Piece] = []
    gathered: list[memoryview] = [memoryview(prefix)]
    gathered_bytes = len(prefix)

    def flush() -> None:
        nonlocal gathered, gathered_bytes
        if gathered:
            pieces.append(Piece(gathered))
            gathered, gathered_bytes = [], 0

    position = 0
    for host, spec in zip(hosts, specs, strict=True):
        if spec["offset"] > position:
            gathered.append(_ZEROS[: spec["offset"] - position])
            gathered_bytes += spec["offset"] - position
        view = _byte_view(host)
        if view.nbytes < _COALESCE:
            if view.nbytes:
                gathered.append(view)
                gathered_bytes += view.nbytes
            if gathered_bytes >= _CHUNK or len(gathered) >= _MAX_GATHER:
                flush()
        else:
            flush()
            pieces.extend(Piece([view[at : at + _CHUNK]]) for at in range(0, view.nbytes, _CHUNK))
        position = spec["offset"] + spec["nbytes"]
    flush()
    size = len(prefix) + cursor
    if sum(piece.nbytes for piece in pieces) != size:  # pragma: no cover - a layout bug, not bad input
        raise AssertionError("checkpoint layout does not add up")
    return Serialized(pieces, size)


# --- decoding ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


class _Decoder:
    """Header nodes back to a skeleton with ``Slot``\\ s; every malformation is a CheckpointError."""

    def __init__(self, path: Path, tensor_count: int) -> None:
        self._path = path
        self._count = tensor_count

    def node(self, value: Any, depth: int = 0, *, key: bool = False) -> Any:
        if depth > _MAX_DEPTH:
            raise _malformed(self._path, f"state nested deeper than {_MAX_DEPTH} levels")
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            if not math.isfinite(value):  # a literal such as 1e999 (the writer never makes one)
                raise _malformed(self._path, f"float literal out of range ({value})")
            return value
        if not isinstance(value, dict) or len(value) != 1:
            raise _malformed(
                self._path, f"a node must be a scalar or an object with one key, not {_brief(value)}"
            )
        ((tag, body),) = value.items()
        if tag == "float":
            if body not in ("nan", "inf", "-inf"):
                raise _malformed(self._path, f"unknown float {_brief(body)}")
            return float(body)
        if tag in ("list", "tuple"):
            if not isinstance(body, list):
                raise _malformed(self._path, f"{tag} body is {_brief(body)}, not an array")
            if tag == "list" and key:
                raise _malformed(self._path, "a list cannot be a dict key")
            items = [self.node(item, depth + 1, key=key) for item in body]
            return tuple(items) if tag == "tuple" else items
        if tag == "dict" and not key:
            if not isinstance(body, list):
                raise _malformed(self._path, f"dict body is {_brief(body)}, not an array")
            result: dict[Any, Any] = {}
            for pair in body:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise _malformed(
                        self._path, f"a dict item must be a [key, value] pair, not {_brief(pair)}"
                    )
                result[self.node(pair[0], depth + 1, key=True)] = self.node(pair[1], depth + 1)
            return result
        if tag == "tensor" and not key:
            if not _is_int(body) or not 0 <= body < self._count:
                raise _malformed(
                    self._path, f"invalid tensor reference {_brief(body)} ({self._count} tensors)"
                )
            return Slot(body)
        raise _malformed(self._path, f"unknown node {_brief(tag)}" + (" as a dict key" if key else ""))

    def tensor(self, entry: Any, index: int, data_bytes: int) -> _TensorSpec:
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "offset", "nbytes"}:
            raise _malformed(self._path, f"tensor {index} is not a dtype/shape/offset/nbytes object")
        name, shape, offset, nbytes = entry["dtype"], entry["shape"], entry["offset"], entry["nbytes"]
        dtype = DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise _malformed(self._path, f"tensor {index} has an unsupported dtype {_brief(name)}")
        if (
            not isinstance(shape, list)
            or len(shape) > _MAX_DIMS
            or not all(_is_int(d) and 0 <= d < _MAX_ELEMENTS for d in shape)
            or math.prod(d for d in shape if d) >= _MAX_ELEMENTS
        ):
            raise _malformed(self._path, f"tensor {index} has an invalid shape {_brief(shape)}")
        if not _is_int(offset) or not _is_int(nbytes) or offset < 0 or nbytes < 0 or offset % ALIGN:
            raise _malformed(self._path, f"tensor {index} has an invalid offset or length")
        if offset + nbytes > data_bytes:
            raise _malformed(
                self._path,
                f"tensor {index} spans bytes {offset}-{offset + nbytes} of a {data_bytes}-byte data section",
            )
        if math.prod(shape) * dtype.itemsize != nbytes:
            raise _malformed(
                self._path, f"tensor {index}: {nbytes} bytes do not hold a {dtype} tensor of shape {shape}"
            )
        return _TensorSpec(dtype, tuple(shape), offset, nbytes)


def _malformed(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: malformed checkpoint header: {what}")


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _read_exact(fd: int, view: memoryview, offset: int, path: Path) -> None:
    while view.nbytes:
        count = os.preadv(fd, [view], offset)
        if count <= 0:
            raise CheckpointError(f"{path}: ended while reading (was it changed during the load?)")
        view = view[count:]
        offset += count


def read_state(path: Path) -> dict[str, Any]:
    """Read a checkpoint data file into a nested state of independent, contiguous CPU tensors.

    Only data is ever interpreted (JSON and raw tensor bytes), so no file can run code. Anything that
    is not a well-formed checkpoint raises CheckpointError naming ``path``, and nothing is allocated
    beyond what the file's size can hold.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be opened: {exc}") from exc
    try:
        return _read_open(fd, path)
    except CheckpointError:
        raise
    except (OSError, ValueError, TypeError, OverflowError, RecursionError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: cannot be loaded: {type(exc).__name__}: {exc}") from exc
    finally:
        os.close(fd)


def _read_open(fd: int, path: Path) -> dict[str, Any]:
    size = os.fstat(fd).st_size
    prefix = os.pread(fd, _PREFIX_LEN, 0)
    if prefix[: len(MAGIC)] != MAGIC[: len(prefix)]:
        raise CheckpointError(f"{path}: not a trainguard checkpoint (it does not start with the magic bytes)")
    if len(prefix) < _PREFIX_LEN:
        raise CheckpointError(f"{path}: truncated ({size} bytes)")
    version, header_len = _PREAMBLE.unpack(prefix[len(MAGIC) :])
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unknown checkpoint format {version} (this reads {FORMAT_VERSION})")
    if header_len > size - _PREFIX_LEN:
        raise CheckpointError(f"{path}: truncated (a {header_len}-byte header in a {size}-byte file)")
    raw = bytearray(header_len)
    _read_exact(fd, memoryview(raw), _PREFIX_LEN, path)
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: malformed checkpoint header: {exc}") from exc
    if not isinstance(header, dict) or not {"byteorder", "data_bytes", "tensors", "state"} <= set(header):
        raise _malformed(path, "not an object with byteorder, data_bytes, tensors and state")
    if header["byteorder"] != "little":
        raise _malformed(path, f"byte order {_brief(header['byteorder'])}")
    if sys.byteorder != "little":  # pragma: no cover - no big-endian machine in CI
        raise CheckpointError(f"{path}: little-endian tensor data cannot be loaded on this big-endian host")
    data_bytes, entries = header["data_bytes"], header["tensors"]
    if not _is_int(data_bytes) or data_bytes < 0 or not isinstance(entries, list):
        raise _malformed(path, "data_bytes or tensors invalid")
    data_start = _align(_PREFIX_LEN + header_len)
    if data_start + data_bytes != size:
        what = "truncated" if data_start + data_bytes > size else "has trailing bytes"
        raise CheckpointError(f"{path}: {what} ({size} bytes, its header says {data_start + data_bytes})")
    decoder = _Decoder(path, len(entries))
    specs = [decoder.tensor(entry, index, data_bytes) for index, entry in enumerate(entries)]
    skeleton = decoder.node(header["state"])
    if not isinstance(skeleton, dict):
        kind = "a tensor" if isinstance(skeleton, Slot) else type(skeleton).__name__
        raise CheckpointError(f"{path}: not a trainguard checkpoint (top level is {kind})")

    tensors: list[torch.Tensor] = []
    for index, spec in enumerate(specs):
        raw_tensor = torch.empty(spec.nbytes, dtype=torch.uint8)
        if spec.nbytes:
            _read_exact(fd, raw_tensor.numpy().data, data_start + spec.offset, path)
        if spec.dtype == torch.bool and bool((raw_tensor > 1).any()):
            raise CheckpointError(f"{path}: bool tensor {index} holds bytes other than 0 and 1")
        tensors.append(raw_tensor.view(spec.dtype).reshape(spec.shape))
    state: dict[str, Any] = unflatten(skeleton, tensors)
    return state

"""The clean-checkpoint store on the shared volume.

Layout under the checkpoint directory::

    step-0000002000/
        rank-0.pt        model, optimizer, scheduler, scaler, guardian counters, RNG and data position
        rank-0.json      manifest: step, time, world size, and each file's size and SHA-256
        rank-1.pt        (other ranks) RNG and data position only; the model is replicated under DDP
        rank-1.json

A checkpoint is *complete* when every rank's manifest exists, and *valid* for a rank when the files
that rank loads (rank 0's and its own) match their manifests. Every file is written as temp file,
fsync, rename, directory fsync; the manifest last, so a manifest never describes a half-written file.
Only complete checkpoints count towards ``keep_clean``; the newest complete one is never deleted, and
nothing is ever overwritten: a step that already has a valid checkpoint is not written again.

The ``rank-R.pt`` files are "trainguard checkpoint v2" files, not ``torch.save`` archives: no pickle is
written or read anywhere, so a file on a shared volume can at worst fail to parse. All integers are
little-endian::

    MAGIC         26 bytes  b"\\x89trainguard checkpoint\\r\\n\\x1a\\n"
    version       uint32    2 (FORMAT_VERSION)
    header_len    uint64
    header        header_len bytes of strict UTF-8 JSON (no NaN/Infinity literals)
    zero padding  up to data_start, the first multiple of 64 at or after the end of the header
    data          data_bytes bytes: each tensor's raw bytes at data_start + its offset (a multiple of
                  64), zero padding between; the file ends at data_start + data_bytes

The header is ``{"byteorder": "little", "data_bytes": N, "tensors": [...], "state": NODE}``. Each tensor
is ``{"dtype": NAME, "shape": [...], "offset": O, "nbytes": B}`` (a dtype from an allow-list, by name;
``B`` = elements x item size; C-contiguous bytes in little-endian order). The state is a tree of nodes:
JSON ``null``, booleans, integers, finite floats and strings stand for themselves; every other node is
an object with one key: ``{"float": "nan" | "inf" | "-inf"}``, ``{"list": [NODE, ...]}``,
``{"tuple": [NODE, ...]}``, ``{"dict": [[KEY, NODE], ...]}`` (keys: scalars or tuples of them, so
integer keys such as the optimizer's parameter ids survive) and ``{"tensor": INDEX}``.

Old (format 1, ``torch.save``) checkpoints are reported as an unknown format and skipped, never loaded.

A save copies the state into reusable host buffers (``save_async``: the only part the training loop
waits for); then a writer thread writes the header and the buffers' bytes to the temp file while a
hashing thread computes the file's SHA-256 from the same buffers; then fsync, rename, directory
fsync, manifest. Rank 0's pruning of old checkpoints runs
afterwards in a janitor thread, so ``wait`` returns as soon as the new checkpoint is durable.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import struct
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer_sidecar.status import CheckpointRef
from trainer_sidecar.tensorstate import HostBuffers, Slot, flatten, unflatten

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""The version of the data files and of the manifests that describe them."""

MAGIC = b"\x89trainguard checkpoint\r\n\x1a\n"
"""The first bytes of every checkpoint data file (the high byte and line endings catch text mangling)."""

ALIGN = 64
"""Every tensor's bytes start at a multiple of this many bytes from the start of the file."""

_STEP_PREFIX = "step-"
_CHUNK = 8 << 20  # the unit of writing, hashing (and cancelling): large enough to amortise a syscall
_COALESCE = 256 << 10  # tensors smaller than this are gathered (many to one writev)
_MAX_GATHER = 512  # views per writev (Linux allows 1024)
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


class CheckpointError(RuntimeError):
    """The checkpoint directory or a checkpoint in it cannot be used; the message names the path."""


@dataclass(frozen=True)
class Verdict:
    """Whether one checkpoint can be loaded by one rank, and if not, why."""

    step: int
    valid: bool
    reason: str = ""


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint at ``step`` (zero-padded so names sort by step)."""
    return f"{_STEP_PREFIX}{step:010d}"


def fsync_dir(path: Path) -> None:
    """Make a rename or creation inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_bytes(path: Path, payload: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in large chunks into one reused buffer."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(view):
            digest.update(view[:count])
    return digest.hexdigest()


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


@dataclass(frozen=True)
class _Piece:
    """Consecutive bytes of a file, written with one ``writev``."""

    views: list[memoryview]

    @property
    def nbytes(self) -> int:
        return sum(view.nbytes for view in self.views)


@dataclass(frozen=True)
class _Serialized:
    """A checkpoint file as a sequence of pieces of views: nothing but the header is copied."""

    pieces: list[_Piece]
    size: int


def _serialize(skeleton: Any, tensors: Sequence[torch.Tensor]) -> _Serialized:
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

    pieces: list[_Piece] = []
    gathered: list[memoryview] = [memoryview(prefix)]
    gathered_bytes = len(prefix)

    def flush() -> None:
        nonlocal gathered, gathered_bytes
        if gathered:
            pieces.append(_Piece(gathered))
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
            pieces.extend(_Piece([view[at : at + _CHUNK]]) for at in range(0, view.nbytes, _CHUNK))
        position = spec["offset"] + spec["nbytes"]
    flush()
    size = len(prefix) + cursor
    if sum(piece.nbytes for piece in pieces) != size:  # pragma: no cover - a layout bug, not bad input
        raise AssertionError("checkpoint layout does not add up")
    return _Serialized(pieces, size)


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


# --- writing -------------------------------------------------------------------------------------------


def _write_all(fd: int, views: Sequence[memoryview]) -> None:
    """Write ``views`` back to back at the file position (one ``writev``, looping over short writes)."""
    pending = [view for view in views if view.nbytes]
    first = 0
    while first < len(pending):
        written = os.writev(fd, pending[first : first + _MAX_GATHER])
        if written <= 0:
            raise OSError(f"writev wrote {written} bytes")
        while written and written >= pending[first].nbytes:
            written -= pending[first].nbytes
            first += 1
        if written:
            pending[first] = pending[first][written:]


class _Hasher:
    """SHA-256 of a file's pieces: in a thread of its own beside the writer, or inline afterwards.

    ``hashlib`` releases the GIL while it hashes a large buffer, and the kernel copy of ``writev``
    runs without it too, so on two cores the two passes over the same bytes overlap.
    """

    def __init__(self, pieces: Sequence[_Piece], *, threaded: bool) -> None:
        self._pieces = pieces
        self._digest = hashlib.sha256()
        self._cancelled = threading.Event()
        self._error: BaseException | None = None
        self._thread = (
            threading.Thread(target=self._run, name="trainguard-hash", daemon=True) if threaded else None
        )
        if self._thread is not None:
            self._thread.start()

    def _run(self) -> None:
        try:
            for piece in self._pieces:
                if self._cancelled.is_set():
                    return
                for view in piece.views:
                    self._digest.update(view)
        except BaseException as exc:  # handed to hexdigest()'s caller
            self._error = exc

    def hexdigest(self) -> str:
        """The digest of all pieces (waits for the hashing thread, or hashes now)."""
        if self._thread is None:
            self._run()
        else:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._digest.hexdigest()

    def cancel(self) -> None:
        """Stop hashing after the current piece and wait for the thread."""
        self._cancelled.set()
        if self._thread is not None:
            self._thread.join()


def _default_parallel_hash() -> bool:
    try:
        return len(os.sched_getaffinity(0)) > 1
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return (os.cpu_count() or 1) > 1


class CheckpointStore:
    """Writes, verifies, finds and prunes clean checkpoints for one rank of a job.

    A save runs in a writer thread (with a hashing thread beside it when ``parallel_hash``; by default
    when this process may use more than one CPU). Rank 0 prunes old checkpoints in a janitor thread once
    a new one is durable, so ``wait`` does not include the deletion; ``close`` does.
    """

    def __init__(
        self,
        root: Path,
        *,
        rank: int = 0,
        world_size: int = 1,
        keep_clean: int = 3,
        parallel_hash: bool | None = None,
    ) -> None:
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.keep_clean = keep_clean
        self.parallel_hash = _default_parallel_hash() if parallel_hash is None else parallel_hash
        self._check_directory()
        self._buffers = HostBuffers()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-ckpt")
        self._janitor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-prune")
        self._inflight: Future[CheckpointRef | None] | None = None
        self._lock = threading.Lock()
        self.last_clean: CheckpointRef | None = None
        # Steps being written and being deleted, so that pruning never removes a step while it is written.
        self._dirs = threading.Condition()
        self._writing: set[int] = set()
        self._deleting: set[int] = set()
        self._prune_lock = threading.Lock()
        self._prune_queued = False
        self._prune_future: Future[None] | None = None

    # -- start-up checks ------------------------------------------------------------------------------
    def _check_directory(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"checkpoint directory {self.root} cannot be created: {exc}") from exc
        if not self.root.is_dir():
            raise CheckpointError(f"checkpoint directory {self.root} is not a directory")
        probe = self.root / f".write-probe-{os.getpid()}-{self.rank}"
        try:
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise CheckpointError(f"checkpoint directory {self.root} is not writable: {exc}") from exc

    # -- saving ---------------------------------------------------------------------------------------
    def save_async(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Capture ``state`` into host memory now and write it in the background.

        The caller waits only for the copy (and for a previous save still in flight, whose buffers this
        one reuses: a second save never corrupts the first). Errors, including a state holding values a
        checkpoint cannot store, surface on the next ``wait`` as CheckpointError.
        """
        self.wait()
        skeleton, tensors = flatten(state)
        self._buffers.capture(tensors)
        self._inflight = self._executor.submit(self._write, step, skeleton, self._buffers.tensors, dict(meta))

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> CheckpointRef | None:
        """Save and wait until the checkpoint is durable; returns the clean checkpoint written (or kept).

        Pruning may still be running afterwards (see ``wait_for_pruning``).
        """
        self.save_async(step, state, meta)
        return self.wait()

    def wait(self) -> CheckpointRef | None:
        """Block until the save in flight (if any) is durable; re-raise its error as CheckpointError."""
        future, self._inflight = self._inflight, None
        if future is None:
            return None
        try:
            return future.result()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"writing a checkpoint under {self.root} failed: {exc}") from exc

    def wait_for_pruning(self) -> None:
        """Block until the pruning scheduled by completed saves has run (errors are only logged).

        A save still in flight schedules its pruning when it completes: call ``wait`` first.
        """
        with self._dirs:
            future = self._prune_future
        if future is not None:
            future.result()

    @property
    def busy(self) -> bool:
        """Whether a background write is still running."""
        return self._inflight is not None and not self._inflight.done()

    def _write(
        self,
        step: int,
        skeleton: Any,
        tensors: list[torch.Tensor],
        meta: dict[str, Any],
    ) -> CheckpointRef | None:
        with self._dirs:
            self._writing.add(step)
            self._dirs.wait_for(lambda: step not in self._deleting)
        try:
            ref, written = self._write_step(step, skeleton, tensors, meta)
        finally:
            with self._dirs:
                self._writing.discard(step)
        if written and self.rank == 0:
            self._schedule_prune()  # once the step is no longer registered as being written
        return ref

    def _write_step(
        self,
        step: int,
        skeleton: Any,
        tensors: list[torch.Tensor],
        meta: dict[str, Any],
    ) -> tuple[CheckpointRef | None, bool]:
        """Write one step's files unless it already holds a valid one: (its reference, whether written)."""
        directory = self.root / step_dir_name(step)
        data_path = directory / f"rank-{self.rank}.pt"
        manifest_path = directory / f"rank-{self.rank}.json"
        try:
            serialized = _serialize(skeleton, tensors)
        except CheckpointError as exc:
            raise CheckpointError(f"{data_path} not written: {exc}") from exc
        directory.mkdir(exist_ok=True)
        if manifest_path.exists():
            verdict = self._verify_files(step, [self.rank])
            if verdict.valid:
                log.info(
                    "checkpoint %s already holds a valid rank-%d file; not overwritten", directory, self.rank
                )
                return self._record_clean(step, directory), False
            log.warning(
                "checkpoint %s is invalid (%s); moving it aside and writing anew", directory, verdict.reason
            )
            stamp = int(time.time())
            for path in (data_path, manifest_path):
                if path.exists():
                    path.rename(path.with_name(f"{path.name}.corrupt-{stamp}"))

        sha256 = self._write_data(data_path, serialized)
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
            "time": time.time(),
            "files": {data_path.name: {"size": serialized.size, "sha256": sha256}},
            **meta,
        }
        _atomic_write_bytes(manifest_path, json.dumps(manifest, indent=1).encode())
        return self._record_clean(step, directory), True

    def _write_data(self, data_path: Path, serialized: _Serialized) -> str:
        """Temp file, write (hashing beside it), fsync, rename, directory fsync; returns the SHA-256."""
        tmp = data_path.with_name(f".{data_path.name}.tmp-{os.getpid()}")
        hasher = _Hasher(serialized.pieces, threaded=self.parallel_hash)
        renamed = False
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
            try:
                for piece in serialized.pieces:
                    _write_all(fd, piece.views)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, data_path)
            renamed = True
            fsync_dir(data_path.parent)
            return hasher.hexdigest()
        except BaseException:
            hasher.cancel()
            if not renamed:
                tmp.unlink(missing_ok=True)
            raise

    def reference(self, step: int) -> CheckpointRef | None:
        """The checkpoint at ``step`` as rank 0's manifest describes it (None without a manifest)."""
        directory = self.root / step_dir_name(step)
        manifest = self._read_manifest(directory / "rank-0.json")
        if manifest is None:
            return None
        entry = manifest["files"].get("rank-0.pt", {})
        return CheckpointRef(
            step=step, path=str(directory), sha256=str(entry.get("sha256", "")), time=float(manifest["time"])
        )

    def _record_clean(self, step: int, directory: Path) -> CheckpointRef | None:
        ref = self.reference(step)
        if ref is None:
            return None
        with self._lock:
            if self.last_clean is None or ref.step >= self.last_clean.step:
                self.last_clean = ref
        return ref

    # -- reading --------------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps that have a checkpoint directory (complete or not), oldest first."""
        found = []
        for child in self.root.iterdir():
            if child.is_dir() and child.name.startswith(_STEP_PREFIX):
                try:
                    found.append(int(child.name[len(_STEP_PREFIX) :]))
                except ValueError:
                    continue
        return sorted(found)

    @staticmethod
    def _read_manifest(path: Path) -> dict[str, Any] | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or not isinstance(data.get("files"), dict) or "time" not in data:
            return None
        return data

    def is_complete(self, step: int) -> bool:
        """Every rank of the writing job has published its manifest (no hashing: cheap)."""
        directory = self.root / step_dir_name(step)
        first = self._read_manifest(directory / "rank-0.json")
        if first is None:
            return False
        world = int(first.get("world_size", 1))
        return all((directory / f"rank-{r}.json").exists() for r in range(world))

    def _verify_files(self, step: int, ranks: Iterable[int]) -> Verdict:
        directory = self.root / step_dir_name(step)
        for rank in ranks:
            manifest_path = directory / f"rank-{rank}.json"
            manifest = self._read_manifest(manifest_path)
            if manifest is None:
                return Verdict(step, False, f"{manifest_path}: missing or not a valid manifest")
            if manifest.get("format") != FORMAT_VERSION:
                return Verdict(
                    step,
                    False,
                    f"{manifest_path}: unknown checkpoint format {manifest.get('format')!r}"
                    f" (this version reads format {FORMAT_VERSION} only)",
                )
            if manifest.get("step") != step:
                return Verdict(step, False, f"{manifest_path}: describes step {manifest.get('step')!r}")
            for name, entry in manifest["files"].items():
                path = directory / name
                try:
                    size = path.stat().st_size
                except OSError:
                    return Verdict(step, False, f"{path}: missing")
                if size != entry.get("size"):
                    return Verdict(
                        step, False, f"{path}: truncated ({size} bytes, manifest says {entry.get('size')})"
                    )
                if file_sha256(path) != entry.get("sha256"):
                    return Verdict(step, False, f"{path}: SHA-256 does not match the manifest (corrupted)")
        return Verdict(step, True)

    def verify(self, step: int) -> Verdict:
        """Check the files this rank would load at ``step``: complete, sizes and SHA-256 as manifested.

        A rank beyond the writing job's world size loads rank 0's files only (see ``load``).
        """
        directory = self.root / step_dir_name(step)
        first_path = directory / "rank-0.json"
        first = self._read_manifest(first_path)
        if first is None:
            return Verdict(step, False, f"{first_path}: missing or not a valid manifest")
        if not self.is_complete(step):
            return Verdict(step, False, f"{directory}: incomplete (a rank's manifest is missing)")
        writers = int(first.get("world_size", 1))
        return self._verify_files(step, sorted({0, self.rank} if self.rank < writers else {0}))

    def newest_valid(self, at_most: int | None = None) -> int | None:
        """The newest step at or below ``at_most`` this rank can load; logs why newer ones were skipped."""
        for step in reversed(self.steps()):
            if at_most is not None and step > at_most:
                continue
            verdict = self.verify(step)
            if verdict.valid:
                return step
            log.warning("skipping checkpoint at step %d: %s", step, verdict.reason)
        return None

    def load(self, step: int) -> dict[str, Any]:
        """Load this rank's view of a checkpoint: rank 0's model state merged with this rank's own state.

        The files are parsed as data only (see ``read_state``): a file on a shared volume can never run
        code here; one that is not a well-formed checkpoint raises CheckpointError naming it.
        """
        directory = self.root / step_dir_name(step)
        state = read_state(directory / "rank-0.pt")
        if self.rank != 0:
            own = directory / f"rank-{self.rank}.pt"
            if own.exists():
                state.update(read_state(own))
            else:
                log.warning(
                    "%s has no state for rank %d; RNG and data position start afresh", directory, self.rank
                )
                state.pop("rng", None)
        self._record_clean(step, directory)
        return state

    # -- retention ------------------------------------------------------------------------------------
    def prune(self) -> list[int]:
        """Delete checkpoints beyond the newest ``keep_clean`` complete ones. Returns the deleted steps.

        Incomplete directories are deleted only when older than the oldest kept complete checkpoint
        (a newer incomplete one may still be being written by another rank), and never a step this
        store is writing. Rank 0 runs this in the background after each save; it can also be called.
        """
        with self._prune_lock:
            steps = self.steps()
            complete = [s for s in steps if self.is_complete(s)]
            if not complete:
                return []
            kept = complete[-self.keep_clean :]
            oldest_kept = kept[0]
            deleted = []
            for step in steps:
                if step in kept or step >= oldest_kept:
                    continue
                with self._dirs:
                    if step in self._writing:
                        continue
                    self._deleting.add(step)
                try:
                    shutil.rmtree(self.root / step_dir_name(step), ignore_errors=True)
                finally:
                    with self._dirs:
                        self._deleting.discard(step)
                        self._dirs.notify_all()
                deleted.append(step)
            if deleted:
                log.info("pruned checkpoints at steps %s (keeping %s)", deleted, kept)
            return deleted

    def _schedule_prune(self) -> None:
        with self._dirs:
            if self._prune_queued:
                return  # the one queued has not started yet: it will see this checkpoint
            self._prune_queued = True
            self._prune_future = self._janitor.submit(self._prune_in_background)

    def _prune_in_background(self) -> None:
        with self._dirs:
            self._prune_queued = False
        try:
            self.prune()
        except Exception:
            log.exception("pruning old checkpoints under %s failed (retried after the next save)", self.root)

    def close(self) -> None:
        """Finish the write in flight and the pruning after it, and stop the background threads."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._janitor.shutdown(wait=True)

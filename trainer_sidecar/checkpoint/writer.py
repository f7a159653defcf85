"""Writing checkpoint files durably: a writer thread and a hashing thread over the same bytes.

A data file is written to a new temp file (a random name, created exclusively, never through a link),
fsynced, renamed into place and its directory fsynced, while a second thread computes its SHA-256 from
the same in-memory pieces (``hashlib`` releases the GIL while it hashes a large buffer, and the kernel
copy of ``writev`` runs without it too, so on two cores the two passes overlap). Small files
(manifests, epoch claims) are written the same way, without the second thread.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence

from trainer_sidecar.checkpoint import fs
from trainer_sidecar.checkpoint.format import MAX_GATHER, Piece, Serialized


def write_all(fd: int, views: Sequence[memoryview]) -> None:
    """Write ``views`` back to back at the file position (one ``writev``, looping over short writes)."""
    pending = [view for view in views if view.nbytes]
    first = 0
    while first < len(pending):
        written = os.writev(fd, pending[first : first + MAX_GATHER])
        if written <= 0:
            raise OSError(f"writev wrote {written} bytes")
        while written and written >= pending[first].nbytes:
            written -= pending[first].nbytes
            first += 1
        if written:
            pending[first] = pending[first][written:]


class Hasher:
    """SHA-256 of a file's pieces: in a thread of its own beside the writer, or inline afterwards.

    ``hashlib`` releases the GIL while it hashes a large buffer, and the kernel copy of ``writev``
    runs without it too, so on two cores the two passes over the same bytes overlap.
    """

    def __init__(self, pieces: Sequence[Piece], *, threaded: bool) -> None:
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


def default_parallel_hash() -> bool:
    """Whether this process may use more than one CPU (then hashing runs beside the write)."""
    try:
        return len(os.sched_getaffinity(0)) > 1
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return (os.cpu_count() or 1) > 1


def write_file(dir_fd: int, name: str, serialized: Serialized, *, parallel_hash: bool) -> str:
    """Write ``name`` in ``dir_fd``: temp file, write (hashing beside it), fsync, rename, directory fsync.

    Returns the file's SHA-256. On any error the temp file is removed and the hashing thread stopped.
    """
    hasher = Hasher(serialized.pieces, threaded=parallel_hash)
    tmp: str | None = None
    try:
        fd, tmp = fs.create_temp(dir_fd, name)
        try:
            for piece in serialized.pieces:
                write_all(fd, piece.views)
            os.fsync(fd)
        finally:
            os.close(fd)
        fs.rename(dir_fd, tmp, name)
        tmp = None
        fs.fsync(dir_fd)
        return hasher.hexdigest()
    except BaseException:
        hasher.cancel()
        if tmp is not None:
            fs.unlink(dir_fd, tmp)
        raise


def write_small(dir_fd: int, name: str, payload: bytes) -> None:
    """Write ``name`` in ``dir_fd`` through a temp file, fsync and rename, then fsync the directory."""
    fd, tmp = fs.create_temp(dir_fd, name)
    try:
        try:
            write_all(fd, [memoryview(payload)])
            os.fsync(fd)
        finally:
            os.close(fd)
        fs.rename(dir_fd, tmp, name)
    except BaseException:
        fs.unlink(dir_fd, tmp)
        raise
    fs.fsync(dir_fd)

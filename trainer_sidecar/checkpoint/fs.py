"""File access inside a checkpoint directory that is not trusted.

Anyone who can write to the shared volume can plant a symbolic link, a FIFO or a device where a file is
expected. So every name below the checkpoint root is opened relative to a directory file descriptor,
never through a link (``O_NOFOLLOW``), files are created only if they do not exist (``O_EXCL``), reads
open with ``O_NONBLOCK`` (a FIFO never blocks) and accept regular files only, and every read is bounded
by a size known beforehand. The root itself is configuration and is opened as given.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainer_sidecar.checkpoint.errors import CheckpointError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CHUNK = 8 << 20  # the unit of reading when hashing a file


@contextmanager
def open_root(path: Path) -> Iterator[int]:
    """The checkpoint root as a directory descriptor (closed on exit); CheckpointError naming it if absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise CheckpointError(f"checkpoint directory {path} cannot be opened: {exc.strerror}") from exc
    try:
        yield fd
    finally:
        os.close(fd)


def _refusal(exc: OSError, where: str) -> CheckpointError:
    if exc.errno == errno.ELOOP:
        return CheckpointError(f"{where}: is a symbolic link (never followed)")
    if exc.errno == errno.ENOTDIR:
        return CheckpointError(f"{where}: not a directory")
    if exc.errno == errno.ENOENT:
        return CheckpointError(f"{where}: missing")
    return CheckpointError(f"{where}: cannot be opened: {exc.strerror}")


@contextmanager
def open_dir(parent_fd: int, name: str, where: str) -> Iterator[int]:
    """Directory ``name`` inside ``parent_fd``, never through a link; CheckpointError naming ``where``."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno == errno.ENOTDIR and kind(parent_fd, name) == "link":  # O_DIRECTORY checks first
            raise CheckpointError(f"{where}: is a symbolic link (never followed)") from exc
        raise _refusal(exc, where) from exc
    try:
        yield fd
    finally:
        os.close(fd)


def make_dir(parent_fd: int, name: str) -> bool:
    """Create directory ``name`` (never through a link); False if something of that name exists."""
    try:
        os.mkdir(name, 0o777, dir_fd=parent_fd)
    except FileExistsError:
        return False
    return True


def kind(dir_fd: int, name: str) -> str | None:
    """What ``name`` is, without following it: "file", "dir", "link", "other", or None if absent."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    return "link" if stat.S_ISLNK(mode) else "other"


def entries(dir_fd: int) -> list[tuple[str, str]]:
    """The names in a directory with their kind ("file", "dir", "link" or "other"), links not followed."""
    found = []
    with os.scandir(dir_fd) as scan:
        for entry in scan:
            if entry.is_symlink():
                found.append((entry.name, "link"))
            elif entry.is_dir(follow_symlinks=False):
                found.append((entry.name, "dir"))
            else:
                found.append((entry.name, "file" if entry.is_file(follow_symlinks=False) else "other"))
    return found


def open_regular(dir_fd: int, name: str, where: str) -> tuple[int, int]:
    """(descriptor, size) of the regular file ``name``: never a link, FIFO or device (CheckpointError)."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _refusal(exc, where) from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise CheckpointError(f"{where}: not a regular file")
    return fd, info.st_size


def read_small(dir_fd: int, name: str, limit: int, where: str) -> bytes:
    """The content of the regular file ``name``, refused if larger than ``limit`` bytes."""
    fd, size = open_regular(dir_fd, name, where)
    try:
        if size > limit:
            raise CheckpointError(f"{where}: {size} bytes, more than the {limit} a file of its kind may hold")
        data = os.pread(fd, limit + 1, 0)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise CheckpointError(f"{where}: grew beyond {limit} bytes while read")
    return data


def sha256_fd(fd: int, size: int, where: str) -> str:
    """SHA-256 of the first ``size`` bytes of ``fd``; CheckpointError if the file holds fewer."""
    digest = hashlib.sha256()
    buffer = bytearray(min(_CHUNK, max(size, 1)))
    view = memoryview(buffer)
    offset = 0
    while offset < size:
        count = os.preadv(fd, [view[: min(len(view), size - offset)]], offset)
        if count <= 0:
            raise CheckpointError(f"{where}: ended after {offset} bytes while hashing (manifest says {size})")
        digest.update(view[:count])
        offset += count
    return digest.hexdigest()


def create_temp(dir_fd: int, stem: str) -> tuple[int, str]:
    """A new, empty file for writing beside ``stem`` (a random name, created exclusively): (fd, name)."""
    for _ in range(16):
        name = f".{stem}.tmp-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            return os.open(name, _CREATE_FLAGS, 0o666, dir_fd=dir_fd), name
        except FileExistsError:
            continue
    raise CheckpointError(f"no free temporary name beside {stem}")  # pragma: no cover - 2^48 names


def unlink(dir_fd: int, name: str) -> None:
    """Remove the file ``name`` if it is there (a link is removed, never followed)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


def rename(dir_fd: int, source: str, target: str) -> None:
    """Rename ``source`` to ``target`` in one directory (replacing ``target``; links are not followed)."""
    os.replace(source, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def move_aside(dir_fd: int, name: str, why: str) -> str:
    """Rename ``name`` to a hidden name saying ``why`` (never following it); returns the new name."""
    aside = f".{name}.{why}-{secrets.token_hex(4)}"
    os.rename(name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return aside


def remove_tree(dir_fd: int, name: str) -> None:
    """Delete the directory ``name`` and everything in it, without following any link (errors ignored)."""
    shutil.rmtree(name, ignore_errors=True, dir_fd=dir_fd)


def fsync(fd: int) -> None:
    """Make ``fd``'s data, or a directory's entries, durable."""
    os.fsync(fd)


@contextmanager
def open_side_dir(root: Path, name: str | None = None) -> Iterator[int]:
    """The checkpoint root, or its subfolder ``name`` (created if absent, never through a link), open.

    For the small files kept beside the checkpoints (dead letters, fault ledgers, forensic bundles):
    CheckpointError when the root cannot be opened or ``name`` is a link or not a directory."""
    with open_root(root) as root_fd:
        if name is None:
            yield root_fd
            return
        make_dir(root_fd, name)
        with open_dir(root_fd, name, str(root / name)) as fd:
            yield fd


def read_if_present(dir_fd: int, name: str, limit: int, where: str) -> bytes | None:
    """The content of the regular file ``name`` (at most ``limit`` bytes), or None if there is none.

    CheckpointError if it is a link, a FIFO, a device or larger than ``limit``."""
    if kind(dir_fd, name) is None:
        return None
    return read_small(dir_fd, name, limit, where)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def replace_file(dir_fd: int, name: str, data: bytes) -> None:
    """Durably replace ``name`` with ``data``: a fresh temp file, fsync, rename, directory fsync.

    A link planted at ``name`` is replaced, never written through."""
    fd, temp = create_temp(dir_fd, name)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    except BaseException:
        unlink(dir_fd, temp)
        raise
    finally:
        os.close(fd)
    rename(dir_fd, temp, name)
    fsync(dir_fd)


def append_durably(dir_fd: int, name: str, data: bytes, where: str) -> None:
    """Append ``data`` to the regular file ``name`` (created if absent) and fsync it.

    CheckpointError if ``name`` is a link, a FIFO or a device: nothing is written through it."""
    try:
        fd = os.open(name, _APPEND_FLAGS, 0o666, dir_fd=dir_fd)
    except OSError as exc:
        raise _refusal(exc, where) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{where}: not a regular file")
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)

"""Reading a small file a user or another process named, without trusting what is there.

A path given on a command line or written by another process may name a FIFO (opening it would wait for
a writer), a device (``/dev/zero`` never ends) or a file far larger than any valid one. ``read_small_file``
accepts regular files only and reads at most a known number of bytes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class FileRefused(OSError):
    """The file cannot be had; the message names it and says why."""


def _kind(mode: int) -> str:
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    remaining = limit
    while remaining > 0:
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_small_file(path: Path, limit: int, source: str) -> bytes:
    """The bytes of the regular file at ``path`` (links followed), at most ``limit`` of them.

    FileNotFoundError if it is absent; FileRefused, naming ``source``, if it is not a regular file (checked
    before opening where ``stat`` can tell, since opening a device may have effects, and again on what was
    opened, since the path may be swapped between), is larger than ``limit`` or cannot be read."""
    try:
        before = os.stat(path)
        if not stat.S_ISREG(before.st_mode):
            raise FileRefused(f"{source} is {_kind(before.st_mode)}, not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except (FileNotFoundError, FileRefused):
        raise
    except (OSError, ValueError) as exc:  # ValueError: a path with a NUL byte
        raise FileRefused(f"{source} cannot be read: {exc}") from exc
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise FileRefused(f"{source} is {_kind(opened.st_mode)}, not a regular file")
        if opened.st_size > limit:
            raise FileRefused(f"{source} is {opened.st_size} bytes, more than the {limit} allowed")
        data = _read_at_most(fd, limit + 1)
    except FileRefused:
        raise
    except OSError as exc:
        raise FileRefused(f"{source} cannot be read: {exc}") from exc
    finally:
        os.close(fd)
    if len(data) > limit:
        raise FileRefused(f"{source} is more than the {limit} bytes allowed")
    return data

"""Where ``trainguard run`` writes, and the lock that keeps two runs of one job apart.

Layout under the job's run root (``--run-dir``, default ``runs/<namespace>/<name>``):

    <run root>/volumes/<claimName>/     the checkpoint claim (``--checkpoint-root`` replaces volumes/)
    <run root>/<UTC time>/              one folder per run: attempt-N/rank-R/ status and termination
                                        message, logs/, summary.json
    <run root>/latest -> <UTC time>     the newest run

A run never reads or overwrites another run's files: each gets a new folder, created exclusively. Every
path is built from the given roots and names that are checked to be plain folder names, and is checked
after creation to lie inside its root (a symlink leading elsewhere is refused).

``CheckpointLock`` is an exclusive ``flock`` on a file in the checkpoint directory, taken before anything
starts and inherited by the workers, so it is held until the last process of the run's gang is gone: a
second run of the same job is refused while an old gang could still write.
It records the directory's device and inode (``identity``), which is what the runner marks its processes
with (see ``LocalRunner.run_marker``): a path can be re-pointed, the directory cannot.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

from trainguard.local.launch import RunRefused

LOCK_NAME = ".trainguard-run.lock"
LATEST = "latest"
_HOLDER_LIMIT = 4096


def plain_name(name: str, what: str) -> str:
    """``name`` if it is one plain folder name (no separator, not ``.`` or ``..``), else RunRefused."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise RunRefused(f"{what}: {name!r} is not a plain folder name")
    return name


def make_dir_inside(root: Path, path: Path, what: str, root_what: str | None = None) -> Path:
    """Create ``root`` and ``path`` and return ``path`` absolute; RunRefused if it resolves outside
    ``root``. ``what`` and ``root_what`` (default ``what``) name where each came from."""
    root = root.absolute()
    path = path.absolute()
    for folder, named in ((root, root_what or what), (path, what)):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunRefused(f"{named}: cannot create {folder}: {exc}") from exc
    real_root, real = root.resolve(), path.resolve()
    if not real.is_relative_to(real_root):
        raise RunRefused(f"{what}: {path} leads outside {root} (to {real}); refusing to write there")
    return path


def new_run_folder(run_root: Path) -> Path:
    """A new, empty folder for this run under ``run_root`` (named by UTC time), and ``latest`` at it."""
    run_root = make_dir_inside(run_root, run_root, "--run-dir")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for index in range(1000):
        name = stamp if index == 0 else f"{stamp}-{index}"
        try:
            (run_root / name).mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise RunRefused(f"--run-dir: cannot create a run folder in {run_root}: {exc}") from exc
        _point_latest(run_root, name)
        return run_root / name
    raise RunRefused(f"--run-dir: {run_root} already holds 1000 runs started at {stamp}")


def _point_latest(run_root: Path, name: str) -> None:
    temporary = run_root / f".{LATEST}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    try:
        temporary.symlink_to(name)
        os.replace(temporary, run_root / LATEST)  # atomic: never a moment without a link
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink()  # a "latest" that is a real folder stays; the run folder is what counts


class CheckpointLock:
    """An exclusive lock on one checkpoint directory for one ``trainguard run`` and its gang.

    ``acquire`` never blocks: when another run holds the lock it raises RunRefused naming that run
    (pid, host, since when). ``fd`` is handed to the workers (``pass_fds``) so that the lock is held
    until the last of them has exited, even when the runner itself was killed.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK_NAME
        self.fd = -1
        #: The locked directory itself, (device, inode), once acquired: what a path to it can no longer
        #: change (a re-pointed symlink, a remount), unlike the path.
        self.identity: tuple[int, int] | None = None

    def acquire(self, job: str) -> None:
        """Take the lock and record this run in the lock file (with the directory's device and inode);
        RunRefused if another run holds it. The lock file is opened in the very directory whose identity
        is recorded (relative to a descriptor of it), so the two cannot be different directories."""
        try:
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise RunRefused(f"checkpoint directory {self.directory}: cannot open it: {exc}") from exc
        try:
            fd = self._open_lock(dir_fd)
            directory = os.fstat(dir_fd)
        finally:
            os.close(dir_fd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise RunRefused(f"checkpoint directory {self.directory}: {self.path} is not a regular file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RunRefused(self._held_message(fd)) from None
            holder = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": time.time(),
                "job": job,
                "directory": {
                    "path": str(self.directory),
                    "device": directory.st_dev,
                    "inode": directory.st_ino,
                },
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.identity = (directory.st_dev, directory.st_ino)

    def _open_lock(self, dir_fd: int) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            return os.open(LOCK_NAME, flags, 0o644, dir_fd=dir_fd)
        except OSError as exc:
            raise RunRefused(f"checkpoint directory {self.directory}: cannot open the lock: {exc}") from exc

    def _held_message(self, fd: int) -> str:
        holder = _holder(os.pread(fd, _HOLDER_LIMIT, 0))
        where = f"checkpoint directory {self.directory} is in use by another trainguard run"
        if holder is None:
            return f"{where} (it has not said which yet); two runs must not write one job's checkpoints"
        pid, host, since = holder["pid"], holder["host"], holder["since"]
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
        text = f"{where}: pid {pid} on {host}, since {started} (job {holder['job']})"
        if host == socket.gethostname() and not _running(pid):
            text += f"; pid {pid} has exited, but processes of its gang still hold the lock"
        return text + "; two runs must not write one job's checkpoints"

    def release(self) -> None:
        """Let go of the lock (the workers' inherited copies keep it until they exit)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _holder(data: bytes) -> dict[str, Any] | None:
    try:
        holder = json.loads(data)
    except ValueError:
        return None
    if not isinstance(holder, dict):
        return None
    pid, since = holder.get("pid"), holder.get("since")
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(since, (int, float)):
        return None
    try:
        time.localtime(since)
    except (OverflowError, OSError, ValueError):
        return None
    host, job = str(holder.get("host"))[:253], str(holder.get("job"))[:200]
    return {"pid": pid, "host": host, "since": since, "job": job}


def _running(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

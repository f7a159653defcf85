"""Handing a restart to a warm spare: which commands can be, and the message that does it.

``trainguard run`` may keep, while an attempt trains, one pre-started interpreter per rank that has
already imported torch (``trainer_sidecar.guardian.spare``). On a restart it hands each spare what a cold
``python script.py`` would have had: the attempt's environment, argv and working directory, and the
descriptors a cold worker's standard output and error would have been (``SCM_RIGHTS``: two, even where
both are the same file, as the local runner's log is), in one message over a Unix socket. This module
is both sides' agreement; it is torch-free, so the local runner and the launcher can use it.

- ``plan_warm_start`` says whether a worker command can run in a spare: only a plain ``python SCRIPT
  ...`` or ``python -m MODULE ...`` of the very interpreter the spare runs (no interpreter options, no
  ``-c``, no launcher, no shell script); otherwise it says why not, and the runner starts cold.
- ``send_handoff`` / ``receive_handoff`` carry a ``Handoff``: a length-prefixed JSON object and, with its
  first bytes, the two descriptors that become the script's standard output and standard error.
- ``READY`` is the one byte a spare writes once its imports are done (so the runner can tell a warm
  spare from one still importing; a handoff to the latter still works, it only waits).
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

__all__ = [
    "READY",
    "SPARE_MODULE",
    "Handoff",
    "HandoffError",
    "RunMode",
    "WarmStart",
    "plan_warm_start",
    "receive_handoff",
    "said_ready",
    "send_handoff",
    "spare_argv",
]

#: The byte a spare writes when it is warm.
READY = b"R"
#: The module a warm spare runs (``trainer_sidecar.guardian.spare``), named, not imported: it imports torch.
SPARE_MODULE = "trainer_sidecar.guardian.spare"
_LENGTH = struct.Struct("!I")
#: A handoff is an environment, argv and a path: far below this, unless something is wrong.
MAX_HANDOFF_BYTES = 16 << 20


class HandoffError(Exception):
    """A handoff message that is missing, cut short, too large or malformed."""


class RunMode(StrEnum):
    """How the spare runs the worker: as ``python SCRIPT`` or as ``python -m MODULE``."""

    PATH = "path"
    MODULE = "module"


@dataclass(frozen=True)
class WarmStart:
    """A command a spare can run: ``mode`` and ``target`` (the script as given, or the module name), and
    the script's arguments after it."""

    mode: RunMode
    target: str
    args: tuple[str, ...]


def plan_warm_start(command: Sequence[str], executable: str) -> WarmStart | str:
    """``command`` (its program already resolved to an absolute path) as a spare of ``executable`` can run
    it, or the reason it cannot (the runner then starts the worker cold).

    Only the same interpreter (same file after resolving links) followed directly by a script or by
    ``-m MODULE`` qualifies: any interpreter option (``-u``, ``-X``, ``-O``, ``-c`` ...) changes how the
    interpreter starts, which a spare started earlier cannot take back.
    """
    if not command:
        return "the command is empty"
    program = command[0]
    if not _same_file(program, executable):
        return f"{program} is not the interpreter trainguard runs in ({executable})"
    rest = list(command[1:])
    if not rest:
        return "the command starts an interactive interpreter"
    first = rest[0]
    if first == "-m":
        if len(rest) < 2 or not rest[1] or rest[1].startswith("-"):
            return "-m is not followed by a module name"
        return WarmStart(RunMode.MODULE, rest[1], tuple(rest[2:]))
    if first.startswith("-"):
        return f"the interpreter option {first} is not supported by a warm start"
    return WarmStart(RunMode.PATH, first, tuple(rest[1:]))


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


@dataclass(frozen=True)
class Handoff:
    """What a spare needs to become a worker: the environment it replaces its own with, the working
    directory, and what to run with which arguments (``argv`` is the script's ``sys.argv`` as a cold
    interpreter would set it: the script as given, then its arguments)."""

    environment: dict[str, str]
    cwd: str
    mode: RunMode
    target: str
    argv: tuple[str, ...]

    def to_bytes(self) -> bytes:
        """The message's JSON body."""
        return json.dumps(
            {
                "environment": self.environment,
                "cwd": self.cwd,
                "mode": self.mode.value,
                "target": self.target,
                "argv": list(self.argv),
            }
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Handoff:
        """Parse a message body; HandoffError names what is wrong."""
        try:
            raw = json.loads(data)
            environment = raw["environment"]
            argv = raw["argv"]
            if not isinstance(environment, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in environment.items()
            ):
                raise HandoffError("handoff: environment must map strings to strings")
            if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
                raise HandoffError("handoff: argv must be a list of strings")
            if not isinstance(raw["cwd"], str) or not isinstance(raw["target"], str):
                raise HandoffError("handoff: cwd and target must be strings")
            return cls(environment, raw["cwd"], RunMode(raw["mode"]), raw["target"], tuple(argv))
        except (ValueError, KeyError, TypeError) as exc:
            raise HandoffError(f"handoff: malformed message ({exc})") from exc

    @classmethod
    def for_command(cls, plan: WarmStart, *, environment: dict[str, str], cwd: Path | None) -> Handoff:
        """The handoff of ``plan`` in ``cwd`` (None: the runner's own) with ``environment``."""
        directory = str(cwd if cwd is not None else Path.cwd())
        return cls(dict(environment), directory, plan.mode, plan.target, (plan.target, *plan.args))


def send_handoff(sock: socket.socket, handoff: Handoff, stdout_fd: int, stderr_fd: int) -> None:
    """Send ``handoff`` with ``stdout_fd`` and ``stderr_fd`` (the script's standard output and error; the
    same descriptor twice for one file) over ``sock``; OSError if the spare is gone."""
    body = handoff.to_bytes()
    data = _LENGTH.pack(len(body)) + body
    sent = socket.send_fds(sock, [data], [stdout_fd, stderr_fd])
    if sent < len(data):
        sock.sendall(data[sent:])


def receive_handoff(sock: socket.socket) -> tuple[Handoff, int, int] | None:
    """The handoff and the standard output and error descriptors it carried; None when the runner closed
    the socket without one (the spare is not needed). HandoffError for anything else than a whole message
    with two descriptors (those that came are closed)."""
    data, fds, _, _ = socket.recv_fds(sock, 64 * 1024, 4)
    if not data and not fds:
        return None
    if len(fds) != 2:
        for fd in fds:
            os.close(fd)
        raise HandoffError(f"handoff: expected two descriptors (standard output and error), got {len(fds)}")
    try:
        while len(data) < _LENGTH.size:
            data += _recv_some(sock)
        (length,) = _LENGTH.unpack(data[: _LENGTH.size])
        if length > MAX_HANDOFF_BYTES:
            raise HandoffError(f"handoff: {length} bytes is too large")
        body = data[_LENGTH.size :]
        while len(body) < length:
            body += _recv_some(sock)
        return Handoff.from_bytes(body[:length]), fds[0], fds[1]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _recv_some(sock: socket.socket) -> bytes:
    chunk = sock.recv(64 * 1024)
    if not chunk:
        raise HandoffError("handoff: the message was cut short")
    return chunk


def spare_argv(executable: str, channel_fd: int, plan: WarmStart) -> list[str]:
    """The command of a spare for ``plan`` run by ``executable``, told its end of the channel
    (``channel_fd``, passed to it open) and, for a script, to preload what the script imports."""
    preload = ["--preload-script", plan.target] if plan.mode is RunMode.PATH else []
    return [executable, "-m", SPARE_MODULE, "--channel", str(channel_fd), *preload]


def said_ready(channel: socket.socket) -> bool:
    """Whether the spare at the other end of ``channel`` has written ``READY`` (without waiting)."""
    if not select.select([channel], [], [], 0)[0]:
        return False
    try:
        return channel.recv(1) == READY
    except OSError:
        return False

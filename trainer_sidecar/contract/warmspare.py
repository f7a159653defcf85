"""One warm spare's life, as the local runner and the launcher both keep one: start, watch, hand off, drop.

A warm spare (``trainer_sidecar.guardian.spare``) is an interpreter that imports torch and waits on a Unix
socket to be handed the next attempt's rank (``trainer_sidecar.contract.handoff``). ``WarmSpare`` is the
keeper's end of it: the process and the socket. Who keeps it decides the rest: how the process is
started and registered for cleanup (``start`` is given a spawner), when a spare is due, what a handoff
carries, and whether a dropped spare is waited for (a keeper that reaps its own children, such as the
launcher, waits elsewhere). Torch-free: it names the spare's module, never imports it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Callable
from typing import Any

from trainer_sidecar.contract.handoff import Handoff, WarmStart, said_ready, send_handoff, spare_argv

__all__ = ["SpareSpawner", "WarmSpare"]

#: Starts a spare's process: given its argv and its end of the channel (a descriptor to pass it open),
#: returns the started process (registered for cleanup as its keeper registers its children).
SpareSpawner = Callable[[list[str], int], "subprocess.Popen[Any]"]


class WarmSpare:
    """A started warm spare: its process and the keeper's end of its channel.

    ``reaped_by_keeper``: the keeper reaps its children itself (``os.waitpid(-1, ...)``, as the launcher
    does) and sets ``proc.returncode`` when it does; the spare then never waits on its process (``alive``
    reads ``proc.returncode``), so that the keeper's reaping sees its exit.
    """

    def __init__(
        self, proc: subprocess.Popen[Any], channel: socket.socket, *, reaped_by_keeper: bool = False
    ) -> None:
        self.proc = proc
        self.channel = channel
        self.reaped_by_keeper = reaped_by_keeper
        self._warm = False

    @classmethod
    def start(
        cls, plan: WarmStart, executable: str, spawn: SpareSpawner, *, reaped_by_keeper: bool = False
    ) -> WarmSpare:
        """Start a spare of ``executable`` for ``plan`` through ``spawn``; whatever ``spawn`` raises
        propagates, with no socket left open."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = spawn(spare_argv(executable, theirs.fileno(), plan), theirs.fileno())
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(proc, ours, reaped_by_keeper=reaped_by_keeper)

    @property
    def pid(self) -> int:
        """The spare's process id (also its process group's: a spare is started in a session of its own)."""
        return self.proc.pid

    def alive(self) -> bool:
        """Whether the spare's process has not exited."""
        if self.reaped_by_keeper:
            return self.proc.returncode is None
        return self.proc.poll() is None

    def is_warm(self) -> bool:
        """Whether the spare has said it finished its imports (without waiting for it; once said, kept)."""
        self._warm = self._warm or said_ready(self.channel)
        return self._warm

    @property
    def warm(self) -> bool:
        """Whether the spare was last seen warm (``is_warm`` looks again)."""
        return self._warm

    def hand_off(self, handoff: Handoff, stdout_fd: int, stderr_fd: int) -> None:
        """Make the spare the worker ``handoff`` describes, ``stdout_fd`` and ``stderr_fd`` its standard
        output and error; the channel is closed either way. OSError if the spare cannot be told (gone)."""
        try:
            send_handoff(self.channel, handoff, stdout_fd, stderr_fd)
        finally:
            self.channel.close()

    def drop(self, *, wait: bool = False) -> None:
        """Close the channel and SIGKILL the spare's process group if it runs (it holds nothing: no
        checkpoint, no peer); with ``wait``, reap it too (never for a spare its keeper reaps)."""
        self.channel.close()
        if self.alive():  # not reaped yet: its pid cannot have been reused
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if wait and not self.reaped_by_keeper:
            self.proc.wait()

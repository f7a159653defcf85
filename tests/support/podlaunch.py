"""Start one container process of a pod, for the node agent (``tests/nodeagent.py``).

Run as ``python podlaunch.py SPEC.json``. The spec holds the pod's network namespace (a name under
``/run/netns``, made by the agent), its hostname, the bind mounts (volumes, the pod's own
``/etc/hosts`` and ``/etc/resolv.conf`` and the container's termination message file, as the kubelet
gives them), the working directory, the
environment and the argv. This process joins the pod's network namespace, makes a private mount and UTS
namespace of its own, mounts, sets the hostname, and then ``exec``s the argv: the container's main process
keeps this process's PID, so the agent signals it (and its process group) directly.

Standard library only: it starts once per container (and per exec probe), so it must start fast.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str, target: str, flags: int) -> None:
    _check(_libc.mount(source.encode(), target.encode(), None, flags, None), f"mount {source} on {target}")


def _bind(source: Path, target: Path, read_only: bool) -> None:
    if source.is_dir():
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.touch()
    _mount(str(source), str(target), MS_BIND | MS_REC)
    if read_only:
        _mount("none", str(target), MS_BIND | MS_REMOUNT | MS_RDONLY)


def enter(spec: dict[str, object]) -> None:
    """Join the pod's network namespace and set up this process's mounts and hostname, as in the spec."""
    netns = spec.get("netns")
    if netns:
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            _check(_libc.setns(fd, CLONE_NEWNET), f"setns {netns}")
        finally:
            os.close(fd)
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare")
    # Private: the mounts below stay in this container and never propagate back to the host.
    _mount("none", "/", MS_REC | MS_PRIVATE)
    mounts = spec.get("mounts", [])
    assert isinstance(mounts, list)
    for source, target, read_only, *optional in mounts:
        try:
            _bind(Path(source), Path(target), bool(read_only))
        except OSError as exc:
            if not (optional and optional[0]):
                raise
            print(f"podlaunch: {target} not mounted: {exc}", file=sys.stderr, flush=True)
    hostname = str(spec.get("hostname", "")).encode()
    if hostname:
        _check(_libc.sethostname(hostname, len(hostname)), "sethostname")


def main(argv: list[str]) -> int:
    """Enter the pod and exec the container's argv; exit 127/126 like a runtime when that fails."""
    spec = json.loads(Path(argv[1]).read_text())
    try:
        enter(spec)
        os.chdir(spec.get("cwd") or "/")
    except OSError as exc:
        print(f"podlaunch: {exc}", file=sys.stderr, flush=True)
        return 126
    command = [str(a) for a in spec["argv"]]
    env = {str(k): str(v) for k, v in spec["env"].items()}
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print(f"podlaunch: exec {command[0]!r}: {exc}", file=sys.stderr, flush=True)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv))

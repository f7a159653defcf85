"""Helpers for tests that run real worker processes (single or a torch.distributed gang)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.ports import free_port

WORKER = Path(__file__).parent / "workers" / "tiny_train.py"
#: A small transformer under FSDP2, HSDP, DDP or alone (tests/support/workers/fsdp_train.py).
FSDP_WORKER = Path(__file__).parent / "workers" / "fsdp_train.py"


def worker_env(
    ckpt: Path,
    *,
    rank: int = 0,
    world_size: int = 1,
    port: int | None = None,
    faults: str = "",
    settings: dict[str, Any] | None = None,
    status_file: Path | None = None,
) -> dict[str, str]:
    """The environment of one worker: checkpoint dir, settings, faults and torch.distributed variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["TRAINGUARD_CHECKPOINT_DIR"] = str(ckpt)
    env["TRAINGUARD_FAULTS"] = faults
    env["TRAINGUARD_SETTINGS"] = json.dumps(settings or {})
    if status_file is not None:
        env["TRAINGUARD_STATUS_FILE"] = str(status_file)
    if world_size > 1:
        assert port is not None
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    else:
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
    return env


def start_worker(args: list[str], env: dict[str, str], worker: Path = WORKER) -> subprocess.Popen[str]:
    """Start ``worker`` (tests/workers/tiny_train.py by default) with ``args``."""
    return subprocess.Popen(
        [sys.executable, str(worker), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, dict[str, Any] | None, str]:
    """Wait for a worker; returns (exit code, its JSON report or None, its stderr)."""
    out, err = proc.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return proc.returncode, (json.loads(lines[-1]) if lines else None), err


def run_gang(
    ckpt: Path,
    world_size: int,
    args: list[str],
    *,
    faults: str = "",
    settings: dict[str, Any] | None = None,
    worker: Path = WORKER,
) -> list[tuple[int, dict[str, Any] | None, str]]:
    """Run ``world_size`` workers of ``worker`` as one torch.distributed job and wait for all of them."""
    port = free_port()
    procs = [
        start_worker(
            args,
            worker_env(ckpt, rank=r, world_size=world_size, port=port, faults=faults, settings=settings),
            worker,
        )
        for r in range(world_size)
    ]
    try:
        return [finish(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def successful_reports(results: list[tuple[int, dict[str, Any] | None, str]]) -> list[dict[str, Any]]:
    """Assert every worker exited 0 with a report (else show its stderr); return the reports."""
    reports = []
    for code, report, err in results:
        assert code == 0, err[-3000:]
        assert report is not None, err[-3000:]
        reports.append(report)
    return reports


LIFECYCLE_WORKER = Path(__file__).parent / "workers" / "lifecycle.py"


def _state(pid: int) -> str | None:
    """A process's state letter from /proc (None: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def is_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie has already died)."""
    state = _state(pid)
    return state is not None and state not in ("Z", "X")


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def processes_mentioning(marker: str) -> list[int]:
    """Live processes (not this one) whose command line or environment contains ``marker``.

    Every process ``trainguard run`` starts for a job under a test's tmp_path names that path: the
    sidecars and the workers in their environment (even when orphaned).
    """
    needle = marker.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            text = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in text and is_running(int(entry.name)):
            found.append(int(entry.name))
    return found

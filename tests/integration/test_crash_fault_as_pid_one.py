"""The crash fault kills the worker even when the worker is PID 1, as in a container of a pod with no
init process: there the kernel drops a signal the process sends itself without a handler, SIGKILL
included, so the worker used to log the crash and train on."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_WORKER = r"""
import os
import sys
from pathlib import Path

import torch

from trainer_sidecar.guardian.faults import FaultInjector, parse_faults

print("pid", os.getpid(), flush=True)
injector = FaultInjector(parse_faults("crash@3"), 0, Path(sys.argv[1]))
for step in range(5):
    injector.loss_hook(torch.tensor(1.0), step)
print("survived the crash", flush=True)
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux's unshare is not installed")
def test_a_crash_fault_kills_a_worker_that_is_pid_one(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    # A new PID namespace (in a new user namespace, so no root is needed): the worker is its PID 1.
    result = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "--pid",
            "--fork",
            sys.executable,
            str(script),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # the clone's editable install finds the package (the repository's root would
        # shadow the standard library's `operator` with the operator's folder)
        timeout=120,
    )
    assert result.stdout.splitlines()[:1] == ["pid 1"], result.stdout + result.stderr
    assert "survived the crash" not in result.stdout, result.stdout + result.stderr
    assert result.returncode == 137, result.stdout + result.stderr  # as if SIGKILL had killed it

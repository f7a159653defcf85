"""A real child process saving ~24 MB checkpoints is SIGKILLed at random moments, and
after every kill the newest valid checkpoint must verify and load with exactly the state of its step.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest
import torch

from tests.support.checkpoints import (
    assert_same_state,
)
from tests.support.paths import REPO_ROOT
from trainer_sidecar.checkpoint import CheckpointStore

# --- SIGKILL during writes -----------------------------------------------------------------------------

# A "zygote": imports torch once, then forks a fresh worker process per run (so a restart costs
# milliseconds, not a torch import). The worker saves a checkpoint per step, forever, printing
# "saved N" after each save returned. The zygote is the worker's parent, so it kills and reaps it:
# a killed PID is never reused before the kill.
_ZYGOTE = r"""
import os
import signal
import sys
from pathlib import Path

import torch

from trainer_sidecar.checkpoint import CheckpointStore

root, numel, tensors, keep = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])


def say(text):
    os.write(1, (text + "\n").encode())


def state_for(step):
    model = {f"w{k}": torch.full((numel,), float(step) + k) for k in range(tensors)}
    return {"model": model, "step": step, "tag": f"step {step}"}


def work(start):
    torch.set_num_threads(1)
    store = CheckpointStore(root, keep_clean=keep)
    step = start
    while True:
        store.save(step, state_for(step), {"kill_test": True})
        say(f"saved {step}")
        step += 1


say("ready")
worker = None
while True:
    line = sys.stdin.readline()
    if not line:
        break
    command, *args = line.split()
    if command == "run":
        worker = os.fork()
        if worker == 0:
            try:
                work(int(args[0]))
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(3)
        say(f"pid {worker}")
    elif command == "kill":
        os.kill(worker, signal.SIGKILL)
        _, status = os.waitpid(worker, 0)
        worker = None
        say(f"exit {status}")
if worker is not None:
    os.kill(worker, signal.SIGKILL)
    os.waitpid(worker, 0)
"""

_NUMEL = 1_500_000  # 4 tensors of float32: 24 MB per checkpoint
_TENSORS = 4
_KEEP = 2
_KILLS = 24


class _Zygote:
    """Drives the zygote over its stdin and collects its (and its workers') stdout lines."""

    def __init__(self, script: Path, root: Path, stderr: IO[bytes]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(script), str(root), str(_NUMEL), str(_TENSORS), str(_KEEP)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=REPO_ROOT,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.last_saved: int | None = None
        self.saved_times: list[float] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            self.lines.put(raw.decode().strip())
        self.lines.put(None)

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{command}\n".encode())
        self.process.stdin.flush()

    def expect(self, prefix: str, timeout: float = 30.0) -> str:
        """The next line starting with ``prefix``, noting every "saved N" seen on the way."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line from the zygote within {timeout} s") from None
            if line is None:
                raise AssertionError(f"the zygote exited while waiting for {prefix!r}")
            if line.startswith("saved "):
                self.last_saved = int(line.split()[1])
                self.saved_times.append(time.monotonic())
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
            if line.startswith("exit "):
                raise AssertionError(f"the worker died on its own (wait status {line.split()[1]})")

    def close(self) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _expected_kill_state(step: int) -> dict[str, Any]:
    model = {f"w{k}": torch.full((_NUMEL,), float(step) + k) for k in range(_TENSORS)}
    return {"model": model, "step": step, "tag": f"step {step}"}


@pytest.mark.slow
def test_sigkill_at_random_moments_never_leaves_the_store_without_a_loadable_newest(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    root = tmp_path / "ckpt"
    script = tmp_path / "zygote.py"
    script.write_text(_ZYGOTE)
    stderr_path = tmp_path / "zygote.stderr"

    with open(stderr_path, "wb") as stderr:
        zygote = _Zygote(script, root, stderr)
        try:
            zygote.expect("ready", timeout=60)
            checker = CheckpointStore(root, keep_clean=_KEEP)
            start = 0
            period = 0.0
            mid_write_kills = 0
            newest_history: list[int] = []
            for kill in range(_KILLS):
                zygote.send(f"run {start}")
                zygote.expect("pid ")
                launched = time.monotonic()
                if kill == 0:
                    # Let the first checkpoint complete, and time a save to aim the kills at.
                    zygote.expect("saved ")
                    zygote.expect("saved ")
                    period = zygote.saved_times[-1] - zygote.saved_times[-2]
                    launched = time.monotonic()
                elif kill % 4 == 3:
                    # Every few runs, let one save of this run finish first: on a loaded machine a
                    # restart can take longer than the kill window, and the store must still be seen
                    # to make progress across restarts.
                    zygote.expect("saved ")
                    launched = time.monotonic()
                # Uniform over a few save periods from the (re)start: covers the store's start-up,
                # torch.save, fsync, the renames, the manifest and the pruning of old checkpoints.
                delay = rng.uniform(0, 2.5 * period)
                time.sleep(max(0.0, launched + delay - time.monotonic()))
                zygote.send("kill")
                status = int(zygote.expect("exit "))
                context = f"seed {seed}, kill {kill}, delay {delay:.3f} s (save period {period:.3f} s)"
                assert os.WIFSIGNALED(status), f"{context}: worker exited with {status}"
                assert os.WTERMSIG(status) == signal.SIGKILL, context

                newest = checker.newest_valid()
                assert newest is not None, f"{context}: no valid checkpoint left"
                assert zygote.last_saved is not None
                assert newest >= zygote.last_saved, f"{context}: saved {zygote.last_saved} is gone"
                verdict = checker.verify(newest)
                assert verdict.valid, f"{context}: {verdict.reason}"
                assert_same_state(checker.load(newest), _expected_kill_state(newest), f"step {newest}")
                newest_history.append(newest)

                leftovers = [p for p in root.rglob("*") if ".tmp-" in p.name]
                if any(step > newest for step in checker.steps()) or leftovers:
                    mid_write_kills += 1
                start = newest + 1

            # Kills must have hit writes in progress, not only the gaps between them.
            assert mid_write_kills >= 3, f"seed {seed}: only {mid_write_kills} kills landed mid-write"
            assert newest_history[-1] > newest_history[0], f"seed {seed}: no progress across restarts"

            # Whatever the kills left behind, the next prune restores the retention policy.
            checker.prune()
            complete = [step for step in checker.steps() if checker.is_complete(step)]
            assert len(complete) == _KEEP
            assert checker.newest_valid() == newest_history[-1]
            checker.close()
        finally:
            zygote.close()
            sys.stderr.write(stderr_path.read_text())  # shown with a failure: the worker's traceback
    assert stderr_path.read_text() == "", stderr_path.read_text()

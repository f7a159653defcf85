"""Two writers in two processes on one checkpoint directory, and many processes claiming at once."""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.paths import REPO_ROOT
from trainer_sidecar.checkpoint import CheckpointId, CheckpointStore, EpochOwner, claim_epoch

pytestmark = pytest.mark.slow

WRITER = REPO_ROOT / "tests" / "support" / "workers" / "checkpoint_writer.py"


class Writer:
    """One writer process (see tests/support/workers/checkpoint_writer.py) and the events it printed."""

    def __init__(self, root: Path, name: str, *args: str) -> None:
        self.name = name
        self.process = subprocess.Popen(
            [sys.executable, str(WRITER), str(root), name, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )
        self.events: list[dict[str, Any]] = []
        self._arrived: queue.Queue[None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.events.append(json.loads(line))
            self._arrived.put(None)

    def saved(self) -> list[CheckpointId]:
        """The checkpoints whose save returned successfully, in order."""
        return [CheckpointId(e["step"], e["epoch"]) for e in self.events if e["event"] == "saved"]

    def wait_for_saves(self, count: int, timeout: float = 120) -> None:
        """Block until at least ``count`` saves returned."""
        deadline = time.monotonic() + timeout
        while len(self.saved()) < count:
            try:
                self._arrived.get(timeout=1)
            except queue.Empty:
                ended = self.process.poll() is not None and not self._reader.is_alive()
                if ended or time.monotonic() > deadline:
                    raise AssertionError(f"{self.name}: {len(self.saved())} saves, not {count}") from None

    def finish(self, timeout: float = 120) -> None:
        """Wait for the process to exit 0 and its output to be read."""
        assert self.process.wait(timeout=timeout) == 0, self.stderr()
        self._reader.join(timeout=10)

    def stop(self) -> None:
        """Kill the process (if it still runs) and read the rest of its output."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._reader.join(timeout=10)

    def stderr(self) -> str:
        """What the process wrote to stderr (once it has exited)."""
        assert self.process.stderr is not None
        return self.process.stderr.read() if self.process.poll() is not None else "(still running)"

    def claimed(self) -> dict[str, Any]:
        """The writer's claim event."""
        return next(e for e in self.events if e["event"] == "claimed")


def _weights_match_their_writer(reader: CheckpointStore, writers: dict[int, str]) -> None:
    """Every checkpoint on disk holds the weights of the writer whose epoch is in its name."""
    mark = {epoch: float(sum(name.encode())) for epoch, name in writers.items()}
    for checkpoint in reader.ids():
        state = reader.load(checkpoint)
        assert state["writer"] == writers[checkpoint.epoch], checkpoint
        assert torch.equal(state["model"]["w"], torch.full((256,), mark[checkpoint.epoch] + checkpoint.step))


def test_the_older_writer_is_fenced_and_every_save_holds_its_own_weights(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    old = Writer(root, "old", "--pause", "0.01")
    new: Writer | None = None
    try:
        old.wait_for_saves(3)
        new = Writer(root, "new", "--resume", "--saves", "5", "--attempt", "2")
        new.finish()
        old.finish()
    finally:
        old.stop()
        if new is not None:
            new.stop()

    assert old.claimed()["epoch"] == 1
    assert new.claimed()["epoch"] == 2
    inherited_saves = [c for c in old.saved() if c.dir_name in new.claimed()["inherits"]]
    resumed = max(inherited_saves)
    assert new.saved() == [CheckpointId(resumed.step + k, 2) for k in range(1, 6)]
    fenced = old.events[-1]
    assert fenced["event"] == "fenced", old.events[-3:]
    assert "epoch 2 (job train attempt 2" in fenced["error"]
    reader = CheckpointStore(root)
    _weights_match_their_writer(reader, {1: "old", 2: "new"})
    # The old writer's checkpoints a reader may use are exactly those the new epoch inherited, all of
    # them reported saved by the old writer; the newest valid one is the new writer's.
    inherited = {CheckpointId(c.step, c.epoch) for c in reader.trusted_ids() if c.epoch == 1}
    assert {c.dir_name for c in inherited} == set(new.claimed()["inherits"])
    assert inherited <= set(old.saved())
    assert reader.newest_valid_id() == new.saved()[-1]


def test_a_writer_blind_to_the_fence_is_never_read_after_it(tmp_path: Path) -> None:
    """The old gang keeps committing, steps ahead of the new one: no reader ever picks those."""
    root = tmp_path / "ckpt"
    old = Writer(root, "old", "--blind", "--pause", "0.01")
    new: Writer | None = None
    try:
        old.wait_for_saves(3)
        new = Writer(root, "new", "--resume", "--saves", "3", "--attempt", "2")
        new.finish()
        old.wait_for_saves(len(old.saved()) + 5)  # it goes on committing after the fence
    finally:
        old.stop()
        if new is not None:
            new.stop()

    inherited = set(new.claimed()["inherits"])
    after_fence = [c for c in old.saved() if c.dir_name not in inherited]
    assert len(after_fence) >= 5
    assert max(c.step for c in after_fence) > new.saved()[-1].step  # ahead of the new writer
    reader = CheckpointStore(root)
    assert {c.dir_name for c in reader.trusted_ids() if c.epoch == 1} == inherited
    assert reader.newest_valid_id() == new.saved()[-1]
    for checkpoint in after_fence:
        assert not reader.verify(checkpoint).valid
    assert reader.prune() == []  # a reader holds no epoch: it is not the one to prune
    _weights_match_their_writer(reader, {1: "old", 2: "new"})


def _claim(root: Path, start: Any, results: Any) -> None:
    start.wait()
    record = claim_epoch(root, EpochOwner(job="racer", pid=os.getpid()))
    results.put((os.getpid(), record.epoch))


def test_many_processes_claiming_at_once_get_distinct_epochs(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    count = 12
    start = context.Barrier(count)
    results = context.Queue()
    processes = [context.Process(target=_claim, args=(tmp_path, start, results)) for _ in range(count)]
    for process in processes:
        process.start()
    claims = dict(results.get(timeout=120) for _ in range(count))
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert sorted(claims.values()) == list(range(1, count + 1))
    for pid, epoch in claims.items():
        record = json.loads((tmp_path / "epochs" / f"epoch-{epoch:06d}.json").read_text())
        assert record["owner"]["pid"] == pid
    assert sorted(p.name for p in (tmp_path / "epochs").iterdir()) == [
        f"epoch-{epoch:06d}.json" for epoch in range(1, count + 1)
    ]

"""Writing checkpoint files: the parallel hash, short writes, write errors."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import (
    assert_same_state,
    clone_state,
    random_tensor,
    small_state,
    step_files,
)
from trainer_sidecar.checkpoint import CheckpointError, CheckpointStore
from trainer_sidecar.checkpoint import writer as checkpoint_writer


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    created = CheckpointStore(tmp_path / "ckpt", keep_clean=3)
    yield created
    created.close()


def test_parallel_and_serial_hashing_write_identical_files(tmp_path: Path) -> None:
    state = {
        "model": {"big": random_tensor(torch.float32, (5_000_000,), seed=1), "small": torch.arange(5)},
        "step": 3,
    }
    digests = []
    for parallel in (True, False):
        store = CheckpointStore(tmp_path / str(parallel), parallel_hash=parallel)
        try:
            ref = store.save(3, state, {})
        finally:
            store.close()
        assert ref is not None
        data_path, _ = step_files(store.root, 3)
        assert ref.sha256 == hashlib.sha256(data_path.read_bytes()).hexdigest()
        digests.append(ref.sha256)
    assert digests[0] == digests[1]


def test_short_writes_are_resumed_where_they_stopped(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_writev = os.writev

    def short_writev(fd: int, buffers: Sequence[memoryview]) -> int:
        return real_writev(fd, [memoryview(buffers[0])[:777]])  # at most 777 bytes of the first view

    state = {
        "model": {"w": torch.randn(30_000, generator=torch.Generator().manual_seed(4)), "b": torch.arange(5)}
    }
    expected = clone_state(state)
    monkeypatch.setattr(os, "writev", short_writev)
    ref = store.save(1, state, {})
    monkeypatch.undo()
    assert ref is not None
    assert store.verify(1).valid
    assert_same_state(store.load(1), expected)


def test_write_errors_surface_on_wait_as_checkpoint_error(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_write(fd: int, views: Sequence[memoryview]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_writer, "write_all", failing_write)
    store.save_async(1, small_state(1.0), {})
    with pytest.raises(CheckpointError, match="No space left") as caught:
        store.wait()
    assert str(store.root) in str(caught.value)
    assert store.newest_valid() is None
    # The temp file is removed; the hashing thread has stopped.
    assert [p.name for p in store.root.rglob("*") if p.is_file()] == []
    assert not [t for t in threading.enumerate() if t.name == "trainguard-hash"]

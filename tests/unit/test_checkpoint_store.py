"""The checkpoint store on real files: manifests, corruption, fallback, never overwriting, retention."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pickle
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.checkpoints import (
    assert_same_state,
    clone_state,
    flip_one_bit,
    make_training,
    serialize,
    small_state,
    step_files,
    train,
    training_state,
)
from trainer_sidecar.checkpoint import CheckpointError, CheckpointId, CheckpointStore, step_dir_name
from trainer_sidecar.checkpoint import format as checkpoint_format
from trainer_sidecar.checkpoint import store as checkpoint_store
from trainer_sidecar.checkpoint import writer as checkpoint_writer


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    created = CheckpointStore(tmp_path / "ckpt", keep_clean=3)
    yield created
    created.close()


# --- round trip and manifest ---------------------------------------------------------------------------


def test_save_then_load_round_trips_model_and_adamw_bit_exactly(store: CheckpointStore) -> None:
    model, optimizer = make_training()
    train(model, optimizer, 5, seed=1)
    expected = clone_state(training_state(model, optimizer, 5))
    assert len(optimizer.state) > 0

    ref = store.save(5, training_state(model, optimizer, 5), {"loss": 0.25})
    assert ref is not None
    assert ref.step == 5
    assert ref.path == str(store.root / step_dir_name(5))

    loaded = store.load(5)
    assert_same_state(loaded, expected)

    # The loaded state resumes training exactly where the original would have gone.
    resumed_model, resumed_optimizer = make_training(seed=99)
    resumed_model.load_state_dict(loaded["model"])
    resumed_optimizer.load_state_dict(loaded["optimizer"])
    assert train(resumed_model, resumed_optimizer, 3, seed=2) == train(model, optimizer, 3, seed=2)
    assert_same_state(resumed_model.state_dict(), model.state_dict())


def test_manifest_records_step_time_world_size_and_the_files_size_and_sha256(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, rank=0, world_size=1)
    before = time.time()
    ref = store.save(42, small_state(42.0), {"loss": 1.5, "clean": True})
    after = time.time()
    store.close()

    data_path, manifest_path = step_files(tmp_path, 42)
    manifest = json.loads(manifest_path.read_text())
    assert manifest["step"] == 42
    assert manifest["rank"] == 0
    assert manifest["world_size"] == 1
    assert manifest["format"] == checkpoint_format.FORMAT_VERSION
    assert before <= manifest["time"] <= after
    assert manifest["loss"] == 1.5
    assert manifest["clean"] is True
    entry = manifest["files"]["rank-0.safetensors"]
    assert entry["size"] == data_path.stat().st_size > 0
    assert entry["sha256"] == hashlib.sha256(data_path.read_bytes()).hexdigest()
    assert ref is not None
    assert ref.sha256 == entry["sha256"]
    assert ref.time == manifest["time"]
    # Nothing but the two published files is left behind (no temp files).
    assert sorted(p.name for p in data_path.parent.iterdir()) == ["rank-0.json", "rank-0.safetensors"]


# --- corruption and fallback ---------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "bit-flip"])
def test_damaged_data_file_is_detected_and_newest_valid_falls_back(
    store: CheckpointStore, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    store.save(10, small_state(10.0), {})
    store.save(20, small_state(20.0), {})
    assert store.newest_valid() == 20
    data_path, _ = step_files(store.root, 20)
    if damage == "truncate":
        with open(data_path, "r+b") as handle:
            handle.truncate(data_path.stat().st_size // 2)
    else:
        flip_one_bit(data_path)

    verdict = store.verify(20)
    assert not verdict.valid
    assert verdict.step == 20
    assert str(data_path) in verdict.reason
    assert ("truncated" if damage == "truncate" else "SHA-256") in verdict.reason
    assert store.verify(10).valid

    with caplog.at_level(logging.WARNING, logger=checkpoint_store.__name__):
        assert store.newest_valid() == 10
    assert any(str(data_path) in record.getMessage() for record in caplog.records)
    assert_same_state(store.load(10), small_state(10.0))


def test_missing_data_file_is_detected(store: CheckpointStore) -> None:
    store.save(10, small_state(10.0), {})
    store.save(20, small_state(20.0), {})
    data_path, _ = step_files(store.root, 20)
    data_path.unlink()
    verdict = store.verify(20)
    assert not verdict.valid
    assert str(data_path) in verdict.reason
    assert store.newest_valid() == 10


def test_corrupt_manifest_is_skipped_with_a_reason_naming_it(store: CheckpointStore) -> None:
    store.save(10, small_state(10.0), {})
    store.save(20, small_state(20.0), {})
    _, manifest_path = step_files(store.root, 20)
    manifest_path.write_text("{this is not json")

    verdict = store.verify(20)
    assert not verdict.valid
    # The reason must point at the file that is broken: the manifest, which is present but unreadable.
    assert str(manifest_path) in verdict.reason, verdict.reason
    assert store.newest_valid() == 10


def test_manifest_of_another_step_is_rejected(store: CheckpointStore) -> None:
    store.save(10, small_state(10.0), {})
    store.save(20, small_state(20.0), {})
    _, manifest_path = step_files(store.root, 20)
    manifest = json.loads(manifest_path.read_text())
    manifest["step"] = 30
    manifest_path.write_text(json.dumps(manifest))
    verdict = store.verify(20)
    assert not verdict.valid
    assert str(manifest_path) in verdict.reason
    assert store.newest_valid() == 10


def test_a_rank_that_finishes_before_rank_0_learns_the_checkpoint_is_clean_once_rank_0_lands(
    tmp_path: Path,
) -> None:
    """Every rank's status names the newest clean checkpoint, not only the rank that finished last."""
    rank0 = CheckpointStore(tmp_path, rank=0, world_size=2)
    rank1 = CheckpointStore(tmp_path, rank=1, world_size=2)
    try:
        assert rank1.save(10, {"data": {"index": 10}}, {}) is None  # rank 0's manifest not there yet
        assert rank1.last_clean is None
        rank0.save(10, small_state(10.0), {})
        ref = rank1.last_clean
        assert ref is not None
        assert (ref.step, ref.path) == (10, str(tmp_path / step_dir_name(10)))
        assert ref == rank0.last_clean

        # A newer one still waiting for rank 0 does not hide the older clean one.
        assert rank1.save(20, {"data": {"index": 20}}, {}) is None
        assert rank1.last_clean == ref
        rank0.save(20, small_state(20.0), {})
        newer = rank1.last_clean
        assert newer is not None
        assert newer.step == 20
    finally:
        rank0.close()
        rank1.close()


def test_incomplete_checkpoint_is_neither_complete_nor_chosen(tmp_path: Path) -> None:
    rank0 = CheckpointStore(tmp_path, rank=0, world_size=2)
    rank1 = CheckpointStore(tmp_path, rank=1, world_size=2)
    try:
        rank0.save(10, small_state(10.0), {})
        rank1.save(10, {"rng": torch.arange(4) + 10, "data": {"index": 10}}, {})
        assert rank0.is_complete(10)

        rank0.save(20, small_state(20.0), {})
        assert (tmp_path / step_dir_name(20) / "rank-0.json").exists()
        assert not (tmp_path / step_dir_name(20) / "rank-1.json").exists()
        assert not rank0.is_complete(20)
        verdict = rank0.verify(20)
        assert not verdict.valid
        assert "incomplete" in verdict.reason
        assert rank0.newest_valid() == 10
        assert rank1.newest_valid() == 10

        # Once rank 1 publishes its part the checkpoint is complete and both ranks choose it.
        rank1.save(20, {"rng": torch.arange(4) + 20, "data": {"index": 20}}, {})
        assert rank0.is_complete(20)
        assert rank0.newest_valid() == 20
        assert rank1.newest_valid() == 20
        merged = rank1.load(20)
        assert_same_state(merged["model"], small_state(20.0)["model"])
        assert_same_state(merged["rng"], torch.arange(4) + 20)
        assert merged["data"] == {"index": 20}
        assert "rng" not in rank0.load(20)

        # Rank 1 also checks rank 0's file, which holds the model it loads.
        flip_one_bit(tmp_path / step_dir_name(20) / "rank-0.safetensors")
        assert not rank1.verify(20).valid
        assert rank1.newest_valid() == 10
    finally:
        rank0.close()
        rank1.close()


def test_a_rank_beyond_the_writers_world_size_can_resume_from_rank_0s_files(tmp_path: Path) -> None:
    """A job restarted with more ranks: the new rank has no file of its own, and load() supports that
    (it starts the rank's RNG and data position afresh), so verify() must accept the checkpoint too;
    otherwise the ranks disagree and the job's agreed resume step (a MIN over ranks) is "none"."""
    writer = CheckpointStore(tmp_path, rank=0, world_size=1)
    writer.save(10, {**small_state(10.0), "rng": torch.arange(3)}, {})
    writer.close()
    new_rank = CheckpointStore(tmp_path, rank=1, world_size=2)
    try:
        loaded = new_rank.load(10)
        assert_same_state(loaded["model"], small_state(10.0)["model"])
        assert "rng" not in loaded
        verdict = new_rank.verify(10)
        assert verdict.valid, verdict.reason
        assert new_rank.newest_valid() == 10
    finally:
        new_rank.close()


# --- never overwrite; move aside what is broken ------------------------------------------------------


def test_saving_a_step_that_already_has_a_valid_checkpoint_does_not_rewrite_it(
    store: CheckpointStore,
) -> None:
    store.save(7, small_state(7.0), {})
    data_path, manifest_path = step_files(store.root, 7)
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in (data_path, manifest_path)}
    listing = sorted(p.name for p in data_path.parent.iterdir())
    time.sleep(0.01)

    ref = store.save(7, small_state(99.0), {"different": True})

    assert ref is not None
    assert ref.step == 7
    after = {p: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in (data_path, manifest_path)}
    assert after == before
    assert sorted(p.name for p in data_path.parent.iterdir()) == listing
    assert_same_state(store.load(7), small_state(7.0))


@pytest.mark.parametrize("damage", ["bit-flip", "truncate", "garbage-manifest"])
def test_corrupted_existing_step_is_moved_aside_and_rewritten(store: CheckpointStore, damage: str) -> None:
    store.save(7, small_state(7.0), {})
    data_path, manifest_path = step_files(store.root, 7)
    if damage == "bit-flip":
        flip_one_bit(data_path)
    elif damage == "truncate":
        with open(data_path, "r+b") as handle:
            handle.truncate(10)
    else:
        manifest_path.write_text("not json at all")
    damaged = {p.name: p.read_bytes() for p in (data_path, manifest_path)}
    assert not store.verify(7).valid

    ref = store.save(7, small_state(8.0), {})

    assert ref is not None
    assert ref.step == 7
    assert store.verify(7).valid
    assert_same_state(store.load(7), small_state(8.0))
    # The damaged files were kept, renamed, byte for byte.
    for name, content in damaged.items():
        aside = sorted(data_path.parent.glob(f"{name}.corrupt-*"))
        assert len(aside) == 1, f"{name} was not moved aside: {sorted(data_path.parent.iterdir())}"
        assert aside[0].read_bytes() == content


# --- the checkpoint root -------------------------------------------------------------------------------


def test_root_that_is_a_regular_file_raises_naming_the_path(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    with pytest.raises(CheckpointError, match="checkpoint directory") as caught:
        CheckpointStore(afile)
    assert str(afile) in str(caught.value)
    assert afile.read_text() == "not a directory"


def test_root_that_cannot_be_created_raises_naming_the_path(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    root = afile / "sub"
    with pytest.raises(CheckpointError) as caught:
        CheckpointStore(root)
    assert str(root) in str(caught.value)


def test_existing_directory_that_is_not_writable_raises_naming_the_path() -> None:
    # chmod does not stop root, so use a directory no process can create files in: procfs.
    root = Path("/proc")
    assert root.is_dir()
    with pytest.raises(CheckpointError, match="not writable") as caught:
        CheckpointStore(root)
    assert str(root) in str(caught.value)


# --- loading never runs code ---------------------------------------------------------------------------


class _RunsCodeWhenUnpickled:
    """Unpickling this calls ``open(marker, "w")``: a stand-in for arbitrary code in a hostile file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def _publish_crafted(store: CheckpointStore, step: int, payload: bytes) -> Path:
    """Place ``payload`` as rank 0's data file of ``step`` with a manifest that matches it (size, SHA-256)."""
    directory = store.root / step_dir_name(step)
    directory.mkdir()
    data_path = directory / "rank-0.safetensors"
    data_path.write_bytes(payload)
    manifest = {
        "format": checkpoint_format.FORMAT_VERSION,
        "step": step,
        "rank": 0,
        "world_size": 1,
        "time": time.time(),
        "files": {data_path.name: {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}},
    }
    (directory / "rank-0.json").write_text(json.dumps(manifest))
    return data_path


def _hostile_torch_save(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.ones(2)}, "payload": _RunsCodeWhenUnpickled(marker)}, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("kind", ["torch.save", "pickle"])
def test_load_refuses_a_manifested_file_whose_pickle_would_run_code(
    store: CheckpointStore, tmp_path: Path, kind: str
) -> None:
    marker = tmp_path / "code-ran"
    hostile = _RunsCodeWhenUnpickled(marker)
    payload = _hostile_torch_save(marker) if kind == "torch.save" else pickle.dumps({"model": hostile})
    data_path = _publish_crafted(store, 3, payload)
    # The manifest matches it, yet verification parses the data file's header: not a checkpoint.
    verdict = store.verify(3)
    assert not verdict.valid
    assert str(data_path) in verdict.reason
    assert "not a trainguard checkpoint" in verdict.reason

    with pytest.raises(CheckpointError, match="not a trainguard checkpoint") as caught:
        store.load(3)
    assert str(data_path) in str(caught.value)
    assert not marker.exists()

    # Control: the same bytes loaded by pickle really do run the code.
    if kind == "torch.save":
        torch.load(io.BytesIO(payload), weights_only=False)
    else:
        pickle.loads(payload)  # the point of the control
    assert marker.exists()


def test_load_refuses_a_pickle_behind_valid_magic_and_header(store: CheckpointStore, tmp_path: Path) -> None:
    """A well-formed header whose data section holds a pickle: the bytes are only ever tensor bytes."""
    marker = tmp_path / "code-ran"
    pickled = pickle.dumps({"model": _RunsCodeWhenUnpickled(marker)})
    state = {"model": {"blob": torch.frombuffer(bytearray(pickled), dtype=torch.uint8)}}
    payload = serialize(state)
    _publish_crafted(store, 3, payload)
    loaded = store.load(3)
    assert bytes(loaded["model"]["blob"].numpy()) == pickled
    assert not marker.exists()


def test_load_rejects_a_file_that_is_not_a_checkpoint_dict(store: CheckpointStore) -> None:
    directory = store.root / step_dir_name(4)
    directory.mkdir()
    torch.save(torch.zeros(3), directory / "rank-0.safetensors")
    with pytest.raises(CheckpointError, match="not a trainguard checkpoint"):
        store.load(4)
    (directory / "rank-0.safetensors").write_bytes(serialize([torch.zeros(3), 1]))  # a v2 file, but a list
    with pytest.raises(CheckpointError, match=r"not a trainguard checkpoint \(top level is list\)"):
        store.load(4)


def test_a_format_1_checkpoint_is_skipped_as_an_unknown_format(store: CheckpointStore) -> None:
    store.save(10, small_state(10.0), {})
    directory = store.root / step_dir_name(20)
    directory.mkdir()
    buffer = io.BytesIO()
    torch.save(small_state(20.0), buffer)
    (directory / "rank-0.safetensors").write_bytes(buffer.getvalue())
    manifest = {
        "format": 1,
        "step": 20,
        "world_size": 1,
        "time": time.time(),
        "files": {
            "rank-0.safetensors": {
                "size": len(buffer.getvalue()),
                "sha256": hashlib.sha256(buffer.getvalue()).hexdigest(),
            }
        },
    }
    (directory / "rank-0.json").write_text(json.dumps(manifest))
    verdict = store.verify(20)
    assert not verdict.valid
    assert "unknown checkpoint format 1" in verdict.reason
    assert str(directory / "rank-0.json") in verdict.reason
    assert store.newest_valid() == 10


# --- asynchronous saves --------------------------------------------------------------------------------


def test_back_to_back_save_async_each_store_the_state_at_their_call(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = make_training()
    train(model, optimizer, 2, seed=3)
    live = training_state(model, optimizer, 2)
    at_first_call = clone_state(live)

    # Hold the first background write inside its file write until released, so it is surely in flight.
    gate = threading.Event()
    original_write = checkpoint_writer.write_all

    def gated_write(fd: int, views: Sequence[memoryview]) -> None:
        assert gate.wait(timeout=30), "the gate was never opened"
        original_write(fd, views)

    monkeypatch.setattr(checkpoint_writer, "write_all", gated_write)

    store.save_async(2, live, {"n": 1})
    assert store.busy
    # Mutate the live state in place while the first write is in flight.
    train(model, optimizer, 3, seed=4)
    live_after = training_state(model, optimizer, 5)
    at_second_call = clone_state(live_after)
    assert not torch.equal(at_first_call["model"]["0.weight"], at_second_call["model"]["0.weight"])

    releaser = threading.Timer(0.3, gate.set)
    releaser.start()
    try:
        assert store.busy
        store.save_async(5, live_after, {"n": 2})  # issued while the first is still being written
        # Mutate again straight after the second call returned: must not reach the second checkpoint.
        train(model, optimizer, 1, seed=5)
        ref = store.wait()
    finally:
        gate.set()
        releaser.join()

    assert ref is not None
    assert ref.step == 5
    assert store.verify(2).valid
    assert store.verify(5).valid
    assert_same_state(store.load(2), at_first_call)
    assert_same_state(store.load(5), at_second_call)


# --- retention -----------------------------------------------------------------------------------------

_KINDS = ("complete", "incomplete-world-2", "data-only")


def _build(root: Path, plan: dict[int, str]) -> None:
    """Create checkpoints per ``plan`` (step -> kind), in its order, without any pruning."""
    # Pruning runs in the stores' janitor threads: they must be closed while it is still patched out.
    with mock.patch.object(CheckpointStore, "prune", return_value=[]):
        single = CheckpointStore(root, world_size=1)
        partial = CheckpointStore(root, rank=0, world_size=2)
        try:
            for step, kind in plan.items():
                if kind == "complete":
                    single.save(step, small_state(float(step)), {})
                elif kind == "incomplete-world-2":
                    partial.save(step, small_state(float(step)), {})
                else:  # a crash mid-write: a data file, no manifest
                    directory = root / step_dir_name(step)
                    directory.mkdir()
                    (directory / "rank-0.safetensors").write_bytes(b"half a checkpoint")
        finally:
            single.close()
            partial.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=st.dictionaries(st.integers(0, 60), st.sampled_from(_KINDS), min_size=1, max_size=9),
    keep=st.integers(1, 4),
)
def test_prune_keeps_exactly_the_newest_complete_checkpoints(plan: dict[int, str], keep: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        _build(root, plan)
        complete = sorted(step for step, kind in plan.items() if kind == "complete")
        assert sorted(plan) == sorted(int(p.name.removeprefix("step-")) for p in root.glob("step-*"))

        store = CheckpointStore(root, keep_clean=keep)
        try:
            deleted = store.prune()
            remaining = store.steps()
            remaining_complete = [step for step in remaining if store.is_complete(step)]
            if complete:
                kept = complete[-keep:]
                assert remaining_complete == kept
                assert len(remaining_complete) <= keep
                assert complete[-1] in remaining
                assert store.verify(complete[-1]).valid
                assert store.newest_valid() == complete[-1]
                # Incomplete directories newer than the oldest kept may still be being written.
                assert remaining == [step for step in sorted(plan) if step >= kept[0]]
            else:
                assert deleted == []
                assert remaining == sorted(plan)
                assert store.newest_valid() is None
            assert sorted(c.step for c in deleted) == sorted(set(plan) - set(remaining))
            assert store.prune() == []  # idempotent
        finally:
            store.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(st.integers(0, 100), min_size=1, max_size=10, unique=True),
    keep=st.integers(1, 3),
)
def test_saving_prunes_as_it_goes_and_never_loses_the_newest(steps: list[int], keep: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        store = CheckpointStore(Path(directory), keep_clean=keep)
        try:
            saved: list[int] = []
            for step in steps:
                store.save(step, small_state(float(step)), {})
                store.wait_for_pruning()  # pruning runs after the save is durable, in the background
                saved.append(step)
                complete = [s for s in store.steps() if store.is_complete(s)]
                assert complete == sorted(saved)[-keep:]
                assert store.newest_valid() == max(saved)
            newest = max(saved)
            assert_same_state(store.load(newest), small_state(float(newest)))
        finally:
            store.close()


def _gate_prune(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make every prune wait for the returned ``release`` event; ``entered`` is set when one starts."""
    entered, release = threading.Event(), threading.Event()
    original = CheckpointStore.prune

    def gated(self: CheckpointStore) -> list[CheckpointId]:
        entered.set()
        assert release.wait(timeout=30), "the prune was never released"
        return original(self)

    monkeypatch.setattr(CheckpointStore, "prune", gated)
    return entered, release


def test_pruning_is_off_the_path_wait_waits_on_and_close_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path, keep_clean=1)
    entered, release = _gate_prune(monkeypatch)
    try:
        assert store.save(1, small_state(1.0), {}) is not None
        assert entered.wait(timeout=10)
        # The pruning after step 1 is stuck, yet the next save completes and is durable.
        ref = store.save(2, small_state(2.0), {})
        assert ref is not None
        assert ref.step == 2
        assert store.verify(2).valid
        assert store.steps() == [1, 2]

        closer = threading.Thread(target=store.close)
        closer.start()
        closer.join(timeout=0.3)
        assert closer.is_alive(), "close() returned while pruning was still pending"
    finally:
        release.set()
    closer.join(timeout=30)
    assert not closer.is_alive()
    assert store.steps() == [2]


def test_a_failing_prune_is_logged_and_the_store_keeps_working(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def failing(self: CheckpointStore) -> list[CheckpointId]:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(CheckpointStore, "prune", failing)
    with caplog.at_level(logging.ERROR, logger=checkpoint_store.__name__):
        assert store.save(1, small_state(1.0), {}) is not None
        store.wait_for_pruning()
        assert store.save(2, small_state(2.0), {}) is not None
        store.wait_for_pruning()
    failures = [r for r in caplog.records if "pruning old checkpoints" in r.getMessage()]
    assert len(failures) == 2
    assert "Input/output error" in caplog.text
    assert store.newest_valid() == 2


def test_pruning_never_deletes_a_step_while_this_store_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path, keep_clean=1)
    try:
        store.save(10, small_state(10.0), {})
        store.save(20, small_state(20.0), {})
        store.wait_for_pruning()
        assert store.steps() == [20]

        gate = threading.Event()
        original_write = checkpoint_writer.write_all

        def gated_write(fd: int, views: Sequence[memoryview]) -> None:
            assert gate.wait(timeout=30), "the gate was never opened"
            original_write(fd, views)

        monkeypatch.setattr(checkpoint_writer, "write_all", gated_write)
        store.save_async(5, small_state(5.0), {})  # older than the newest complete: a prune target
        deadline = time.monotonic() + 10
        while not (tmp_path / step_dir_name(5)).is_dir():
            assert time.monotonic() < deadline, "the write of step 5 never started"
            time.sleep(0.005)
        assert store.prune() == []  # step 5 is being written: left alone
        assert (tmp_path / step_dir_name(5)).is_dir()
        gate.set()
        ref = store.wait()
        assert ref is not None
        assert ref.step == 5
        store.wait_for_pruning()  # now it is complete and older than the newest: pruned as usual
        assert store.steps() == [20]
        assert store.newest_valid() == 20
    finally:
        store.close()


@pytest.mark.parametrize("step", [-1, True, 2.0])
def test_a_step_that_is_not_a_non_negative_integer_is_refused(store: CheckpointStore, step: Any) -> None:
    with pytest.raises(CheckpointError, match="non-negative integer"):
        store.save(step, small_state(1.0), {})
    assert store.ids() == []

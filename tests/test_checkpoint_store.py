"""The clean-checkpoint store on real files: round trips, manifests, corruption, retention, safety.

Also a kill test: a real child process saving ~24 MB checkpoints is SIGKILLed at random moments, and
after every kill the newest valid checkpoint must verify and load with exactly the state of its step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from trainer_sidecar import checkpoint as checkpoint_module
from trainer_sidecar.checkpoint import CheckpointError, CheckpointStore, step_dir_name

REPO_ROOT = Path(__file__).resolve().parent.parent


# --- helpers -------------------------------------------------------------------------------------------


def make_training(seed: int = 0) -> tuple[nn.Module, torch.optim.AdamW]:
    """A small model with parameters and buffers (BatchNorm, including an int64 counter) and its AdamW."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Linear(24, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    return model, optimizer


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    """``steps`` AdamW steps on seeded random batches; returns the losses."""
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        inputs = torch.randn(16, 12, generator=generator)
        targets = torch.randn(16, 3, generator=generator)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        torch.autograd.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return losses


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}


def clone_state(state: Any) -> Any:
    """A deep copy with every tensor cloned (what the state was at this moment)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, Mapping):
        return {key: clone_state(value) for key, value in state.items()}
    if isinstance(state, list):
        return [clone_state(value) for value in state]
    if isinstance(state, tuple):
        return tuple(clone_state(value) for value in state)
    return state


def assert_same_state(actual: Any, expected: Any, where: str = "state") -> None:
    """Bit-exact equality of nested states: tensors by torch.equal (and dtype), the rest by ==."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert torch.equal(actual, expected), f"{where}: tensor contents differ"
    elif isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{where}: expected a mapping, got {type(actual).__name__}"
        assert set(actual) == set(expected), f"{where}: keys {set(actual)} != {set(expected)}"
        for key in expected:
            assert_same_state(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected)}"
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_state(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def small_state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((4, 3), value), "b": torch.arange(3) + int(value)}, "step": int(value)}


def step_files(root: Path, step: int) -> tuple[Path, Path]:
    directory = root / step_dir_name(step)
    return directory / "rank-0.pt", directory / "rank-0.json"


def flip_one_bit(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    index = len(data) // 2 if offset is None else offset
    data[index] ^= 0x10
    path.write_bytes(bytes(data))


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
    assert manifest["format"] == checkpoint_module.FORMAT_VERSION
    assert before <= manifest["time"] <= after
    assert manifest["loss"] == 1.5
    assert manifest["clean"] is True
    entry = manifest["files"]["rank-0.pt"]
    assert entry["size"] == data_path.stat().st_size > 0
    assert entry["sha256"] == hashlib.sha256(data_path.read_bytes()).hexdigest()
    assert ref is not None
    assert ref.sha256 == entry["sha256"]
    assert ref.time == manifest["time"]
    # Nothing but the two published files is left behind (no temp files).
    assert sorted(p.name for p in data_path.parent.iterdir()) == ["rank-0.json", "rank-0.pt"]


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

    with caplog.at_level(logging.WARNING, logger=checkpoint_module.__name__):
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
        flip_one_bit(tmp_path / step_dir_name(20) / "rank-0.pt")
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


# --- loading is weights-only ---------------------------------------------------------------------------


class _RunsCodeWhenUnpickled:
    """Unpickling this calls ``open(marker, "w")``: a stand-in for arbitrary code in a hostile file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def test_load_refuses_a_checkpoint_whose_pickle_would_run_code(
    store: CheckpointStore, tmp_path: Path
) -> None:
    marker = tmp_path / "code-ran"
    directory = store.root / step_dir_name(3)
    directory.mkdir()
    torch.save(
        {"model": {"w": torch.ones(2)}, "payload": _RunsCodeWhenUnpickled(marker)}, directory / "rank-0.pt"
    )

    with pytest.raises(CheckpointError) as caught:
        store.load(3)
    assert str(directory / "rank-0.pt") in str(caught.value)
    assert not marker.exists()

    # Control: the same file loaded without weights_only really does run the code.
    torch.load(directory / "rank-0.pt", weights_only=False)
    assert marker.exists()


def test_load_rejects_a_file_that_is_not_a_checkpoint_dict(store: CheckpointStore) -> None:
    directory = store.root / step_dir_name(4)
    directory.mkdir()
    torch.save(torch.zeros(3), directory / "rank-0.pt")
    with pytest.raises(CheckpointError, match="not a trainguard checkpoint"):
        store.load(4)


# --- asynchronous saves --------------------------------------------------------------------------------


def test_back_to_back_save_async_each_store_the_state_at_their_call(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = make_training()
    train(model, optimizer, 2, seed=3)
    live = training_state(model, optimizer, 2)
    at_first_call = clone_state(live)

    # Hold the first background write inside torch.save until released, so it is surely in flight.
    gate = threading.Event()
    original_write = checkpoint_module._HashingWriter.write

    def gated_write(self: Any, data: bytes | bytearray | memoryview) -> int:
        assert gate.wait(timeout=30), "the gate was never opened"
        return original_write(self, data)

    monkeypatch.setattr(checkpoint_module._HashingWriter, "write", gated_write)

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


def test_write_errors_surface_on_wait_as_checkpoint_error(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_write(self: Any, data: bytes | bytearray | memoryview) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module._HashingWriter, "write", failing_write)
    store.save_async(1, small_state(1.0), {})
    with pytest.raises(CheckpointError, match="No space left") as caught:
        store.wait()
    assert str(store.root) in str(caught.value)
    assert store.newest_valid() is None


# --- retention -----------------------------------------------------------------------------------------

_KINDS = ("complete", "incomplete-world-2", "data-only")


def _build(root: Path, plan: dict[int, str]) -> None:
    """Create checkpoints per ``plan`` (step -> kind), in its order, without any pruning."""
    single = CheckpointStore(root, world_size=1)
    partial = CheckpointStore(root, rank=0, world_size=2)
    try:
        with mock.patch.object(CheckpointStore, "prune", return_value=[]):
            for step, kind in plan.items():
                if kind == "complete":
                    single.save(step, small_state(float(step)), {})
                elif kind == "incomplete-world-2":
                    partial.save(step, small_state(float(step)), {})
                else:  # a crash mid-write: a data file, no manifest
                    directory = root / step_dir_name(step)
                    directory.mkdir()
                    (directory / "rank-0.pt").write_bytes(b"half a checkpoint")
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
            assert sorted(deleted) == sorted(set(plan) - set(remaining))
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
                saved.append(step)
                complete = [s for s in store.steps() if store.is_complete(s)]
                assert complete == sorted(saved)[-keep:]
                assert store.newest_valid() == max(saved)
            newest = max(saved)
            assert_same_state(store.load(newest), small_state(float(newest)))
        finally:
            store.close()


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

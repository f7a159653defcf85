"""The checkpoint directory is not trusted: planted links are never followed, hostile manifests and files
make a checkpoint invalid (the reader falls back to an older one), and nothing hangs or escapes."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.checkpoints import assert_same_state, join_file, small_state, split_file, step_files
from trainer_sidecar.checkpoint import CheckpointStore, claim_epoch, step_dir_name
from trainer_sidecar.checkpoint import fs as checkpoint_fs
from trainer_sidecar.checkpoint import store as checkpoint_store
from trainer_sidecar.checkpoint.errors import CheckpointError

pytestmark = pytest.mark.timeout(120)  # a hang (a FIFO, /dev/zero) fails instead of blocking the suite


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the checkpoint root holding a file that must never change."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "precious").write_text("precious data")
    return folder


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    created = CheckpointStore(tmp_path / "ckpt", keep_clean=5)
    yield created
    created.close()


def _untouched(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["precious"]
    assert (outside / "precious").read_text() == "precious data"


# --- links planted at every name the writer creates ---------------------------------------------------


def test_a_link_planted_as_a_future_checkpoint_directory_is_moved_aside_never_followed(
    store: CheckpointStore, outside: Path, caplog: pytest.LogCaptureFixture
) -> None:
    planted = store.root / step_dir_name(5)
    planted.symlink_to(outside, target_is_directory=True)
    with caplog.at_level(logging.ERROR, logger=checkpoint_store.__name__):
        ref = store.save(5, small_state(5.0), {})
    _untouched(outside)
    assert ref is not None
    assert planted.is_dir()
    assert not planted.is_symlink()
    assert store.newest_valid() == 5
    assert_same_state(store.load(5), small_state(5.0))
    assert any("was a link" in record.getMessage() for record in caplog.records)
    aside = [p for p in store.root.iterdir() if p.name.startswith(f".{step_dir_name(5)}.link-aside")]
    assert len(aside) == 1
    assert aside[0].is_symlink()


def test_links_planted_at_the_data_file_and_manifest_names_are_replaced_never_followed(
    store: CheckpointStore, outside: Path
) -> None:
    directory = store.root / step_dir_name(5)
    directory.mkdir()
    (directory / "rank-0.safetensors").symlink_to(outside / "precious")
    (directory / "rank-0.json").symlink_to(outside / "precious")
    assert store.save(5, small_state(5.0), {}) is not None
    _untouched(outside)
    assert not (directory / "rank-0.safetensors").is_symlink()
    assert not (directory / "rank-0.json").is_symlink()
    assert store.verify(5).valid


@pytest.mark.parametrize("target", ["file", "fifo"])
def test_a_link_planted_at_the_writers_temp_name_is_never_written_through(
    store: CheckpointStore, outside: Path, target: str
) -> None:
    """The temp names are random and created exclusively: even a link at the exact next name is refused."""
    directory = store.root / step_dir_name(5)
    directory.mkdir()
    victim = outside / "precious"
    if target == "fifo":
        victim = outside / "fifo"
        os.mkfifo(victim)
    # Links at the names a writer keyed by PID would use, and at the exact random names this one draws next.
    for stem in ("rank-0.safetensors", "rank-0.json", "rank-0.pt"):
        (directory / f".{stem}.tmp-{os.getpid()}").symlink_to(victim)
        (directory / f".{stem}.tmp-{os.getpid()}-planted").symlink_to(victim)
    tokens = iter(["planted", "fresh1", "planted", "fresh2"])
    with mock.patch("secrets.token_hex", side_effect=lambda _: next(tokens)):
        assert store.save(5, small_state(5.0), {}) is not None
    if target == "fifo":
        victim.unlink()
    _untouched(outside)
    assert store.verify(5).valid


def test_the_write_probe_at_start_up_never_writes_through_a_link(tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / f".write-probe-0.tmp-{os.getpid()}-planted").symlink_to(outside / "precious")
    tokens = iter(["planted", "fresh"])
    with mock.patch("secrets.token_hex", side_effect=lambda _: next(tokens)):
        CheckpointStore(root).close()
    _untouched(outside)


def test_a_link_planted_as_the_epochs_folder_is_refused_loudly(tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "epochs").symlink_to(outside, target_is_directory=True)
    with pytest.raises(CheckpointError, match="symbolic link"):
        claim_epoch(root)
    _untouched(outside)


def test_a_linked_checkpoint_directory_is_never_read(store: CheckpointStore, tmp_path: Path) -> None:
    """A valid checkpoint elsewhere, linked in as a newer step: not a checkpoint of this directory."""
    elsewhere = CheckpointStore(tmp_path / "elsewhere")
    elsewhere.save(9, small_state(9.0), {})
    elsewhere.close()
    store.save(5, small_state(5.0), {})
    (store.root / step_dir_name(9)).symlink_to(tmp_path / "elsewhere" / step_dir_name(9))
    assert store.steps() == [5]
    assert store.newest_valid() == 5
    assert not store.verify(9).valid


# --- hostile manifests and files: invalid, and the reader falls back ------------------------------------


def _manifest_of(store: CheckpointStore, step: int) -> dict[str, Any]:
    return dict(json.loads(step_files(store.root, step)[1].read_text()))


def _two_checkpoints(store: CheckpointStore) -> tuple[Path, Path]:
    store.save(10, small_state(10.0), {})
    store.save(20, small_state(20.0), {})
    return step_files(store.root, 20)


def _publish(manifest_path: Path, manifest: Any) -> None:
    manifest_path.write_text(json.dumps(manifest))


def _hostile_manifests(manifest: dict[str, Any], outside: Path) -> dict[str, Any]:
    precious = (outside / "precious").read_bytes()
    outside_entry = {"size": len(precious), "sha256": hashlib.sha256(precious).hexdigest()}
    entry = manifest["files"]["rank-0.safetensors"]

    def with_file(name: str, value: Any) -> dict[str, Any]:
        return {**manifest, "files": {**manifest["files"], name: value}}

    return {
        "world-size-a-word": {**manifest, "world_size": "two"},
        "world-size-null": {**manifest, "world_size": None},
        "world-size-zero": {**manifest, "world_size": 0},
        "world-size-bool": {**manifest, "world_size": True},
        "time-a-word": {**manifest, "time": "yesterday"},
        "time-missing": {k: v for k, v in manifest.items() if k != "time"},
        "step-a-string": {**manifest, "step": "20"},
        "rank-other": {**manifest, "rank": 1},
        "epoch-other": {**manifest, "epoch": 3},
        "format-missing": {k: v for k, v in manifest.items() if k != "format"},
        "null": None,
        "a-list": [manifest],
        "files-null": {**manifest, "files": None},
        "file-entry-a-string": with_file("rank-0.safetensors", "sha"),
        "file-entry-size-a-string": with_file("rank-0.safetensors", {**entry, "size": "12"}),
        "file-entry-extra-key": with_file("rank-0.safetensors", {**entry, "x": 1}),
        "sha-uppercase": with_file("rank-0.safetensors", {**entry, "sha256": entry["sha256"].upper()}),
        "data-file-missing": {**manifest, "files": {"rank-1.safetensors": entry}},
        "parent-path": with_file("../../outside/precious", outside_entry),
        "absolute-path": with_file(str(outside / "precious"), outside_entry),
        "dev-zero": with_file("/dev/zero", {**entry, "size": 1 << 40}),
        "dot-dot": with_file("..", entry),
    }


_HOSTILE = [
    "world-size-a-word", "world-size-null", "world-size-zero", "world-size-bool", "time-a-word",
    "time-missing",
    "step-a-string", "rank-other", "epoch-other", "format-missing", "null", "a-list", "files-null",
    "file-entry-a-string", "file-entry-size-a-string", "file-entry-extra-key", "sha-uppercase",
    "data-file-missing", "parent-path", "absolute-path", "dev-zero", "dot-dot",
]  # fmt: skip


def test_the_hostile_manifest_cases_are_all_tested(tmp_path: Path) -> None:
    (tmp_path / "precious").write_text("x")
    manifest = {"files": {"rank-0.safetensors": {"size": 1, "sha256": "00"}}}
    assert sorted(_hostile_manifests(manifest, tmp_path)) == sorted(_HOSTILE)


@pytest.mark.parametrize("case", _HOSTILE)
def test_a_hostile_manifest_is_invalid_naming_it_and_the_reader_falls_back(
    store: CheckpointStore, outside: Path, case: str
) -> None:
    _, manifest_path = _two_checkpoints(store)
    _publish(manifest_path, _hostile_manifests(_manifest_of(store, 20), outside)[case])
    hashed: list[str] = []
    real_sha256 = checkpoint_fs.sha256_fd

    def spy(fd: int, size: int, where: str) -> str:
        hashed.append(where)
        return real_sha256(fd, size, where)

    with mock.patch.object(checkpoint_fs, "sha256_fd", side_effect=spy):
        verdict = store.verify(20)
        assert store.newest_valid() == 10
    assert not verdict.valid
    assert str(manifest_path) in verdict.reason, verdict.reason
    # Nothing outside the checkpoints' own folders was hashed (only the older, valid one's file).
    assert hashed == [str(step_files(store.root, 10)[0])], hashed
    assert store.reference(20) is None
    assert not store.is_complete(20)
    _untouched(outside)


@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero", "directory", "link-to-outside"])
def test_a_data_file_that_is_not_a_regular_file_is_invalid_and_never_blocks(
    store: CheckpointStore, outside: Path, kind: str
) -> None:
    data_path, _ = _two_checkpoints(store)
    data_path.unlink()
    if kind == "fifo":
        os.mkfifo(data_path)
    elif kind == "link-to-dev-zero":
        data_path.symlink_to("/dev/zero")
    elif kind == "directory":
        data_path.mkdir()
    else:
        data_path.symlink_to(outside / "precious")
    verdict = store.verify(20)
    assert not verdict.valid
    assert str(data_path) in verdict.reason
    assert store.newest_valid() == 10
    with pytest.raises(CheckpointError, match=str(data_path)):
        store.load(20)
    _untouched(outside)


@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero", "huge"])
def test_a_manifest_that_is_not_a_small_regular_file_is_invalid_and_never_blocks(
    store: CheckpointStore, kind: str
) -> None:
    _, manifest_path = _two_checkpoints(store)
    manifest_path.unlink()
    if kind == "fifo":
        os.mkfifo(manifest_path)
    elif kind == "link-to-dev-zero":
        manifest_path.symlink_to("/dev/zero")
    else:
        with open(manifest_path, "wb") as handle:
            handle.truncate(1 << 30)  # sparse: a gigabyte of nothing
    verdict = store.verify(20)
    assert not verdict.valid
    assert str(manifest_path) in verdict.reason
    assert store.newest_valid() == 10
    assert not store.is_complete(20)


def test_a_malformed_newest_checkpoint_whose_manifest_matches_it_is_invalid(store: CheckpointStore) -> None:
    """Bad offsets inside the data file, with a manifest recomputed to match: found at verification."""
    data_path, manifest_path = _two_checkpoints(store)
    header, section = split_file(data_path.read_bytes())
    header["model/w"]["data_offsets"] = [0, 48]  # overlaps model/b (int64, laid out first)
    crafted = join_file(header, section)
    data_path.write_bytes(crafted)
    manifest = _manifest_of(store, 20)
    manifest["files"]["rank-0.safetensors"] = {
        "size": len(crafted),
        "sha256": hashlib.sha256(crafted).hexdigest(),
    }
    _publish(manifest_path, manifest)

    verdict = store.verify(20)
    assert not verdict.valid
    assert "overlaps" in verdict.reason
    assert str(data_path) in verdict.reason
    assert store.newest_valid() == 10
    assert_same_state(store.load(10), small_state(10.0))


# --- property: any manifest gives a verdict, never an exception ----------------------------------------

_SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
_JSON = st.recursive(
    _SCALARS,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=10,
)
_PLACES: list[tuple[str, ...]] = [
    ("format",), ("step",), ("epoch",), ("rank",), ("world_size",), ("time",), ("files",), ("loss",),
    ("files", "rank-0.safetensors"), ("files", "rank-0.safetensors", "size"),
    ("files", "rank-0.safetensors", "sha256"), ("files", "extra"),
]  # fmt: skip


def _mutated(manifest: dict[str, Any], edits: list[tuple[tuple[str, ...], Any]]) -> Any:
    """``manifest`` with each (place, value) edit applied (the value None-or-junk; ``...``: delete)."""
    document: dict[str, Any] = json.loads(json.dumps(manifest))
    for place, value in edits:
        node: Any = document
        for part in place[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            if value is ...:
                node.pop(place[-1], None)
            else:
                node[place[-1]] = value
    return document


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(st.tuples(st.sampled_from(_PLACES), _JSON | st.just(...)), min_size=1, max_size=3),
    raw=st.none() | st.binary(max_size=64),
)
def test_any_manifest_gives_a_verdict_and_the_reader_never_returns_a_broken_checkpoint(
    edits: list[tuple[tuple[str, ...], Any]], raw: bytes | None
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        store = CheckpointStore(Path(directory), keep_clean=5)
        try:
            store.save(10, small_state(10.0), {"loss": 0.5})
            store.save(20, small_state(20.0), {"loss": 0.5})
            _, manifest_path = step_files(store.root, 20)
            mutated = _mutated(_manifest_of(store, 20), edits)
            manifest_path.write_bytes(raw if raw is not None else json.dumps(mutated).encode())
            verdict = store.verify(20)
            newest = store.newest_valid()
            assert newest in (10, 20)
            assert verdict.valid == (newest == 20)
            if verdict.valid:
                assert_same_state(store.load(20), small_state(20.0))
            else:
                assert str(manifest_path) in verdict.reason or str(store.root) in verdict.reason
            store.reference(20)
            store.is_complete(20)
            store.prune()
        finally:
            store.close()


def test_the_untrusted_directory_helpers_read_no_more_than_the_bound(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(b"x" * 5000)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(CheckpointError, match="5000 bytes, more than the 4096"):
            checkpoint_fs.read_small(fd, "big", 4096, str(big))
        assert checkpoint_fs.read_small(fd, "big", 5000, str(big)) == b"x" * 5000
    finally:
        os.close(fd)

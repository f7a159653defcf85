"""trainguard.local.rundir: paths stay inside their roots, each run its own folder, one run per job."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from trainguard.local.launch import RunRefused
from trainguard.local.rundir import (
    LATEST,
    LOCK_NAME,
    CheckpointLock,
    make_dir_inside,
    new_run_folder,
    plain_name,
)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../x", "/abs", "a\0b"])
def test_only_plain_folder_names_are_accepted(name: str) -> None:
    with pytest.raises(RunRefused, match=r"^spec\.checkpoint\.claimName: "):
        plain_name(name, "spec.checkpoint.claimName")


def test_a_plain_name_passes() -> None:
    assert plain_name("team.ckpt-1", "what") == "team.ckpt-1"


def test_a_directory_is_created_inside_its_root(tmp_path: Path) -> None:
    made = make_dir_inside(tmp_path / "root", tmp_path / "root" / "ckpt", "claim")
    assert made == tmp_path / "root" / "ckpt"
    assert made.is_dir()


def test_a_symlink_out_of_the_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "root" / "ckpt").symlink_to(tmp_path / "outside")
    with pytest.raises(RunRefused, match=r"^claim: .* leads outside"):
        make_dir_inside(tmp_path / "root", tmp_path / "root" / "ckpt", "claim")
    (tmp_path / "root" / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(RunRefused, match=r"^claim: cannot create"):
        make_dir_inside(tmp_path / "root", tmp_path / "root" / "dangling", "claim")
    assert not (tmp_path / "nowhere").exists()


def test_a_root_that_cannot_be_created_is_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(RunRefused, match=r"^--checkpoint-root: cannot create"):
        make_dir_inside(tmp_path / "file" / "v", tmp_path / "file" / "v" / "c", "claim", "--checkpoint-root")
    with pytest.raises(RunRefused, match=r"^claim: cannot create"):
        make_dir_inside(tmp_path, tmp_path / "file", "claim", "--checkpoint-root")


def test_a_root_that_is_itself_a_link_is_followed(tmp_path: Path) -> None:
    (tmp_path / "big-disk").mkdir()
    (tmp_path / "root").symlink_to(tmp_path / "big-disk")
    make_dir_inside(tmp_path / "root", tmp_path / "root" / "ckpt", "claim")
    assert (tmp_path / "big-disk" / "ckpt").is_dir()


def test_every_run_gets_a_new_folder_and_latest_follows(tmp_path: Path) -> None:
    folders = [new_run_folder(tmp_path / "runs") for _ in range(3)]
    assert len(set(folders)) == 3
    assert all(f.is_dir() and f.parent == tmp_path / "runs" for f in folders)
    assert (tmp_path / "runs" / LATEST).resolve() == folders[-1]
    assert os.readlink(tmp_path / "runs" / LATEST) == folders[-1].name  # relative: the tree can move


def test_a_latest_that_is_a_real_folder_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "runs" / LATEST).mkdir(parents=True)
    (tmp_path / "runs" / LATEST / "keep").write_text("mine")
    folder = new_run_folder(tmp_path / "runs")
    assert folder.is_dir()
    assert (tmp_path / "runs" / LATEST / "keep").read_text() == "mine"


def test_a_second_lock_on_one_checkpoint_directory_is_refused_naming_the_holder(tmp_path: Path) -> None:
    first, second = CheckpointLock(tmp_path), CheckpointLock(tmp_path)
    first.acquire(job="ml/demo")
    try:
        with pytest.raises(RunRefused) as caught:
            second.acquire(job="ml/demo")
        message = str(caught.value)
        assert f"is in use by another trainguard run: pid {os.getpid()} on {socket.gethostname()}" in message
        assert "(job ml/demo)" in message
        assert second.fd == -1
    finally:
        first.release()
    second.acquire(job="ml/demo")  # free again once the holder let go
    second.release()


@pytest.mark.parametrize(
    "content",
    [b"", b"garbage", b"[]", b'{"pid": "x", "since": 1}', b'{"pid": 1, "since": 1e300}', b'{"pid": 1}'],
)
def test_a_lock_file_with_garbage_still_gives_a_clear_refusal(tmp_path: Path, content: bytes) -> None:
    holder = CheckpointLock(tmp_path)
    holder.acquire(job="a/b")
    try:
        os.pwrite(holder.fd, content.ljust(200), 0)
        os.ftruncate(holder.fd, len(content))
        with pytest.raises(RunRefused, match="is in use by another trainguard run") as caught:
            CheckpointLock(tmp_path).acquire(job="a/b")
        assert "Traceback" not in str(caught.value)
    finally:
        holder.release()


def test_a_dead_holders_gang_is_named_as_what_holds_the_lock(tmp_path: Path) -> None:
    holder = CheckpointLock(tmp_path)
    holder.acquire(job="a/b")
    try:
        record = {"pid": 2**22 + 12345, "host": socket.gethostname(), "since": 0, "job": "a/b"}
        os.ftruncate(holder.fd, 0)
        os.pwrite(holder.fd, json.dumps(record).encode(), 0)
        with pytest.raises(RunRefused, match="has exited, but processes of its gang still hold the lock"):
            CheckpointLock(tmp_path).acquire(job="a/b")
    finally:
        holder.release()


def test_a_lock_path_that_is_a_link_or_a_fifo_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_text("")
    (tmp_path / LOCK_NAME).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RunRefused, match="cannot open the lock"):
        CheckpointLock(tmp_path).acquire(job="a/b")
    (tmp_path / LOCK_NAME).unlink()
    os.mkfifo(tmp_path / LOCK_NAME)
    with pytest.raises(RunRefused, match="is not a regular file"):
        CheckpointLock(tmp_path).acquire(job="a/b")

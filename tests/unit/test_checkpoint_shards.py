"""Sharded checkpoint files: each rank's shards with their global shape and offset, read back by any box
from the files that hold it, and malformed shard metadata refused naming the file."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.support.checkpoints import join_file, split_file
from trainer_sidecar.checkpoint import CheckpointError, data_file_name
from trainer_sidecar.checkpoint import format as checkpoint_format
from trainer_sidecar.checkpoint.shards import CheckpointReader, open_reader
from trainer_sidecar.checkpoint.store import files_to_verify
from trainer_sidecar.tensors.sharding import Box
from trainer_sidecar.tensors.tensorstate import flatten

W = torch.arange(24, dtype=torch.float32).reshape(6, 4)
V = torch.arange(5, dtype=torch.int64) * 10


def write(folder: Path, rank: int, state: dict[str, Any], boxes: dict[str, Box]) -> None:
    skeleton, tensors = flatten(state)
    by_id = {id(t): box for name, box in boxes.items() for t in [state["model"][name]]}
    serialized = checkpoint_format.serialize(skeleton, tensors, [by_id.get(id(t)) for t in tensors])
    data = b"".join(bytes(view) for piece in serialized.pieces for view in piece.views)
    (folder / data_file_name(rank)).write_bytes(data)


def two_rank_checkpoint(folder: Path, second_offset: int = 3) -> None:
    """W split by rows 3+3, V by 3+2, over two ranks' files, with their own data positions."""
    folder.mkdir(exist_ok=True)
    position = {"epoch": 0, "batch": 2, "sample": 16}
    write(
        folder, 0,
        {"model": {"w": W[:3].clone(), "v": V[:3].clone()}, "lr": 0.5, "data": {**position, "seen": 8}},
        {"w": Box((6, 4), (0, 0), (3, 4)), "v": Box((5,), (0,), (3,))},
    )  # fmt: skip
    write(
        folder, 1,
        {"model": {"w": W[3:].clone(), "v": V[3:].clone()}, "data": {**position, "seen": 9}},
        {"w": Box((6, 4), (second_offset, 0), (3, 4)), "v": Box((5,), (3,), (2,))},
    )  # fmt: skip


@contextmanager
def reader(folder: Path, written_by: int = 2) -> Iterator[CheckpointReader]:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with open_reader(fd, str(folder), written_by) as opened:
            yield opened
    finally:
        os.close(fd)


def test_any_box_of_a_sharded_tensor_is_read_from_the_files_that_hold_it(tmp_path: Path) -> None:
    two_rank_checkpoint(tmp_path)
    with reader(tmp_path) as opened:
        state = opened.state(0)
        w, v = state["model"]["w"], state["model"]["v"]
        assert (w.shape, w.dtype, v.shape) == ((6, 4), torch.float32, (5,))
        assert torch.equal(w.read(), W)
        assert torch.equal(v.read(), V)
        # a box across both files, and one inside the second only
        assert torch.equal(w.read(Box((6, 4), (2, 1), (3, 2))), W[2:5, 1:3])
        assert torch.equal(v.read(Box((5,), (4,), (1,))), V[4:])
        assert state["lr"] == 0.5
        assert state["data"]["seen"] == 8
        assert opened.state(1)["data"]["seen"] == 9  # each rank's own position and counters
        newcomer = opened.state(2)  # a rank the writing world did not have: the gang's position only
        assert newcomer["data"] == {"epoch": 0, "batch": 2, "sample": 16}
        with pytest.raises(CheckpointError, match="is \\[6, 4\\], not \\[4, 6\\]"):
            w.read(Box((4, 6), (0, 0), (1, 1)))


def test_shards_that_overlap_or_a_missing_file_of_them_are_refused(tmp_path: Path) -> None:
    two_rank_checkpoint(tmp_path / "missing", second_offset=3)
    two_rank_checkpoint(tmp_path / "overlap", second_offset=2)
    with reader(tmp_path / "overlap") as opened, pytest.raises(CheckpointError, match="overlaps another"):
        opened.state(0)["model"]["w"].read()
    # rank 1's file missing: the shards are not all there
    (tmp_path / "missing" / data_file_name(1)).unlink()
    with reader(tmp_path / "missing") as opened, pytest.raises(CheckpointError, match="missing"):
        opened.state(0)


def test_a_shard_outside_its_global_tensor_is_refused_naming_the_file(tmp_path: Path) -> None:
    write(tmp_path, 0, {"model": {"w": W[:3].clone()}}, {"w": Box((6, 4), (4, 0), (3, 4))})
    expected = r"rank-0.*shard .model/w.: a \[3, 4\] box at \[4, 0\] is not in"
    with pytest.raises(CheckpointError, match=expected):
        checkpoint_format.read_state(tmp_path / data_file_name(0))


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"model/x": {"shape": [6, 4], "offset": [0, 0]}}, "map tensors of the file"),
        ({"model/w": {"shape": [6, 4]}}, "not a shape/offset object"),
        ({"model/w": {"shape": [6, 4, 1], "offset": [0, 0, 0]}}, "is not in"),
        ({"model/w": {"shape": [6, 4], "offset": [-1, 0]}}, "is not in"),
        ({"model/w": {"shape": [6, 4], "offset": [0, True]}}, "is not in"),
    ],
)
def test_a_malformed_shard_table_is_refused_naming_the_file(tmp_path: Path, table: Any, message: str) -> None:
    write(tmp_path, 0, {"model": {"w": W[:3].clone()}}, {"w": Box((6, 4), (0, 0), (3, 4))})
    path = tmp_path / data_file_name(0)
    header, data = split_file(path.read_bytes())
    header["__metadata__"]["shards"] = json.dumps(table)
    path.write_bytes(join_file(header, data))
    with pytest.raises(CheckpointError, match=message):
        checkpoint_format.read_state(path)


@given(world_size=st.integers(1, 8), written_by=st.integers(1, 8))
def test_over_a_gang_every_file_of_a_checkpoint_is_verified_by_some_rank(
    world_size: int, written_by: int
) -> None:
    checked = [files_to_verify(rank, world_size, written_by) for rank in range(world_size)]
    assert set().union(*checked) == set(range(written_by))
    for rank, files in enumerate(checked):
        assert 0 in files
        assert rank >= written_by or rank in files


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ([1 << 40, 4], r"hold 24 of the 4398046511104 elements"),  # 6x4 floats claiming 16 TiB
        ([7, 4], r"hold 24 of the 28 elements"),  # one row no file covers
    ],
)
def test_a_shard_table_claiming_more_than_the_files_hold_is_refused_before_anything_is_allocated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: list[int], message: str
) -> None:
    two_rank_checkpoint(tmp_path)
    for rank in (0, 1):  # both files agree on the damaged global shape
        path = tmp_path / data_file_name(rank)
        header, data = split_file(path.read_bytes())
        table = json.loads(header["__metadata__"]["shards"])
        table["model/w"]["shape"] = shape
        header["__metadata__"]["shards"] = json.dumps(table)
        path.write_bytes(join_file(header, data))
    allocated: list[tuple[int, ...]] = []
    real_empty = torch.empty

    def counting_empty(*size: Any, **kwargs: Any) -> torch.Tensor:
        allocated.append(tuple(size[0]) if size and isinstance(size[0], (tuple, list, torch.Size)) else size)
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", counting_empty)
    with reader(tmp_path) as opened, pytest.raises(CheckpointError, match=message):
        opened.state(0)  # refused from the tables, before the training sees its shape or reads a byte
    assert all(math.prod(size) <= 64 for size in allocated), allocated

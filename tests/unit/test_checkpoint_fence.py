"""Fencing epochs in one process: claims, inheritance, refused saves, and readers that never trust a
checkpoint a fenced writer committed after the fence."""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.support.checkpoints import assert_same_state, small_state
from trainer_sidecar.checkpoint import (
    CheckpointError,
    CheckpointId,
    CheckpointStore,
    EpochOwner,
    FencedError,
    claim_epoch,
    claim_next_epoch,
    step_dir_name,
)
from trainer_sidecar.checkpoint import store as checkpoint_store
from trainer_sidecar.checkpoint import writer as checkpoint_writer
from trainer_sidecar.checkpoint.layout import EPOCH_LIMIT, parse_dir_name
from trainer_sidecar.contract.identity import job_identity, same_job


def tagged(step: int, writer: str) -> dict[str, Any]:
    """A small state that says which writer made it."""
    return {**small_state(float(step)), "writer": writer}


@pytest.fixture
def stores() -> Iterator[list[CheckpointStore]]:
    """Stores a test opens, closed at the end."""
    opened: list[CheckpointStore] = []
    yield opened
    for store in opened:
        with contextlib.suppress(FencedError):
            store.close()


def test_claims_count_up_and_inherit_the_complete_checkpoints_trusted_until_then(
    tmp_path: Path, stores: list[CheckpointStore]
) -> None:
    legacy = CheckpointStore(tmp_path, keep_clean=10)
    partial = CheckpointStore(tmp_path, rank=0, world_size=2, keep_clean=10)
    stores += [legacy, partial]
    legacy.save(10, tagged(10, "legacy"), {})
    legacy.save(20, tagged(20, "legacy"), {})
    partial.save(30, tagged(30, "legacy"), {})  # rank 1 never wrote: incomplete

    first = claim_epoch(tmp_path, EpochOwner(job="ns/train", attempt=1))
    assert first.epoch == 1
    assert first.inherits == [step_dir_name(10), step_dir_name(20)]
    on_disk = json.loads((tmp_path / "epochs" / "epoch-000001.json").read_text())
    assert on_disk["owner"]["job"] == "ns/train"
    assert on_disk["inherits"] == [step_dir_name(10), step_dir_name(20)]

    writer = CheckpointStore(tmp_path, epoch=1, keep_clean=10)
    stores.append(writer)
    ref = writer.save(40, tagged(40, "one"), {})
    assert ref is not None
    assert ref.path == str(tmp_path / "step-0000000040-e000001")

    second = claim_epoch(tmp_path)
    assert second.epoch == 2
    assert second.inherits == [step_dir_name(10), step_dir_name(20), step_dir_name(40, 1)]
    reader = CheckpointStore(tmp_path)
    stores.append(reader)
    assert reader.trusted_ids() == [CheckpointId(10), CheckpointId(20), CheckpointId(40, 1)]
    assert reader.newest_valid_id() == CheckpointId(40, 1)
    assert not reader.verify(30).valid  # incomplete when epoch 1 was claimed: never trusted since


def test_a_fenced_store_refuses_every_save_naming_the_newer_owner(
    tmp_path: Path, stores: list[CheckpointStore]
) -> None:
    claim_epoch(tmp_path)
    old = CheckpointStore(tmp_path, epoch=1)
    stores.append(old)
    assert old.save(10, tagged(10, "old"), {}) is not None
    claim_epoch(tmp_path, EpochOwner(job="ns/other", attempt=3, host="node-7", pid=4242))

    with pytest.raises(FencedError) as caught:
        old.save(20, tagged(20, "old"), {})
    message = str(caught.value)
    assert "epoch 2" in message
    assert "job ns/other attempt 3, pid 4242 on node-7" in message
    assert "epoch 1" in message
    assert caught.value.epoch == 1
    assert caught.value.newer is not None
    assert caught.value.newer.owner.job == "ns/other"
    assert not (tmp_path / step_dir_name(20, 1)).exists()  # refused before its directory was made
    assert old.fenced is caught.value
    with pytest.raises(FencedError):  # every later save, at once
        old.save_async(21, tagged(21, "old"), {})
    assert old.prune() == []  # nor does a fenced store prune

    reader = CheckpointStore(tmp_path)
    stores.append(reader)
    assert reader.newest_valid_id() == CheckpointId(10, 1)  # inherited by epoch 2


def test_another_job_is_refused_a_directory_a_job_claimed_and_the_same_job_is_not(
    tmp_path: Path, stores: list[CheckpointStore]
) -> None:
    # Two jobs given one claim (a shared volume) used to fence each other out, and the later one
    # resumed from the other's weights.
    claim_epoch(tmp_path, EpochOwner(job="train-a", attempt=1))
    first = CheckpointStore(tmp_path, epoch=1)
    stores.append(first)
    with pytest.raises(CheckpointError, match="belongs to job train-a") as caught:
        claim_epoch(tmp_path, EpochOwner(job="train-b", attempt=1))
    assert "not to job train-b" in str(caught.value)
    assert first.save(10, tagged(10, "a"), {}) is not None  # not fenced
    assert sorted(os.listdir(tmp_path / "epochs")) == ["epoch-000001.json"]
    assert claim_epoch(tmp_path, EpochOwner(job="train-a", attempt=2)).epoch == 2  # its next attempt
    assert claim_epoch(tmp_path).epoch == 3  # a writer naming no job (a guardian run by hand) may


def test_a_job_of_the_same_name_in_another_namespace_is_another_job(
    tmp_path: Path, stores: list[CheckpointStore]
) -> None:
    # Issue 19: jobs "train" in namespaces "team-a" and "team-b" pointed at one directory were one job:
    # the second resumed the first's weights and pruned its checkpoints.
    claim_epoch(tmp_path, EpochOwner(job=job_identity("team-a", "train"), attempt=1))
    first = CheckpointStore(tmp_path, epoch=1)
    stores.append(first)
    assert first.save(10, tagged(10, "a"), {}) is not None
    with pytest.raises(CheckpointError, match="belongs to job team-a/train") as caught:
        claim_epoch(tmp_path, EpochOwner(job=job_identity("team-b", "train"), attempt=1))
    assert "not to job team-b/train" in str(caught.value)
    # Nor may a writer that names the job but no namespace pass for it.
    with pytest.raises(CheckpointError, match="belongs to job team-a/train"):
        claim_epoch(tmp_path, EpochOwner(job=job_identity("", "train"), attempt=1))
    assert sorted(os.listdir(tmp_path / "epochs")) == ["epoch-000001.json"]
    assert first.save(20, tagged(20, "a"), {}) is not None  # not fenced
    assert claim_epoch(tmp_path, EpochOwner(job=job_identity("team-a", "train"), attempt=2)).epoch == 2


def test_a_claim_naming_the_job_alone_is_upgraded_by_a_job_of_that_name(tmp_path: Path) -> None:
    # Claims written before namespaces were recorded name the job alone: a job of that name resumes.
    claim_epoch(tmp_path, EpochOwner(job="train", attempt=1))
    with pytest.raises(CheckpointError, match="belongs to job train"):
        claim_epoch(tmp_path, EpochOwner(job=job_identity("team-a", "other"), attempt=1))
    upgraded = claim_epoch(tmp_path, EpochOwner(job=job_identity("team-a", "train"), attempt=2))
    assert upgraded.owner.job == "team-a/train"
    on_disk = json.loads((tmp_path / "epochs" / "epoch-000002.json").read_text())
    assert on_disk["owner"]["job"] == "team-a/train"
    # From then on the namespace counts.
    with pytest.raises(CheckpointError, match="belongs to job team-a/train"):
        claim_epoch(tmp_path, EpochOwner(job=job_identity("team-b", "train"), attempt=1))


@pytest.mark.parametrize(
    ("holder", "claimant", "same"),
    [
        ("ns/train", "ns/train", True),
        ("ns/train", "other/train", False),
        ("ns/train", "ns/train-b", False),
        ("ns/train", "train", False),
        ("train", "ns/train", True),
        ("train", "ns/other", False),
        ("", "ns/train", True),
        ("ns/train", "", True),
    ],
)
def test_jobs_are_the_same_by_namespace_and_name(holder: str, claimant: str, same: bool) -> None:
    assert same_job(holder, claimant) is same


def test_a_job_identity_is_namespace_and_name() -> None:
    assert job_identity("team-a", "train") == "team-a/train"
    assert job_identity("", "train") == "train"
    assert job_identity("team-a", "") == ""


def test_a_writer_without_an_epoch_or_with_an_unclaimed_one_is_fenced(
    tmp_path: Path, stores: list[CheckpointStore]
) -> None:
    legacy = CheckpointStore(tmp_path)
    stores.append(legacy)
    assert legacy.save(1, tagged(1, "legacy"), {}) is not None  # no epoch claimed yet: epoch 0 writes
    claim_epoch(tmp_path)
    with pytest.raises(FencedError, match="superseded this writer's epoch 0"):
        legacy.save(2, tagged(2, "legacy"), {})
    unclaimed = CheckpointStore(tmp_path, epoch=5)
    stores.append(unclaimed)
    with pytest.raises(FencedError, match="epoch 5 was never claimed"):
        unclaimed.save(3, tagged(3, "unclaimed"), {})


def test_a_writer_that_misses_the_fence_is_never_trusted_after_it(
    tmp_path: Path, stores: list[CheckpointStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An old gang that cannot see the fence (a partitioned node, a stale NFS cache) keeps committing:
    no reader ever picks what it committed after the newer claim, and pruning does not count it."""
    claim_epoch(tmp_path)
    old = CheckpointStore(tmp_path, epoch=1, keep_clean=2)
    stores.append(old)
    old.save(10, tagged(10, "old"), {})
    claim_epoch(tmp_path)
    new = CheckpointStore(tmp_path, epoch=2, keep_clean=2)
    stores.append(new)

    with monkeypatch.context() as blind:
        blind.setattr(checkpoint_store, "check_fence", lambda *args: None)
        assert old.save(20, tagged(20, "old"), {}) is not None
        assert old.save(30, tagged(30, "old"), {}) is not None
    assert (tmp_path / step_dir_name(30, 1)).is_dir()

    reader = CheckpointStore(tmp_path)
    stores.append(reader)
    assert reader.trusted_ids() == [CheckpointId(10, 1)]
    assert reader.newest_valid() == 10
    verdict = reader.verify(CheckpointId(30, 1))
    assert not verdict.valid
    assert "not trusted" in verdict.reason
    assert not reader.verify(30).valid  # by step: no trusted checkpoint of step 30

    new.save(15, tagged(15, "new"), {})
    new.save(25, tagged(25, "new"), {})
    new.wait_for_pruning()
    # keep_clean 2 counts trusted checkpoints only: 15 and 25 are kept, 10 (older) pruned; the untrusted
    # 20 and 30 of epoch 1 are newer than the oldest kept, so they stay until they are older.
    assert new.ids() == [CheckpointId(15, 2), CheckpointId(20, 1), CheckpointId(25, 2), CheckpointId(30, 1)]
    assert reader.newest_valid_id() == CheckpointId(25, 2)
    assert_same_state(reader.load(25), tagged(25, "new"))
    new.save(35, tagged(35, "new"), {})
    new.wait_for_pruning()
    assert new.ids() == [CheckpointId(25, 2), CheckpointId(30, 1), CheckpointId(35, 2)]


def test_one_step_under_two_epochs_is_two_checkpoints_ordered_by_epoch(
    tmp_path: Path, stores: list[CheckpointStore]
) -> None:
    claim_epoch(tmp_path)
    first = CheckpointStore(tmp_path, epoch=1, keep_clean=5)
    stores.append(first)
    first.save(10, tagged(10, "first"), {})
    claim_epoch(tmp_path)
    second = CheckpointStore(tmp_path, epoch=2, keep_clean=5)
    stores.append(second)
    second.save(10, tagged(10, "second"), {})  # resumed from an older state and reached step 10 again

    assert second.trusted_ids() == [CheckpointId(10, 1), CheckpointId(10, 2)]
    assert second.resolve(10) == CheckpointId(10, 2)
    assert second.newest_valid_id() == CheckpointId(10, 2)
    assert second.newest_valid_id(at_most=CheckpointId(10, 1)) == CheckpointId(10, 1)
    assert second.load(10)["writer"] == "second"
    assert second.load(CheckpointId(10, 1))["writer"] == "first"
    assert second.verify(CheckpointId(10, 1)).valid
    ref = second.reference(CheckpointId(10, 1))
    assert ref is not None
    assert ref.path == str(tmp_path / step_dir_name(10, 1))


def test_a_commit_that_races_a_claim_is_reported_fenced(
    tmp_path: Path, stores: list[CheckpointStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newer epoch claimed between the commit and the writer's look after it: not reported a success."""
    claim_epoch(tmp_path)
    store = CheckpointStore(tmp_path, epoch=1)
    stores.append(store)
    real_write_small = checkpoint_writer.write_small

    def commit_then_claim(dir_fd: int, name: str, payload: bytes) -> None:
        real_write_small(dir_fd, name, payload)
        if name.endswith(".json"):
            claim_epoch(tmp_path, EpochOwner(job="racer"))

    monkeypatch.setattr(checkpoint_writer, "write_small", commit_then_claim)
    with pytest.raises(FencedError, match="racer"):
        store.save(10, tagged(10, "store"), {})
    assert store.last_clean is None


def _tear(claim: Path, how: str) -> None:
    """Leave at ``claim`` what a crash, a full disk or a stranger leaves where a claim should be."""
    claim.unlink(missing_ok=True)
    if how == "empty":
        claim.write_bytes(b"")
    elif how == "cut short":
        claim.write_text('{"epoch": 3, "owner": {"job": "", "attem')
    elif how == "garbage":
        claim.write_bytes(os.urandom(300))
    elif how == "directory":
        claim.mkdir()
    elif how == "link":
        claim.symlink_to(claim.parent / "epoch-000001.json")
    else:
        raise AssertionError(how)


TEARS = ["empty", "cut short", "garbage", "directory", "link"]


@pytest.mark.parametrize("how", TEARS)
def test_an_unreadable_newest_claim_falls_back_to_the_newest_readable_one_and_keeps_the_history(
    tmp_path: Path, stores: list[CheckpointStore], how: str
) -> None:
    claim_epoch(tmp_path)
    first = CheckpointStore(tmp_path, epoch=1, keep_clean=2)
    stores.append(first)
    first.save(10, tagged(10, "first"), {})
    claim_epoch(tmp_path)
    second = CheckpointStore(tmp_path, epoch=2, keep_clean=2)
    stores.append(second)
    second.save(20, tagged(20, "second"), {})
    claim_epoch(tmp_path)  # epoch 3: its claimer dies, or the disk fills, while the claim is written
    _tear(tmp_path / "epochs" / "epoch-000003.json", how)

    reader = CheckpointStore(tmp_path)
    stores.append(reader)
    fence = reader.fence()
    assert (fence.highest, fence.record, fence.passed_over) == (3, None, (3,))
    assert fence.fallback is not None
    assert fence.fallback.epoch == 2
    damage = fence.damage(tmp_path)
    assert damage is not None
    assert "epoch-000003.json" in damage
    assert "newest readable claim, epoch 2" in damage
    assert reader.trusted_ids() == [CheckpointId(10, 1), CheckpointId(20, 2)]
    assert reader.newest_valid_id() == CheckpointId(20, 2)

    # The next claim inherits the history, so a start after it resumes and its pruning keeps the newest.
    claim = claim_next_epoch(tmp_path)
    assert claim.record.epoch == 4
    assert claim.over.damage(tmp_path) == damage
    assert claim.record.inherits == [step_dir_name(10, 1), step_dir_name(20, 2)]
    fourth = CheckpointStore(tmp_path, epoch=4, keep_clean=2)
    stores.append(fourth)
    fourth.save(30, tagged(30, "fourth"), {})
    fourth.wait_for_pruning()
    assert fourth.trusted_ids() == [CheckpointId(20, 2), CheckpointId(30, 4)]


def test_with_no_readable_claim_every_checkpoint_up_to_the_highest_epoch_is_trusted(
    tmp_path: Path, stores: list[CheckpointStore]
) -> None:
    claim_epoch(tmp_path)
    first = CheckpointStore(tmp_path, epoch=1)
    stores.append(first)
    first.save(10, tagged(10, "first"), {})
    claim_epoch(tmp_path)
    for epoch in (1, 2):
        _tear(tmp_path / "epochs" / f"epoch-00000{epoch}.json", "empty")
    reader = CheckpointStore(tmp_path)
    stores.append(reader)
    assert reader.fence().passed_over == (2, 1)
    assert reader.fence().fallback is None
    assert reader.newest_valid_id() == CheckpointId(10, 1)


def test_a_store_whose_pruning_is_held_deletes_nothing(tmp_path: Path, stores: list[CheckpointStore]) -> None:
    store = CheckpointStore(tmp_path, keep_clean=1)
    stores.append(store)
    store.hold_pruning("this start passed over damage")
    for step in (1, 2, 3):
        store.save(step, tagged(step, "held"), {})
    store.wait_for_pruning()
    assert store.prune() == []
    assert store.steps() == [1, 2, 3]


def test_a_claim_at_the_epoch_limit_is_refused_naming_the_directory_and_nothing_is_claimed(
    tmp_path: Path,
) -> None:
    claim_epoch(tmp_path)
    last = tmp_path / "epochs" / f"epoch-{EPOCH_LIMIT - 1:06d}.json"
    record = json.loads((tmp_path / "epochs" / "epoch-000001.json").read_text())
    last.write_text(json.dumps({**record, "epoch": EPOCH_LIMIT - 1}))
    before = sorted(p.name for p in (tmp_path / "epochs").iterdir())
    with pytest.raises(CheckpointError, match=f"checkpoint directory {tmp_path}: epoch {EPOCH_LIMIT - 1}"):
        claim_epoch(tmp_path)
    assert sorted(p.name for p in (tmp_path / "epochs").iterdir()) == before


def test_a_claim_the_disk_refuses_is_a_checkpoint_error_and_leaves_no_claim_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim_epoch(tmp_path)

    def no_links(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    real_write_all = checkpoint_writer.write_all
    calls = []

    def full_after_the_temp_file(fd: int, views: Any) -> None:
        calls.append(fd)
        if len(calls) > 1:  # the claim written in place: the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write_all(fd, views)

    monkeypatch.setattr(os, "link", no_links)
    monkeypatch.setattr(checkpoint_writer, "write_all", full_after_the_temp_file)
    with pytest.raises(
        CheckpointError, match=f"checkpoint directory {tmp_path}: no epoch claimed: .*No space"
    ):
        claim_epoch(tmp_path)
    assert sorted(p.name for p in (tmp_path / "epochs").iterdir()) == ["epoch-000001.json"]


@given(
    a=st.tuples(st.integers(0, 10**11), st.integers(0, EPOCH_LIMIT - 1)),
    b=st.tuples(st.integers(0, 10**11), st.integers(0, EPOCH_LIMIT - 1)),
)
def test_packed_identities_order_as_step_then_epoch_and_unpack(
    a: tuple[int, int], b: tuple[int, int]
) -> None:
    first, second = CheckpointId(*a), CheckpointId(*b)
    assert (first < second) == (first.packed < second.packed) == (a < b)
    assert CheckpointId.unpack(first.packed) == first
    assert first.packed < 2**63
    packed = torch.tensor([first.packed, second.packed], dtype=torch.int64)
    assert CheckpointId.unpack(int(packed.min().item())) == min(first, second)


@given(step=st.integers(0, 10**12), epoch=st.integers(0, EPOCH_LIMIT - 1))
def test_directory_names_round_trip_and_only_canonical_names_parse(step: int, epoch: int) -> None:
    checkpoint = CheckpointId(step, epoch)
    assert parse_dir_name(checkpoint.dir_name) == checkpoint
    assert parse_dir_name(checkpoint.dir_name + "x") is None
    legacy = CheckpointId(step)
    assert parse_dir_name(f"step-{step}") == (legacy if step >= 10**9 else None)  # not zero-padded
    assert parse_dir_name(f"step-{step:011d}") == (legacy if step >= 10**10 else None)  # padded too far
    assert parse_dir_name(f"step-{step:010d}-e000000") is None  # epoch 0 has no suffix
    if epoch < 10**6:
        assert parse_dir_name(f"step-{step:010d}-e{epoch:07d}") is None  # padded too far


def test_claims_work_on_a_file_system_without_hard_links(
    tmp_path: Path, stores: list[CheckpointStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    assert [claim_epoch(tmp_path).epoch for _ in range(3)] == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "epochs").iterdir()) == [
        "epoch-000001.json",
        "epoch-000002.json",
        "epoch-000003.json",
    ]
    reader = CheckpointStore(tmp_path)
    stores.append(reader)
    assert reader.fence().highest == 3
    assert reader.fence().record is not None

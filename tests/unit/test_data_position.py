"""The data position in samples: a gang of another world size or batch size resumes at the same sample
of the epoch's order, neither repeating nor skipping one, and dead letters follow the samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from trainer_sidecar.guardian.data import DeadLetters, GuardedLoader
from trainer_sidecar.guardian.feed import taken_over


def dataset(n: int) -> list[torch.Tensor]:
    return [torch.tensor([float(i)]) for i in range(n)]


def take(loader: GuardedLoader, batches: int) -> list[int]:
    """Sample ids of the next ``batches`` batches (or to the end of the epoch)."""
    seen: list[int] = []
    for number, batch in enumerate(loader):
        seen += batch.sample_ids
        if number + 1 == batches:
            break
    return seen


def gang(n: int, world: int, batch_size: int, seed: int = 7) -> list[GuardedLoader]:
    data = dataset(n)
    return [
        GuardedLoader(data, batch_size=batch_size, seed=seed, rank=r, world_size=world) for r in range(world)
    ]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(24, 90),
    old=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    new=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    consumed=st.integers(0, 6),
)
def test_a_resumed_gang_of_another_size_continues_at_the_same_sample(
    n: int, old: tuple[int, int], new: tuple[int, int], consumed: int
) -> None:
    (old_world, old_bs), (new_world, new_bs) = old, new
    before = gang(n, old_world, old_bs)
    consumed = min(consumed, before[0].batches_per_epoch)
    first = [i for loader in before for i in take(loader, consumed)] if consumed else []
    saved = before[0].state_dict()
    if consumed == before[0].batches_per_epoch:  # the epoch's end: the position is the next one's start
        assert (saved["epoch"], saved["sample"]) == (1, 0)
        return
    assert saved["sample"] == consumed * old_world * old_bs
    after = gang(n, new_world, new_bs)
    for loader in after:
        loader.load_state_dict(saved)
    end = after[0].position.start + after[0].batches_in(0) * new_world * new_bs
    rest = [i for loader in after for i in take(loader, -1)]
    assert not set(first) & set(rest)  # nothing seen twice
    assert len(first) + len(rest) == len(set(first) | set(rest))
    # nothing skipped: every sample of the order up to the last full batch of the new gang was taken
    order = after[0]._order(0)
    assert order is not None
    assert sorted(first + rest) == sorted(int(i) for i in order.at(torch.arange(end).numpy()))
    assert n - end < new_world * new_bs  # only a partial last batch is left out
    assert all(loader.position.epoch == 1 and loader.position.start == 0 for loader in after)


def test_the_same_gang_resumes_at_the_same_batch_with_or_without_the_sample() -> None:
    loader = gang(64, 2, 4)[1]
    take(loader, 3)
    saved = loader.state_dict()
    expected = take(loader, 2)
    for state in (saved, {k: v for k, v in saved.items() if k != "sample"}):  # an older checkpoint's
        again = gang(64, 2, 4)[1]
        again.load_state_dict(state)
        assert again.position.batch == 3
        assert again.position.start == 0
        assert take(again, 2) == expected


def test_a_sample_outside_the_dataset_is_refused() -> None:
    loader = gang(32, 1, 4)[0]
    with pytest.raises(ValueError, match="sample 33 is outside a dataset of 32"):
        loader.load_state_dict({"epoch": 0, "batch": 0, "sample": 33})


def test_a_dead_batch_of_one_world_size_is_skipped_by_another(tmp_path: Path) -> None:
    path = tmp_path / "dead-letter.jsonl"
    writer = gang(64, 2, 4)[0]
    # batch 1 of the 2-rank gang covers positions [8, 16) of epoch 0's order
    assert writer.span(0, 1) == (8, 16)
    DeadLetters(path).add(0, 1, write=True, span=writer.span(0, 1), kind="non-finite")
    dead = DeadLetters(path)
    dead.load()
    assert dead.skip == set()  # an entry with a span is keyed by its samples, not its batch number
    data = dataset(64)
    single = GuardedLoader(data, batch_size=4, seed=7, dead_letters=dead)
    # the 1-rank gang's batches 2 and 3 are the positions [8, 12) and [12, 16): both skipped
    assert [dead.is_dead(0, b, single.span(0, b)) for b in range(5)] == [False, False, True, True, False]
    order = single._order(0)
    assert order is not None
    taken = take(single, -1)
    assert not set(taken) & {int(i) for i in order.at(torch.arange(8, 16).numpy())}
    assert len(taken) == 64 - 8


def test_a_dead_letter_without_a_span_is_taken_by_its_batch_number(tmp_path: Path) -> None:
    path = tmp_path / "dead-letter.jsonl"
    path.write_text('{"epoch": 0, "batch": 2}\nnot json\n')
    dead = DeadLetters(path)
    dead.load()
    assert dead.is_dead(0, 2, (100, 200))
    assert not dead.is_dead(0, 3, (0, 1000))
    assert not dead.is_dead(1, 2)


def _plain_epochs(source: torch.utils.data.DataLoader[Any], epochs: int) -> list[list[list[int]]]:
    """Per epoch, the sample ids of each batch a plain loop over ``source`` trains."""
    result = []
    for epoch in range(epochs):
        if isinstance(source.sampler, DistributedSampler):
            source.sampler.set_epoch(epoch)
        result.append([batch[0].tolist() for batch in source])
    return result


def _guarded(source: torch.utils.data.DataLoader[Any], rank: int, world: int) -> GuardedLoader:
    """The guardian's loader for ``source`` on ``rank`` of ``world`` (what ``Guardian.loader`` builds)."""
    over = taken_over(source)
    return GuardedLoader(
        over.dataset,
        batch_size=over.batch_size,
        shuffle=over.shuffle,
        collate_fn=over.collate_fn,
        rank=rank,
        world_size=world,
        drop_last=over.drop_last,
        pad_shards=over.pad_shards,
    )


def _guarded_epochs(loader: GuardedLoader, epochs: int) -> list[list[list[int]]]:
    result: list[list[list[int]]] = []
    while len(result) < epochs:
        result.append([batch.data[0].tolist() for batch in loader])
    return result


@pytest.mark.parametrize("n", [50, 23])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("world", "sampler_drops"), [(1, False), (2, False), (2, True)])
def test_a_taken_over_dataloader_trains_the_samples_the_plain_one_would(
    n: int, shuffle: bool, drop_last: bool, world: int, sampler_drops: bool
) -> None:
    # With shuffle=False the last partial batch (samples 48 and 49 of 50) was never trained, in any epoch.
    data = torch.utils.data.TensorDataset(torch.arange(n))
    plain, guarded = [], []
    for rank in range(world):
        sampler: Any = None
        if world > 1:
            sampler = DistributedSampler(data, world, rank, shuffle=shuffle, drop_last=sampler_drops)
        source = torch.utils.data.DataLoader(
            data,
            batch_size=8,
            shuffle=shuffle if sampler is None else None,
            sampler=sampler,
            drop_last=drop_last,
        )
        plain.append(_plain_epochs(source, 3))
        guarded.append(_guarded_epochs(_guarded(source, rank, world), 3))
    for epoch in range(3):
        for rank in range(world):
            sizes = [len(b) for b in plain[rank][epoch]]
            assert [len(b) for b in guarded[rank][epoch]] == sizes  # ranks stay in step: same batches
        plain_ids = sorted(i for rank in range(world) for b in plain[rank][epoch] for i in b)
        guarded_ids = sorted(i for rank in range(world) for b in guarded[rank][epoch] for i in b)
        if not shuffle:
            assert guarded == plain  # the very same batches, in the same order, on every rank
        elif drop_last or sampler_drops:
            assert len(guarded_ids) == len(plain_ids)  # which samples an epoch drops is the order's
        else:
            assert set(guarded_ids) == set(range(n))  # every sample, the padding repeats a few
            assert len(guarded_ids) == len(plain_ids)


def _batches(loader: GuardedLoader, count: int) -> list[tuple[int, list[int]]]:
    """The next ``count`` batches, across epochs, as (epoch, sample ids); stops right after the last."""
    taken: list[tuple[int, list[int]]] = []
    while len(taken) < count:
        for batch in loader:
            taken.append((batch.epoch, batch.data[0].tolist()))
            if len(taken) == count:
                break
    return taken


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_resume_after_any_batch_continues_exactly_even_at_an_epoch_end(drop_last: bool) -> None:
    data = torch.utils.data.TensorDataset(torch.arange(50))
    source = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, drop_last=drop_last)
    per_epoch = 6 if drop_last else 7  # 50 = 6 * 8 + 2
    straight = _batches(_guarded(source, 0, 1), 3 * per_epoch)
    assert [epoch for epoch, _ in straight] == [e for e in range(3) for _ in range(per_epoch)]
    for cut in range(1, 2 * per_epoch + 1):
        first = _guarded(source, 0, 1)
        assert _batches(first, cut) == straight[:cut]
        state = first.state_dict()
        if cut % per_epoch == 0:  # right after an epoch's last batch: the next epoch's start
            assert (state["epoch"], state["sample"]) == (cut // per_epoch, 0)
        resumed = _guarded(source, 0, 1)
        resumed.load_state_dict(state)
        assert _batches(resumed, 3 * per_epoch - cut) == straight[cut:], cut

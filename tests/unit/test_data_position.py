"""The data position in samples: a gang of another world size or batch size resumes at the same sample
of the epoch's order, neither repeating nor skipping one, and dead letters follow the samples."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_sidecar.guardian.data import DeadLetters, GuardedLoader


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

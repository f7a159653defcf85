"""The computed shuffle: a bijection for any size, seeded, and O(1) memory for a billion samples."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainer_sidecar.guardian.data import GuardedLoader
from trainer_sidecar.guardian.permutation import Permutation


@given(st.integers(1, 5000), st.integers(0, 2**64 - 1))
def test_every_position_maps_to_a_distinct_sample(n: int, seed: int) -> None:
    order = Permutation(n, seed).at(np.arange(n))
    assert sorted(order.tolist()) == list(range(n))


def test_the_order_depends_on_the_seed_and_nothing_else() -> None:
    positions = np.arange(1000)
    first, again = Permutation(1000, 1).at(positions), Permutation(1000, 1).at(positions)
    assert np.array_equal(first, again)
    other = Permutation(1000, 2).at(positions)
    assert (first == other).mean() < 0.05
    assert (first == positions).mean() < 0.05  # it does shuffle


def test_positions_outside_the_range_are_refused() -> None:
    with pytest.raises(IndexError):
        Permutation(10, 0).at([10])
    with pytest.raises(ValueError, match="n <= 2\\^62"):
        Permutation(0, 0)


class Virtual:
    """A dataset of a billion samples that exist only when asked for."""

    def __len__(self) -> int:
        return 1_000_000_000

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index], dtype=torch.int64)


def test_a_billion_samples_cost_no_memory_to_shuffle_and_resume_anywhere() -> None:
    tracemalloc.start()
    try:
        loader = GuardedLoader(Virtual(), batch_size=32, seed=5, rank=1, world_size=4)
        first = next(iter(loader))
        loader.load_state_dict({"epoch": 3, "batch": 7_000_000})
        resumed = next(iter(loader))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20
    assert first.index == 0
    assert resumed.epoch == 3
    assert resumed.index == 7_000_000
    assert list(resumed.sample_ids) == loader.batch_indices(3, 7_000_000)
    assert resumed.data.flatten().tolist() == list(resumed.sample_ids)


def test_ranks_share_out_an_epoch_without_overlap() -> None:
    dataset = list(range(1000))
    ranks = [GuardedLoader(dataset, batch_size=10, seed=3, rank=r, world_size=3) for r in range(3)]
    taken = [
        i for loader in ranks for b in range(loader.batches_per_epoch) for i in loader.batch_indices(0, b)
    ]
    assert len(taken) == len(set(taken)) == 3 * 33 * 10

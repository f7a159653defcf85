"""The named layout of the step's collective: what is packed is what is read back, by name."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_sidecar.guardian.agreement import StepValues, pack, read_local, read_reduced


def _packed(loss: float = 2.5, norm: float = 3.0, pre: float = 4.0, interval: int = 50) -> torch.Tensor:
    return pack(
        torch.tensor(loss, dtype=torch.float32),
        torch.tensor(norm),
        torch.tensor(pre),
        stop=True,
        time_due=False,
        rng_missing=True,
        interval=interval,
    )


def test_a_packed_step_reads_back_by_name() -> None:
    local = _packed()
    assert local.dtype == torch.float64
    assert local.shape == (StepValues.size(),)
    values, locally_nonfinite = read_local(local)
    assert values == StepValues(
        loss=2.5, nonfinite=0.0, norm=3.0, pre_clip_norm=4.0, stop=1.0, time_due=0.0, rng_missing=1.0,
        interval=50.0,
    )  # fmt: skip
    assert not locally_nonfinite
    assert values.as_tuple() == tuple(local.tolist())


def test_a_non_finite_loss_is_flagged_for_this_rank() -> None:
    values, locally_nonfinite = read_local(_packed(loss=math.nan))
    assert math.isnan(values.loss)
    assert values.nonfinite == 1.0
    assert locally_nonfinite


def test_positions_follow_the_names() -> None:
    local = _packed(norm=7.0, interval=9)
    assert local[StepValues.index("norm")].item() == 7.0
    assert local[StepValues.index("interval")].item() == 9.0
    with pytest.raises(KeyError):
        StepValues.index("nope")


def test_a_reduced_step_reads_the_sums_and_this_ranks_own_flag() -> None:
    mine, peer = _packed(loss=math.inf), _packed(loss=1.0, interval=0)
    reduced = mine + peer  # what the collective's sum makes of two ranks
    values, locally_nonfinite = read_reduced(reduced, mine)
    assert (values.nonfinite, values.stop, values.interval) == (1.0, 2.0, 50.0)
    assert (values.norm, values.pre_clip_norm) == (6.0, 8.0)
    assert locally_nonfinite
    _, peer_nonfinite = read_reduced(reduced, peer)
    assert not peer_nonfinite

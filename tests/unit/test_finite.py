"""The finiteness check of a whole training state: the fast screen never passes a non-finite state."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_sidecar.tensors.finite import maybe_nonfinite_flag, nonfinite_flag

_VALUES = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=32),  # up to 3.4e38: squares overflow
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e30, -1e30]),
)
_DTYPES = st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16])


@st.composite
def states(draw: st.DrawFn) -> dict[str, object]:
    tensors = {
        f"t{i}": torch.tensor(draw(st.lists(_VALUES, max_size=40)), dtype=torch.float64).to(draw(_DTYPES))
        for i in range(draw(st.integers(0, 4)))
    }
    return {"tensors": tensors, "plain": draw(st.lists(_VALUES, max_size=3)), "ints": torch.arange(3)}


@given(states())
@settings(max_examples=300, deadline=None)
def test_the_screen_passes_only_finite_states(state: dict[str, object]) -> None:
    exact, screen = nonfinite_flag(state).item(), maybe_nonfinite_flag(state).item()
    assert exact in (0.0, 1.0)
    assert screen in (0.0, 1.0)
    assert screen >= exact  # a non-finite value is never screened out


@given(st.lists(st.floats(-(2.0**49), 2.0**49, width=32), min_size=1, max_size=50))
def test_the_screen_proves_ordinary_finite_states_finite(values: list[float]) -> None:
    # Values a training state holds: the screen alone decides, and the exact check is never needed.
    assert maybe_nonfinite_flag({"w": torch.tensor(values)}).item() == 0.0


def test_a_single_non_finite_value_is_flagged_by_both() -> None:
    for bad in (math.nan, math.inf, -math.inf):
        tensor = torch.zeros(1000)
        tensor[617] = bad
        assert nonfinite_flag([tensor]).item() == 1.0
        assert maybe_nonfinite_flag([tensor]).item() == 1.0


@given(st.lists(st.floats(width=64), max_size=40))
def test_the_exact_check_flags_a_float64_state_exactly_when_a_value_is_not_finite(
    values: list[float],
) -> None:
    # A finite float64 value beyond float32's range (1e300) is finite: judged in its own dtype.
    expected = float(any(not math.isfinite(v) for v in values))
    assert nonfinite_flag({"w": torch.tensor(values, dtype=torch.float64)}).item() == expected

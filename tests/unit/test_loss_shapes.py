"""Every loss a plain ``loss.backward()`` takes the guardian takes, as its scalar; every loss it refuses is
a configuration error naming the loop's line and the reason, on each of the guardian's paths."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_sidecar import ConfigError, ExitCode, Guardian
from trainer_sidecar.contract.status import read_status

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
PATHS = ["backward", "step", "run"]
STEPS = 3


def data() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(
        torch.randn(STEPS * 8, 4, generator=generator), torch.randn(STEPS * 8, 1, generator=generator)
    )


def guarded(status_file: Path, scaled: bool) -> tuple[torch.nn.Module, Guardian]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if scaled else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, Guardian(model, optimizer, scaler=scaler, status_file=status_file, resume=False)


def train(path: str, shape: tuple[int, ...], dtype: torch.dtype, scaled: bool, folder: Path) -> Any:
    """Three steps whose loss has ``shape`` and ``dtype``, on ``path``: the weights, the guardian's
    losses and the outcomes."""
    model, guardian = guarded(folder / f"status-{len(shape)}.json", scaled)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(x), y).to(dtype).reshape(shape)

    loader = torch.utils.data.DataLoader(data(), batch_size=8)
    outcomes = []
    if path == "run":
        for x, y in guardian.run(loader, max_steps=STEPS):
            outcomes.append(guardian.step(loss_of(x, y)))
    else:
        for x, y in loader:
            if path == "backward":
                guardian.backward(loss_of(x[:4], y[:4]))  # two micro-batches
                guardian.backward(loss_of(x[4:], y[4:]))
                outcomes.append(guardian.step())
            else:
                outcomes.append(guardian.step(loss_of(x, y)))
    guardian.close()
    weights = [p.detach().clone() for p in model.parameters()]
    return weights, guardian.losses, [(o.boundary, o.applied, o.reason) for o in outcomes]


@settings(max_examples=30)
@given(
    shape=st.lists(st.just(1), min_size=1, max_size=4).map(tuple),
    dtype=st.sampled_from(FLOATS),
    path=st.sampled_from(PATHS),
    scaled=st.booleans(),
)
def test_a_one_element_loss_of_any_shape_and_floating_dtype_trains_as_its_scalar(
    shape: tuple[int, ...], dtype: torch.dtype, path: str, scaled: bool
) -> None:
    # A loss of shape [1] (which loss.backward() takes) used to end the step with a stack-size
    # RuntimeError: exit code 1, retried until the restarts ran out.
    with tempfile.TemporaryDirectory() as folder:
        weights, losses, outcomes = train(path, shape, dtype, scaled, Path(folder))
        want_weights, want_losses, want_outcomes = train(path, (), dtype, scaled, Path(folder))
    assert outcomes == want_outcomes
    assert all(applied for _, applied, _ in outcomes)
    assert losses == want_losses
    assert len(losses) == STEPS
    for got, want in zip(weights, want_weights, strict=True):
        assert torch.equal(got, want)


def _leaf() -> torch.Tensor:
    return torch.ones((), requires_grad=True)


ONE_VALUE = "must be one value (reduce it, e.g. .mean()), got shape"
A_TENSOR = "must be a torch.Tensor (the output of the forward pass), got"
REFUSED: list[tuple[str, Callable[[torch.Tensor], Any], str]] = [
    ("several elements", lambda loss: loss.expand(4), f"{ONE_VALUE} (4,)"),
    ("no element", lambda loss: loss.reshape(1)[:0], f"{ONE_VALUE} (0,)"),
    ("an integer tensor", lambda loss: torch.tensor(3), "must be of a floating dtype"),
    ("a bool tensor", lambda loss: torch.tensor([True]), "must be of a floating dtype"),
    ("detached", lambda loss: loss.detach(), "does not require grad"),
    ("no grad_fn", lambda loss: _leaf(), "is a leaf tensor (no grad_fn)"),
    ("a Python float", lambda loss: loss.item(), f"{A_TENSOR} float"),
    ("a list", lambda loss: [loss], f"{A_TENSOR} list"),
]  # fmt: skip


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("case", "make", "reason"), REFUSED, ids=[case for case, _, _ in REFUSED])
def test_a_loss_plain_backward_refuses_is_a_configuration_error_naming_the_line(
    path: str, case: str, make: Callable[[torch.Tensor], Any], reason: str, tmp_path: Path
) -> None:
    status_file = tmp_path / "status.json"
    model, guardian = guarded(status_file, scaled=False)
    x, y = data().tensors
    loss = torch.nn.functional.mse_loss(model(x[:8]), y[:8])

    def loop() -> None:
        if path == "backward":
            guardian.backward(make(loss))
        elif path == "step":
            guardian.step(make(loss))
        else:
            for _ in guardian.run(torch.utils.data.DataLoader(data(), batch_size=8), max_steps=STEPS):
                guardian.step(make(loss))

    with pytest.raises(ConfigError) as caught:
        loop()
    assert caught.value.code == ExitCode.CONFIG_ERROR
    message = str(caught.value)
    assert f"the loss given to the guardian ({__file__}:" in message  # the loop's own line
    assert reason in message
    status, _ = read_status(status_file)
    assert status is not None
    assert status.exit_code == ExitCode.CONFIG_ERROR
    assert reason in status.message
    assert all(p.grad is None for p in model.parameters())  # refused before any backward


def test_backward_of_none_is_a_configuration_error(tmp_path: Path) -> None:
    # step(None) is a step without a loss (its own refusal when no backward ran); backward(None) names it.
    _, guardian = guarded(tmp_path / "status.json", scaled=False)
    with pytest.raises(ConfigError, match=r"must be a torch\.Tensor .* got NoneType") as caught:
        guardian.backward(None)  # type: ignore[arg-type]
    assert caught.value.code == ExitCode.CONFIG_ERROR
    _, guardian = guarded(tmp_path / "status.json", scaled=False)
    with pytest.raises(ConfigError, match="without a loss"):
        guardian.step(None)

"""trainguard checkpoints to torch.distributed.checkpoint (DCP) and back, in one process."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from trainer_sidecar import Guardian
from trainer_sidecar.checkpoint import CheckpointError, CheckpointStore
from trainer_sidecar.guardian.counters import GuardCounters
from trainer_sidecar.guardian.dcp import export_dcp, import_dcp
from trainer_sidecar.guardian.training import TrainingObjects
from trainguard import cli


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(3, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def saved_checkpoint(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> CheckpointStore:
    store = CheckpointStore(root)
    state = {
        **TrainingObjects(model, optimizer, None, None).state(),
        "guardian": GuardCounters(1.0, step=7).to_state(),
    }
    assert store.save(7, state, {"loss": 0.5, "state_finite": True, "clean": True}) is not None
    return store


def test_an_export_loads_with_dcp_into_a_name_keyed_optimizer_state(tmp_path: Path) -> None:
    model, optimizer = trained(0)
    store = saved_checkpoint(tmp_path / "ckpt", model, optimizer)
    assert export_dcp(store, None, tmp_path / "dcp") == 7
    target: dict[str, Any] = {
        "model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()},
        "optimizer": {
            "state": {
                name: {k: torch.zeros_like(v) for k, v in optimizer.state[p].items()}
                for name, p in model.named_parameters()
            },
            "param_groups": [{"params": [name for name, _ in model.named_parameters()]}],
        },
    }
    dcp_load(target, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for key, value in model.state_dict().items():
        assert torch.equal(target["model"][key], value)
    for name, param in model.named_parameters():
        assert torch.equal(target["optimizer"]["state"][name]["exp_avg"], optimizer.state[param]["exp_avg"])


def test_an_import_is_refused_unless_the_pickle_is_trusted(tmp_path: Path) -> None:
    model, optimizer = trained(0)
    export_dcp(saved_checkpoint(tmp_path / "ckpt", model, optimizer), 7, tmp_path / "dcp")
    fresh = CheckpointStore(tmp_path / "imported")
    with pytest.raises(CheckpointError, match="pickle"):
        import_dcp(tmp_path / "dcp", fresh, 3)
    assert fresh.newest_valid() is None  # nothing read, nothing written


def test_a_round_trip_through_dcp_restores_the_model_and_optimizer_exactly(tmp_path: Path) -> None:
    model, optimizer = trained(0)
    export_dcp(saved_checkpoint(tmp_path / "ckpt", model, optimizer), 7, tmp_path / "dcp")
    imported = CheckpointStore(tmp_path / "imported")
    assert import_dcp(tmp_path / "dcp", imported, 7, i_trust_this_pickle=True) is not None
    assert imported.verify(7).valid
    other_model, other_optimizer = trained(1)
    TrainingObjects(other_model, other_optimizer, None, None).load(imported.load(7))
    for (key, value), other in zip(
        model.state_dict().items(), other_model.state_dict().values(), strict=True
    ):
        assert torch.equal(value, other), key
    for param, other_param in zip(model.parameters(), other_model.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[param][key], other_optimizer.state[other_param][key])
    assert other_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("metadata", [None, b"", b"\x19garbage" * 40, b"\x80\x04K\x01."])
def test_a_folder_that_is_not_a_dcp_checkpoint_is_refused_naming_it(
    tmp_path: Path, metadata: bytes | None
) -> None:
    (tmp_path / "dcp").mkdir()
    if metadata is not None:  # none, empty, garbage, or a pickle of something else (the number 1)
        (tmp_path / "dcp" / ".metadata").write_bytes(metadata)
    imported = CheckpointStore(tmp_path / "imported")
    with pytest.raises(CheckpointError, match="not a DCP checkpoint"):
        import_dcp(tmp_path / "dcp", imported, 1, i_trust_this_pickle=True)
    assert imported.newest_valid() is None


def test_the_cli_exports_and_imports_only_with_the_pickle_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, optimizer = trained(0)
    saved_checkpoint(tmp_path / "ckpt", model, optimizer)
    assert cli.main(["checkpoint", "export-dcp", str(tmp_path / "ckpt"), str(tmp_path / "dcp")]) == 0
    args = ["checkpoint", "import-dcp", str(tmp_path / "dcp"), str(tmp_path / "imported"), "--step", "9"]
    assert cli.main(args) == 2
    assert "--i-trust-this-pickle" in capsys.readouterr().err
    assert CheckpointStore(tmp_path / "imported").newest_valid() is None
    assert cli.main([*args, "--i-trust-this-pickle"]) == 0
    assert CheckpointStore(tmp_path / "imported").newest_valid() == 9


def test_a_guardian_resumes_an_imported_checkpoint(tmp_path: Path) -> None:
    model, optimizer = trained(0)
    export_dcp(saved_checkpoint(tmp_path / "ckpt", model, optimizer), 7, tmp_path / "dcp")
    import_dcp(tmp_path / "dcp", CheckpointStore(tmp_path / "imported"), 11, i_trust_this_pickle=True)
    other_model, other_optimizer = trained(1)
    guardian = Guardian(other_model, other_optimizer, checkpoint_dir=tmp_path / "imported")
    try:
        assert guardian.resumed_step == 11
        assert guardian.step_count == 11
        for value, other in zip(model.state_dict().values(), other_model.state_dict().values(), strict=True):
            assert torch.equal(value, other)
    finally:
        guardian.close()


@pytest.mark.parametrize("action", ["export-dcp", "import-dcp"])
def test_the_cli_names_a_missing_source_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str
) -> None:
    missing, target = tmp_path / "missing", tmp_path / "target"
    args = ["checkpoint", action, str(missing), str(target)]
    if action == "import-dcp":
        args += ["--step", "1", "--i-trust-this-pickle"]
    assert cli.main(args) == 2
    assert f"{missing}: no such directory" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def titan_style_save(
    model: nn.Module, optimizer: torch.optim.Optimizer, where: Path, *, model_at_top: bool, step: int = 5
) -> None:
    """What a torchtitan-style loop saves: the optimizer flattened by torch's own state-dict API, the model
    at the top level (or under "model"), and beside them states trainguard does not import."""
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model_state = get_model_state_dict(model)
    losses = io.BytesIO()
    torch.save([2.5, 2.25], losses)
    states: dict[str, Any] = {
        **(model_state if model_at_top else {"model": model_state}),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=flat),
        "train_state": {"step": torch.tensor(step, dtype=torch.int32), "global_avg_losses": losses},
        "lr_scheduler": {"last_epoch": step},
    }
    dcp_save(states, checkpoint_id=str(where), no_dist=True)


def with_two_groups(seed: int) -> tuple[nn.Sequential, torch.optim.AdamW]:
    """A small model whose optimizer has two groups (weights decayed, biases not), in another order
    than the model's parameters."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    weights = [model[0].weight, model[2].weight]
    biases = [model[0].bias, model[2].bias]
    groups = [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups, lr=1e-2)


@pytest.mark.parametrize("model_at_top", [True, False], ids=["model-at-top", "model-nested"])
def test_a_torchtitan_style_checkpoint_imports_with_its_step_and_resumes_exactly(
    tmp_path: Path, model_at_top: bool
) -> None:
    model, optimizer = with_two_groups(seed=0)
    for _ in range(3):
        model(torch.randn(3, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    titan_style_save(model, optimizer, tmp_path / "dcp", model_at_top=model_at_top)

    assert (
        import_dcp(tmp_path / "dcp", CheckpointStore(tmp_path / "imported"), None, i_trust_this_pickle=True)
        == 5
    )
    other, other_optimizer = with_two_groups(seed=1)
    guardian = Guardian(other, other_optimizer, checkpoint_dir=tmp_path / "imported")
    try:
        assert guardian.resumed_step == 5
        for (key, value), mine in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
            assert torch.equal(value, mine), key
        for param, mine in zip(optimizer_params(optimizer), optimizer_params(other_optimizer), strict=True):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(optimizer.state[param][key], other_optimizer.state[mine][key]), key
        assert [g["weight_decay"] for g in other_optimizer.param_groups] == [0.1, 0.0]
    finally:
        guardian.close()


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def test_a_weights_only_export_or_one_without_a_step_is_refused_naming_what_is_missing(
    tmp_path: Path,
) -> None:
    model, optimizer = trained(0)
    dcp_save(get_model_state_dict(model), checkpoint_id=str(tmp_path / "weights"), no_dist=True)
    target = CheckpointStore(tmp_path / "imported")
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        import_dcp(tmp_path / "weights", target, 3, i_trust_this_pickle=True)
    export_dcp(saved_checkpoint(tmp_path / "ckpt", model, optimizer), 7, tmp_path / "dcp")
    with pytest.raises(CheckpointError, match=r"no train_state\.step"):
        import_dcp(tmp_path / "dcp", target, None, i_trust_this_pickle=True)
    assert target.newest_valid() is None


@pytest.mark.parametrize("destination", ["a-file", "a-full-folder", "a-link"])
def test_an_export_refuses_a_destination_that_is_not_a_new_or_empty_folder(
    tmp_path: Path, destination: str
) -> None:
    model, optimizer = trained(0)
    store = saved_checkpoint(tmp_path / "ckpt", model, optimizer)
    (tmp_path / "a-file").write_text("precious")
    (tmp_path / "a-full-folder").mkdir()
    (tmp_path / "a-full-folder" / "precious").write_text("precious")
    (tmp_path / "a-link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match="exists and is not an empty folder"):
        export_dcp(store, None, tmp_path / destination)
    assert (tmp_path / "a-file").read_text() == "precious"
    assert [p.name for p in (tmp_path / "a-full-folder").iterdir()] == ["precious"]
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("refusal", ["untrusted pickle", "garbage metadata", "no step", "data file gone"])
def test_every_import_refusal_comes_before_the_target_folder_is_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], refusal: str
) -> None:
    model, optimizer = trained(0)
    export_dcp(saved_checkpoint(tmp_path / "ckpt", model, optimizer), 7, tmp_path / "dcp")
    target = tmp_path / "new" / "target"
    args = ["checkpoint", "import-dcp", str(tmp_path / "dcp"), str(target), "--i-trust-this-pickle"]
    expected = "--i-trust-this-pickle"
    if refusal == "untrusted pickle":
        args.remove("--i-trust-this-pickle")
    elif refusal == "garbage metadata":
        (tmp_path / "dcp" / ".metadata").write_bytes(b"\x80\x04garbage")
        expected = "not a DCP checkpoint"
    elif refusal == "no step":
        expected = "has no train_state.step"  # the export keeps the step in trainguard's counters only
    else:
        for data in (tmp_path / "dcp").glob("*.distcp"):  # DCP's own CheckpointException, a BaseException
            data.unlink()
        expected = r"not a readable DCP checkpoint: rank 0: FileNotFoundError"
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert re.search(expected, err), err
    assert "Traceback" not in err
    assert not (tmp_path / "new").exists()

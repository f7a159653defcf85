"""Guardian settings: documented defaults, camelCase JSON from TRAINGUARD_SETTINGS, precise errors."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer_sidecar.contract.settings import (
    SETTINGS_ENV,
    CheckpointPolicy,
    GuardianSettings,
    GuardThresholds,
    Remediation,
    SettingsError,
    load_settings,
)


def env(document: Any) -> dict[str, str]:
    return {SETTINGS_ENV: document if isinstance(document, str) else json.dumps(document)}


def test_defaults_match_the_documented_defaults() -> None:
    for settings in (load_settings({}), load_settings({SETTINGS_ENV: "  "}), GuardianSettings()):
        assert settings.guard.max_consecutive_bad_steps == 3
        assert settings.guard.max_grad_norm is None  # no clip unless asked
        assert settings.guard.loss_spike_factor == 2.0
        assert settings.guard.loss_spike_window == 100
        assert settings.guard.grad_norm_spike_factor == 5.0
        assert settings.guard.max_rollbacks == 5
        assert settings.checkpoint.keep_clean == 3
        assert settings.checkpoint.every_steps == 2000
        assert settings.checkpoint.snapshot_every_steps == 100
        assert settings.remediation.lr_scale == 0.5
        assert settings.remediation.max_grad_norm == 0.5


def test_camel_case_on_the_wire() -> None:
    dumped = GuardianSettings().model_dump(by_alias=True)
    assert dumped["guard"]["maxConsecutiveBadSteps"] == 3
    assert dumped["guard"]["lossSpikeWindow"] == 100
    assert dumped["checkpoint"]["snapshotEverySteps"] == 100
    assert dumped["remediation"]["lrScale"] == 0.5
    assert "statusIntervalSeconds" in dumped


def test_values_from_the_environment_variable() -> None:
    settings = load_settings(
        env(
            {
                "guard": {"lossSpikeWindow": 50, "maxGradNorm": 2.5, "maxRollbacks": 2},
                "checkpoint": {"keepClean": 5, "everySteps": 10},
                "remediation": {"lrScale": 0.25, "maxGradNorm": None},
                "statusIntervalSeconds": 0,
            }
        )
    )
    assert settings.guard.loss_spike_window == 50
    assert settings.guard.max_grad_norm == 2.5
    assert settings.guard.max_rollbacks == 2
    assert settings.guard.loss_spike_factor == 2.0  # untouched fields keep their defaults
    assert settings.checkpoint == CheckpointPolicy(keep_clean=5, every_steps=10, snapshot_every_steps=100)
    assert settings.remediation == Remediation(lr_scale=0.25, max_grad_norm=None)
    assert settings.status_interval_seconds == 0


def test_the_process_environment_is_the_default_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SETTINGS_ENV, json.dumps({"checkpoint": {"keepClean": 7}}))
    assert load_settings().checkpoint.keep_clean == 7
    monkeypatch.setenv(SETTINGS_ENV, json.dumps({"guard": {"lossSpikeWindow": -1}}))
    with pytest.raises(SettingsError, match=r"guard\.lossSpikeWindow"):
        load_settings()


def test_keyword_overrides_apply_on_top() -> None:
    settings = load_settings(env({"statusIntervalSeconds": 3}), checkpoint={"keepClean": 9})
    assert settings.status_interval_seconds == 3
    assert settings.checkpoint.keep_clean == 9


def test_settings_are_frozen() -> None:
    settings = load_settings({})
    with pytest.raises(ValueError, match="frozen"):
        settings.guard.max_rollbacks = 9  # type: ignore[misc]


@pytest.mark.parametrize(
    ("document", "path"),
    [
        ({"guard": {"lossSpikeWindow": -5}}, "guard.lossSpikeWindow"),
        ({"guard": {"lossSpikeWindow": 0}}, "guard.lossSpikeWindow"),
        ({"guard": {"lossSpikeFactor": 1.0}}, "guard.lossSpikeFactor"),
        ({"guard": {"lossSpikeFactor": 0.5}}, "guard.lossSpikeFactor"),
        ({"guard": {"gradNormSpikeFactor": 1}}, "guard.gradNormSpikeFactor"),
        ({"guard": {"maxGradNorm": 0}}, "guard.maxGradNorm"),
        ({"guard": {"maxGradNorm": float("inf")}}, "guard.maxGradNorm"),
        ({"remediation": {"maxGradNorm": float("nan")}}, "remediation.maxGradNorm"),
        ({"guard": {"maxConsecutiveBadSteps": 0}}, "guard.maxConsecutiveBadSteps"),
        ({"guard": {"maxRollbacks": "many"}}, "guard.maxRollbacks"),
        ({"guard": {"lossSpikeWindw": 100}}, "guard.lossSpikeWindw"),
        ({"guard": {"spikeMinHistory": 20, "lossSpikeWindow": 10}}, "guard"),
        ({"checkpoint": {"keepClean": 0}}, "checkpoint.keepClean"),
        ({"checkpoint": {"everySteps": -1}}, "checkpoint.everySteps"),
        ({"checkpoint": {"retention": 3}}, "checkpoint.retention"),
        ({"remediation": {"lrScale": 0}}, "remediation.lrScale"),
        ({"remediation": {"lrScale": 1.5}}, "remediation.lrScale"),
        ({"remediation": {"maxGradNorm": -0.1}}, "remediation.maxGradNorm"),
        ({"statusIntervalSeconds": -1}, "statusIntervalSeconds"),
        ({"statusIntervalSeconds": 1e308}, "statusIntervalSeconds"),
        ({"guard": {"maxGradNorm": 1e308}}, "guard.maxGradNorm"),
        ({"guard": {"lossSpikeWindow": 10**9}}, "guard.lossSpikeWindow"),
        ({"checkpoint": {"everySteps": 10**30}}, "checkpoint.everySteps"),
        ({"remediation": {"maxGradNorm": 1e7}}, "remediation.maxGradNorm"),
        ({"unknownSection": {}}, "unknownSection"),
        ({"guard": 3}, "guard"),
    ],
)
def test_invalid_values_name_the_variable_and_the_field(document: dict[str, Any], path: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(env(document))
    message = str(caught.value)
    assert message.startswith(f"{SETTINGS_ENV}: {path}: "), message
    assert isinstance(caught.value, ValueError)


def test_every_invalid_field_is_reported() -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(env({"guard": {"lossSpikeWindow": -1, "lossSpikeFactor": 1}, "checkpoint": {"x": 1}}))
    lines = str(caught.value).splitlines()
    assert sorted(line.split(": ")[1] for line in lines) == [
        "checkpoint.x",
        "guard.lossSpikeFactor",
        "guard.lossSpikeWindow",
    ]
    assert all(line.startswith(f"{SETTINGS_ENV}: ") for line in lines)


@pytest.mark.parametrize("text", ["not json", "{'guard': {}}", '{"guard": ', "[1, 2]", "3", '"text"', "null"])
def test_a_value_that_is_not_a_json_object_names_the_variable(text: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings({SETTINGS_ENV: text})
    assert str(caught.value).startswith(f"{SETTINGS_ENV}: ")


def test_invalid_overrides_are_reported_too() -> None:
    with pytest.raises(SettingsError, match=r"guard\.lossSpikeWindow"):
        load_settings({}, guard={"lossSpikeWindow": 0})


@given(window=st.integers(1, 10_000), factor=st.floats(min_value=1.0, max_value=1e6, exclude_min=True))
def test_any_valid_window_and_factor_round_trip(window: int, factor: float) -> None:
    document = {"guard": {"lossSpikeWindow": window, "lossSpikeFactor": factor, "spikeMinHistory": 1}}
    settings = load_settings(env(document))
    assert settings.guard == GuardThresholds(
        loss_spike_window=window, loss_spike_factor=factor, spike_min_history=1
    )
    assert load_settings(env(settings.model_dump(by_alias=True))) == settings


@given(st.integers(max_value=0))
def test_any_non_positive_window_is_rejected(window: int) -> None:
    with pytest.raises(SettingsError, match=rf"^{SETTINGS_ENV}: guard\.lossSpikeWindow: "):
        load_settings(env({"guard": {"lossSpikeWindow": window}}))

"""The sidecar's configuration: one model over flags over environment variables, errors that name both."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainer_sidecar.sidecar.server import (
    MAX_DURATION_SECONDS,
    SETTING_SOURCES,
    SettingsError,
    SidecarServer,
    SidecarSettings,
    load_settings,
    main,
)

STATUS = {"TRAINGUARD_STATUS_FILE": "/run/tg/status.json"}


def test_flags_win_over_environment_over_defaults() -> None:
    environ = {**STATUS, "TRAINGUARD_HANG_TIMEOUT_SECONDS": "45", "TRAINGUARD_SIDECAR_PORT": "9500"}
    settings = load_settings({"hang_timeout_seconds": "60"}, environ)
    assert settings == SidecarSettings(
        status_file=Path("/run/tg/status.json"),
        port=9500,
        hang_timeout_seconds=60.0,
    )
    assert settings.startup_grace_seconds == 600.0
    assert settings.host == "0.0.0.0"


def test_every_field_has_a_flag_and_a_variable() -> None:
    assert set(SETTING_SOURCES) == set(SidecarSettings.model_fields)
    flags = [flag for flag, _ in SETTING_SOURCES.values()]
    envs = [env for _, env in SETTING_SOURCES.values()]
    assert len(set(flags)) == len(flags)
    assert len(set(envs)) == len(envs)
    assert all(env.startswith("TRAINGUARD_") for env in envs)


@pytest.mark.parametrize(
    ("flags", "environ", "message"),
    [
        pytest.param({}, {}, "--status-file (or $TRAINGUARD_STATUS_FILE): is required", id="no-status-file"),
        pytest.param(
            {"port": "x"},
            STATUS,
            "--port (or $TRAINGUARD_SIDECAR_PORT): Input should be a valid integer, unable to parse "
            "string as an integer, got 'x'",
            id="port-not-a-number",
        ),
        pytest.param(
            {},
            {**STATUS, "TRAINGUARD_HANG_TIMEOUT_SECONDS": "1e400"},
            "--hang-timeout-seconds (or $TRAINGUARD_HANG_TIMEOUT_SECONDS): Input should be a finite "
            "number, got '1e400'",
            id="hang-overflows-to-infinity",
        ),
        pytest.param(
            {"hang_timeout_seconds": str(10**12)},
            STATUS,
            "--hang-timeout-seconds (or $TRAINGUARD_HANG_TIMEOUT_SECONDS): Input should be less than or "
            f"equal to {MAX_DURATION_SECONDS:.0f}, got '1000000000000'",
            id="hang-beyond-a-week",
        ),
    ],
)
def test_errors_name_the_flag_and_the_variable(
    flags: dict[str, str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(SettingsError) as raised:
        load_settings(flags, environ)
    assert str(raised.value) == message


def test_the_embeddable_server_validates_the_same_way(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="finite number"):
        SidecarServer(tmp_path / "s", hang_timeout_seconds=float("inf"))
    with pytest.raises(ValueError, match="less than or equal"):
        SidecarServer(tmp_path / "s", startup_grace_seconds=1e12)


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        pytest.param(["--port", "abc"], {}, "--port", id="port-not-a-number"),
        pytest.param(["--port", "-1"], {}, "--port", id="port-negative"),
        pytest.param(["--port", "70000"], {}, "--port", id="port-too-large"),
        pytest.param(["--port", "80.5"], {}, "--port", id="port-fraction"),
        pytest.param([], {"TRAINGUARD_SIDECAR_PORT": "nine"}, "TRAINGUARD_SIDECAR_PORT", id="port-env"),
        pytest.param(["--hang-timeout-seconds", "0"], {}, "--hang-timeout-seconds", id="hang-zero"),
        pytest.param(["--hang-timeout-seconds", "-5"], {}, "--hang-timeout-seconds", id="hang-negative"),
        pytest.param(["--hang-timeout-seconds", "nan"], {}, "--hang-timeout-seconds", id="hang-nan"),
        pytest.param(["--hang-timeout-seconds", "1e400"], {}, "--hang-timeout-seconds", id="hang-1e400"),
        pytest.param(["--hang-timeout-seconds", "1e12"], {}, "--hang-timeout-seconds", id="hang-1e12"),
        pytest.param(
            [], {"TRAINGUARD_HANG_TIMEOUT_SECONDS": "soon"}, "TRAINGUARD_HANG_TIMEOUT_SECONDS", id="hang-env"
        ),
        pytest.param(["--startup-grace-seconds", "-1"], {}, "--startup-grace-seconds", id="grace-negative"),
        pytest.param(["--startup-grace-seconds", "x"], {}, "--startup-grace-seconds", id="grace-nan"),
        pytest.param(["--startup-grace-seconds", "inf"], {}, "--startup-grace-seconds", id="grace-inf"),
        pytest.param(["--host", ""], {}, "--host", id="host-empty"),
        pytest.param(["--host", "   "], {}, "--host", id="host-blank"),
        pytest.param(["--job", ""], {}, "--job", id="job-empty"),
        pytest.param(["--namespace", "n" * 300], {}, "--namespace", id="namespace-too-long"),
        pytest.param(["--status-file", ""], {}, "--status-file", id="no-status-file"),
        pytest.param(["--status-file", "  "], {}, "--status-file", id="blank-status-file"),
        pytest.param(["--bogus"], {}, "--bogus", id="unknown-flag"),
    ],
)
def test_cli_bad_values_exit_2_naming_the_flag(
    argv: list[str],
    env: dict[str, str],
    named: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for key in list(os.environ):
        if key.startswith("TRAINGUARD_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("TRAINGUARD_STATUS_FILE", str(tmp_path / "status.json"))
    for key, val in env.items():
        monkeypatch.setenv(key, val)
    assert main(argv) == 2
    assert named in capsys.readouterr().err


def test_cli_requires_a_status_file(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TRAINGUARD_STATUS_FILE", raising=False)
    assert main(["--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--status-file" in err
    assert "TRAINGUARD_STATUS_FILE" in err

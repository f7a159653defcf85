"""The operator's settings from its environment: what kopf's API retries become, and bad values named."""

from __future__ import annotations

import pytest
from trainguard_operator.settings import MAX_API_RETRIES, OperatorSettings, OperatorSettingsError


def test_kopfs_retries_run_every_retry_interval_for_the_outage_the_operator_rides_out() -> None:
    settings = OperatorSettings.from_env(
        {"TRAINGUARD_OPERATOR_API_RETRY_SECONDS": "2", "TRAINGUARD_OPERATOR_API_OUTAGE_SECONDS": "61"}
    )
    assert settings.api_error_backoffs() == (2.0,) * 31
    # By default ten minutes: kopf's own schedule gave up after 54 s and waited up to 21 s between tries.
    default = OperatorSettings().api_error_backoffs()
    assert sum(default) >= 600
    assert max(default) == 2.0


def test_no_outage_still_retries_once_and_a_tiny_interval_stays_bounded() -> None:
    assert OperatorSettings(api_outage_seconds=0).api_error_backoffs() == (2.0,)
    tiny = OperatorSettings(api_retry_seconds=1e-9, api_outage_seconds=86400).api_error_backoffs()
    assert len(tiny) == MAX_API_RETRIES


@pytest.mark.parametrize("value", ["-1", "inf", "nan", "1e9", "ten"])
def test_a_bad_outage_is_refused_naming_its_variable(value: str) -> None:
    with pytest.raises(OperatorSettingsError, match="TRAINGUARD_OPERATOR_API_OUTAGE_SECONDS"):
        OperatorSettings.from_env({"TRAINGUARD_OPERATOR_API_OUTAGE_SECONDS": value})


@pytest.mark.parametrize("value", ["0", "inf", "nan", "1e9"])
def test_a_bad_retry_interval_is_refused_naming_its_variable(value: str) -> None:
    # An infinite interval would make kopf's first retry of a failed request sleep forever.
    with pytest.raises(OperatorSettingsError, match="TRAINGUARD_OPERATOR_API_RETRY_SECONDS"):
        OperatorSettings.from_env({"TRAINGUARD_OPERATOR_API_RETRY_SECONDS": value})

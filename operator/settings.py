"""The operator's own settings (not a job's): sidecar image, ports, polling, scope.

Every field comes from an environment variable ``TRAINGUARD_OPERATOR_<FIELD>`` (upper case), with the
defaults below; ``python -m trainguard_operator`` flags override the environment. An invalid value is
refused with a message naming the variable, never silently replaced by a default.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

ENV_PREFIX = "TRAINGUARD_OPERATOR_"

#: Fields read as JSON from their variable; list fields are comma-separated; the rest are plain strings.
_JSON_FIELDS = frozenset({"sidecar_resources"})
_LIST_FIELDS = frozenset({"namespaces"})
#: Fields whose value an error never repeats.
_SECRET_FIELDS = frozenset({"order_key"})


def env_name(field: str) -> str:
    """The environment variable that sets ``field``."""
    return ENV_PREFIX + field.upper()


def _default_sidecar_resources() -> dict[str, Any]:
    # The sidecar re-reads a few-hundred-byte file per request: a sliver of CPU. No CPU limit, so a
    # probe is never throttled into a timeout on a node whose training process saturates the cores.
    return {"requests": {"cpu": "50m", "memory": "96Mi"}, "limits": {"memory": "256Mi"}}


#: The most retries of one kopf request (``OperatorSettings.api_error_backoffs``): a tiny retry interval
#: does not make a schedule of millions.
MAX_API_RETRIES = 10_000
#: The shortest order key: 128 bits as hex.
MIN_ORDER_KEY_CHARS = 32


class OperatorSettingsError(ValueError):
    """An operator setting is invalid; the message names its environment variable (or flag)."""


class OperatorSettings(BaseModel):
    """How the operator renders pods, polls sidecars and serves metrics. Immutable once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sidecar_image: str = Field("ghcr.io/trainguard/trainguard:0.1.0", min_length=1)
    sidecar_image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    sidecar_resources: dict[str, Any] = Field(default_factory=_default_sidecar_resources)
    sidecar_run_as_user: int = Field(65532, ge=1, description="Non-root uid the sidecar runs as.")
    #: The sidecar's port in the pod, and the port the operator polls ``/status`` on.
    sidecar_port: int = Field(9400, ge=1, le=65535)
    metrics_host: str = Field("0.0.0.0", min_length=1)
    #: 0 picks a free port (tests).
    metrics_port: int = Field(8080, ge=0, le=65535)
    #: Sidecar requests in flight at once, over all jobs.
    poll_concurrency: int = Field(16, ge=1, le=1024)
    poll_timeout_seconds: float = Field(3.0, gt=0, le=60)
    #: Namespaces to watch; empty means cluster-wide.
    namespaces: list[str] = Field(default_factory=list)
    #: Wait before looking again for a missing PyTorchJob CRD (or retrying a forbidden call).
    crd_retry_seconds: float = Field(60.0, gt=0)
    #: Wait before retrying after a conflict or a transient API error.
    api_retry_seconds: float = Field(2.0, gt=0, le=300)
    #: How long kopf's own requests (its watch of the jobs, its bookkeeping) retry a failing or unreachable
    #: API server, every ``api_retry_seconds``, before the operator exits for its Deployment to restart it.
    #: kopf's default gives up after 54 s (a control-plane upgrade outlasts it) and waits up to 21 s
    #: between tries (the operator comes back that long after the API server).
    api_outage_seconds: float = Field(600.0, ge=0, le=86400)
    #: How long a new attempt waits for the previous attempt's PyTorchJob to be gone before starting anyway.
    stale_attempt_grace_seconds: float = Field(120.0, ge=0)
    #: The key the tokens of restart orders are derived from (``inplace.order_token``); empty: no
    #: restart in place (every restart makes a new PyTorchJob). The chart keeps it in a Secret.
    order_key: SecretStr = Field(SecretStr(""))
    #: Restarts in place one PyTorchJob may host; the next restart makes a new PyTorchJob (fresh pods,
    #: fresh placement). 0: never restart in place.
    in_place_restarts: int = Field(3, ge=0, le=1000)
    #: How long after an attempt restarted in place is due every pod's launcher must report it before the
    #: gang falls back to a new PyTorchJob.
    order_timeout_seconds: float = Field(60.0, gt=0, le=3600)
    #: Keep a warm spare (torch imported) beside each worker for a restart in place, where the worker
    #: container's memory limit leaves room for it (the launcher looks).
    warm_spares: bool = True
    #: The ClusterTrainingRuntime a GuardedTrainingJob's TrainJobs name (the chart's guarded runtime).
    trainjob_runtime: str = Field("trainguard-torch-distributed", min_length=1, max_length=253)
    #: The liveness probe period of that runtime: a TrainJob job must ask for this one.
    trainjob_probe_period_seconds: int = Field(10, ge=1, le=3600)

    @property
    def restarts_in_place(self) -> bool:
        """Whether gangs may be restarted in place (a key is set and the cap allows any)."""
        return bool(self.order_key.get_secret_value()) and self.in_place_restarts > 0

    def api_error_backoffs(self) -> tuple[float, ...]:
        """kopf's ``settings.networking.error_backoffs``: a try every ``api_retry_seconds`` for
        ``api_outage_seconds``, at least one and at most ``MAX_API_RETRIES``."""
        tries = math.ceil(self.api_outage_seconds / self.api_retry_seconds)
        return (self.api_retry_seconds,) * min(max(1, tries), MAX_API_RETRIES)

    @field_validator("sidecar_resources")
    @classmethod
    def _resources_shape(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = set(value) - {"requests", "limits", "claims"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; expected requests and/or limits")
        for key in ("requests", "limits"):
            section = value.get(key, {})
            if not isinstance(section, dict) or not all(
                isinstance(v, str | int | float) for v in section.values()
            ):
                raise ValueError(f"{key} must map resource names to quantities")
        return value

    @field_validator("order_key")
    @classmethod
    def _key_long_enough(cls, value: SecretStr) -> SecretStr:
        key = value.get_secret_value()
        if key and len(key) < MIN_ORDER_KEY_CHARS:
            raise ValueError(f"an order key must be empty or at least {MIN_ORDER_KEY_CHARS} characters")
        return value

    @field_validator("namespaces")
    @classmethod
    def _namespaces_are_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not name or len(name) > 63:
                raise ValueError(f"not a namespace name: {name!r}")
        return value

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
    ) -> OperatorSettings:
        """Settings from ``TRAINGUARD_OPERATOR_*`` variables, then ``overrides`` (already typed) on top.

        Raises OperatorSettingsError naming the offending variable when a value is invalid.
        """
        env = os.environ if environ is None else environ
        raw: dict[str, Any] = {}
        for field in cls.model_fields:
            text = env.get(env_name(field))
            if text is None:
                continue
            if field in _JSON_FIELDS:
                try:
                    raw[field] = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise OperatorSettingsError(f"{env_name(field)}: not valid JSON: {exc}") from exc
            elif field in _LIST_FIELDS:
                raw[field] = [part.strip() for part in text.split(",") if part.strip()]
            else:
                raw[field] = text.strip()
        for key, value in (overrides or {}).items():
            if value is not None:
                raw[key] = value
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            lines = []
            for error in exc.errors():
                field = str(error["loc"][0]) if error["loc"] else ""
                where = env_name(field) if field in cls.model_fields else field or "(settings)"
                got = "" if field in _SECRET_FIELDS else f" (got {error.get('input')!r})"
                lines.append(f"{where}: {error['msg']}{got}")
            raise OperatorSettingsError("\n".join(lines)) from exc

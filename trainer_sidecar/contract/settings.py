"""The guardian's settings: one pydantic model per section, shared with the GuardedTrainingJob spec.

Field names are snake_case in Python and camelCase on the wire (the CRD and the ``TRAINGUARD_SETTINGS``
environment variable), so the same model validates a Kubernetes spec and a local configuration.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from trainer_sidecar.contract.compute import DEFAULT_WINDOW_STEPS, MAX_WINDOW_STEPS

SETTINGS_ENV = "TRAINGUARD_SETTINGS"

# Upper bounds: every count and factor is finite and fits what its consumer can honour. Step counts stay
# within a 32-bit integer (Kubernetes int32 fields, exact in Prometheus' float64) at a billion steps,
# more than any training run takes.
MAX_STEPS = 10**9
#: Factors and gradient norms: beyond a million, clipping or spike detection is switched off in effect.
MAX_FACTOR = 1e6
#: The loss and gradient-norm windows are averaged on every step, so they stay small.
MAX_WINDOW = 10_000
#: Durations: at most a week.
MAX_SECONDS = 7 * 24 * 3600
#: A mean time between failures: at most ten years (a small job on reliable hardware).
MAX_MTBF_SECONDS = 10 * 365 * 24 * 3600
#: ``checkpoint.everySteps: auto``: the interval follows the failure rate (``contract.cadence``).
AUTO = "auto"


class _Section(BaseModel):
    # Non-finite numbers are refused: the worker publishes these values in its status, which must be finite.
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True, allow_inf_nan=False
    )


class GuardThresholds(_Section):
    """When a step counts as bad, and how many bad steps and rollbacks are tolerated."""

    max_consecutive_bad_steps: int = Field(
        3, ge=1, le=MAX_STEPS, description="Bad steps in a row before a rollback (at most 10^9)."
    )
    max_grad_norm: float | None = Field(
        None,
        gt=0,
        le=MAX_FACTOR,
        description="Gradients are clipped to this total L2 norm (null, the default: no clipping, so a "
        "healthy loop trains as it did; at most 10^6). A remediation after a divergence may still "
        "tighten it, and says so.",
    )
    loss_spike_factor: float = Field(
        2.0,
        gt=1,
        le=MAX_FACTOR,
        description="A loss above this multiple of the recent mean is a spike (at most 10^6).",
    )
    loss_spike_window: int = Field(
        100,
        ge=1,
        le=MAX_WINDOW,
        description="How many recent finite losses form the mean (at most 10,000: averaged every step).",
    )
    grad_norm_spike_factor: float = Field(
        5.0,
        gt=1,
        le=MAX_FACTOR,
        description="A gradient norm above this multiple of the recent mean is a spike (at most 10^6).",
    )
    spike_min_history: int | None = Field(
        None,
        ge=1,
        le=MAX_WINDOW,
        description="Spike detection starts once this many finite steps are in the window (null, the "
        "default: a full lossSpikeWindow; early training's gradient norms swing too much to judge against "
        "a few steps).",
    )
    max_rollbacks: int = Field(
        5, ge=1, le=MAX_STEPS, description="Rollbacks tolerated within rollbackWindowSteps (at most 10^9)."
    )
    rollback_window_steps: int = Field(
        2000,
        ge=1,
        le=MAX_STEPS,
        description="The window, in steps, over which rollbacks are counted (at most 10^9).",
    )

    @property
    def spike_history(self) -> int:
        """How many finite steps the window needs before spikes are judged."""
        return self.loss_spike_window if self.spike_min_history is None else self.spike_min_history

    @model_validator(mode="after")
    def _min_history_fits_window(self) -> GuardThresholds:
        if self.spike_min_history is not None and self.spike_min_history > self.loss_spike_window:
            raise ValueError("spikeMinHistory must not exceed lossSpikeWindow")
        return self


class CheckpointPolicy(_Section):
    """How often state is snapshotted in memory and written to the checkpoint volume."""

    keep_clean: int = Field(
        3,
        ge=1,
        le=1000,
        description="Clean disk checkpoints kept; the newest is never deleted (at most 1000: each is "
        "listed and verified on every start).",
    )
    every_steps: int | Literal["auto"] = Field(
        2000,
        description='A disk checkpoint every this many steps (1 to 10^9), or "auto": the interval that '
        "loses the least time to saves and failures, sqrt(2 x save stall x MTBF) in measured step times "
        "(Young-Daly), within autoMinSteps and autoMaxSteps, the first after autoFirstSeconds.",
        json_schema_extra={
            "x-kubernetes-int-or-string": True,
            "x-kubernetes-validations": [
                {
                    "rule": "type(self) == string ? self == 'auto' : (self >= 1 && self <= 1000000000)",
                    "message": 'everySteps must be a positive integer (at most 10^9) or "auto"',
                }
            ],
        },
    )
    assumed_mtbf_seconds: int = Field(
        86_400,
        ge=60,
        le=MAX_MTBF_SECONDS,
        description="everySteps auto: the mean time between failures assumed for this job (seconds, 60 to "
        "ten years); it counts as one failure in that time, and the job's own restarts over its run time "
        "take over as they add up.",
    )
    auto_min_steps: int = Field(
        10, ge=1, le=MAX_STEPS, description="everySteps auto: at least this many steps between checkpoints."
    )
    auto_max_steps: int = Field(
        100_000,
        ge=1,
        le=MAX_STEPS,
        description="everySteps auto: at most this many steps between checkpoints (not below autoMinSteps).",
    )
    auto_first_seconds: int = Field(
        60,
        ge=1,
        le=MAX_SECONDS,
        description="everySteps auto: the first checkpoint of an attempt comes after this many seconds of "
        "steps (it measures the save's stall), so a job that dies in its first minutes loses little.",
    )
    snapshot_every_steps: int = Field(
        100,
        ge=1,
        le=MAX_STEPS,
        description="An in-memory snapshot (what a rollback returns to) every this many steps, and at every "
        "disk checkpoint (at most 10^9).",
    )
    every_seconds: int | None = Field(
        600,
        ge=1,
        le=MAX_SECONDS,
        description="Also a disk checkpoint when this many seconds passed since the last one, whatever the "
        "steps (null: by steps only; at most a week), so a short or slow run loses minutes, not hours.",
    )

    @field_validator("every_steps", mode="before")
    @classmethod
    def _steps_or_auto(cls, value: object) -> object:
        valid_int = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_STEPS
        if value != AUTO and not valid_int:
            raise ValueError(f'must be a positive integer (at most 10^9) or "auto", not {value!r}')
        return value

    @model_validator(mode="after")
    def _auto_bounds_ordered(self) -> CheckpointPolicy:
        if self.auto_min_steps > self.auto_max_steps:
            raise ValueError("autoMinSteps must not exceed autoMaxSteps")
        return self

    @property
    def auto(self) -> bool:
        """Whether the interval follows the failure rate (``everySteps: auto``)."""
        return self.every_steps == AUTO


class Remediation(_Section):
    """What a rollback (or a restart after divergence) changes before training goes on."""

    lr_scale: float = Field(0.5, gt=0, le=1, description="Learning rates are multiplied by this.")
    max_grad_norm: float | None = Field(
        0.5,
        gt=0,
        le=MAX_FACTOR,
        description="Clipping is tightened to at most this norm (a loop not clipped is clipped to it from "
        "then on; null: unchanged; at most 10^6).",
    )


class RemediationOrder(Remediation):
    """A remediation handed to an attempt's workers (``TRAINGUARD_REMEDIATION``), with its ``id``.

    ``id`` names the attempt that introduced it (``attempt-N``). Later attempts pass the same id, and a
    guardian applies an id once (the ids applied are kept in its checkpoints), so a restart for another
    reason does not apply it a second time. Both runners build it with ``introduced_by``.
    """

    id: str

    @classmethod
    def introduced_by(cls, attempt: int, remediation: Remediation) -> RemediationOrder:
        """The order for ``remediation`` first handed to ``attempt``."""
        return cls(id=f"attempt-{attempt}", **remediation.model_dump())

    def payload(self) -> dict[str, object]:
        """The JSON object the guardian reads: ``{"id": ..., "lrScale": ..., "maxGradNorm": ...}``."""
        return self.model_dump(by_alias=True, mode="json")

    def to_json(self) -> str:
        """``payload()`` as the compact JSON text of the environment variable."""
        return json.dumps(self.payload(), separators=(",", ":"))


class GuardianSettings(_Section):
    """Everything the in-process guardian is configured with."""

    guard: GuardThresholds = GuardThresholds()
    checkpoint: CheckpointPolicy = CheckpointPolicy()
    remediation: Remediation = Remediation()
    status_interval_seconds: float = Field(
        0.5,
        ge=0,
        le=60,
        description="The status file is rewritten at most this often (phase changes: at once); at most "
        "60 s, so the sidecar's view stays fresh.",
    )
    compute_window_steps: int = Field(
        DEFAULT_WINDOW_STEPS,
        ge=1,
        le=MAX_WINDOW_STEPS,
        description="Steps whose own compute time the published compute median covers (the job's "
        "health.straggler.windowSteps).",
    )


class SettingsError(ValueError):
    """A setting is invalid; the message names the setting and where it came from."""


def describe_validation_error(error: ValidationError, source: str) -> str:
    """Render a pydantic error as one line per field: ``source: field.path: reason``."""
    lines = []
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or "(root)"
        lines.append(f"{source}: {path}: {item['msg']}")
    return "\n".join(lines)


def load_settings(environ: Mapping[str, str] | None = None, **overrides: object) -> GuardianSettings:
    """Settings from ``TRAINGUARD_SETTINGS`` (JSON, camelCase) with keyword overrides on top.

    Raises SettingsError naming the variable and the field when anything is invalid.
    """
    env = os.environ if environ is None else environ
    raw: dict[str, object] = {}
    text = env.get(SETTINGS_ENV, "").strip()
    if text:
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SettingsError(f"{SETTINGS_ENV}: not valid JSON: {exc}") from exc
        if not isinstance(loaded, dict):
            raise SettingsError(f"{SETTINGS_ENV}: must be a JSON object, got {type(loaded).__name__}")
        raw.update(loaded)
    raw.update(overrides)
    try:
        return GuardianSettings.model_validate(raw)
    except ValidationError as exc:
        source = SETTINGS_ENV if text else "Guardian settings"
        raise SettingsError(describe_validation_error(exc, source)) from exc

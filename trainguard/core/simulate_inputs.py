"""What ``trainguard simulate`` accepts from its flags. Pure.

A flag that overrides a field of the job is checked by the spec's own model (``--max-restarts`` as
``spec.recovery.maxRestarts``, bounds and rules included), and ``--gpus`` is bounded by the most ranks a
job can have (the spec's ``replicas`` x ``nprocPerNode`` bounds, read from the model). The other flags
have no field; their ranges below keep the simulation finite and meaningful: durations from a
millisecond to a day (a step, a save, a restart or a detection longer than a day is no job's; one
shorter than a millisecond counts steps past floating point), at most ten years simulated, a seed of 64
bits. The failure rate (``--failure-scale`` with ``--gpus`` and ``--days``) must expect at most
``MAX_EVENTS`` failures in the simulated time: the most events one simulation plays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from trainguard.core.failure_models import DAY, FailureModel
from trainguard.core.simulate import MAX_EVENTS
from trainguard.core.spec import GuardedTrainingJobSpec, RecoverySpec


class InputRefused(ValueError):
    """A flag's value is outside what the simulation accepts; the message names the flag and why."""


def field_upper_bound(model: type[BaseModel], name: str) -> int:
    """The ``le`` bound of the model's integer field ``name``, as its pydantic metadata declares it."""
    for item in model.model_fields[name].metadata:  # annotated_types' Ge, Le, ... as Field(le=) makes them
        bound = getattr(item, "le", None)
        if isinstance(bound, int):
            return bound
    raise LookupError(f"{model.__name__}.{name} declares no upper bound")


#: The most GPUs a job can have: the spec's most replicas times its most processes per pod.
MAX_GPUS = field_upper_bound(GuardedTrainingJobSpec, "replicas") * field_upper_bound(
    GuardedTrainingJobSpec, "nproc_per_node"
)
MAX_DAYS = 3650.0
MIN_SECONDS, MAX_SECONDS = 0.001, DAY
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class Range:
    """Accepted values: from ``low`` (included unless ``open_low``) to ``high`` (included), and why."""

    low: float
    high: float
    why: str
    open_low: bool = False

    def problem(self, value: float) -> str | None:
        """Why ``value`` is refused (None when it is accepted)."""
        if not isinstance(value, int) and not math.isfinite(value):
            return "must be a finite number"
        low_ok = value > self.low if self.open_low else value >= self.low
        if low_ok and value <= self.high:
            return None
        low = f"above {_number(self.low)}" if self.open_low else f"at least {_number(self.low)}"
        high = f" and at most {_number(self.high)}" if math.isfinite(self.high) else ""
        return f"must be {low}{high} ({self.why})"


def _number(value: float) -> str:
    """``1,048,576``, ``0.001``: whole numbers exactly, with thousands separators."""
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


_DURATION = Range(MIN_SECONDS, MAX_SECONDS, "seconds, from a millisecond to a day")
#: The range of each numeric flag that has no field in the job.
RANGES = {
    "--gpus": Range(1, MAX_GPUS, "the spec's most replicas x nprocPerNode"),
    "--days": Range(0, MAX_DAYS, "ten years", open_low=True),
    "--failure-scale": Range(0, math.inf, "a multiple of the model's rate", open_low=True),
    "--step-seconds": _DURATION,
    "--save-stall-seconds": _DURATION,
    "--restart-seconds": _DURATION,
    "--crash-detection-seconds": _DURATION,
    "--lost-detection-seconds": _DURATION,
    "--seed": Range(0, MAX_SEED, "64 bits"),
}


def flag_problem(flag: str, value: float) -> str | None:
    """Why ``flag``'s ``value`` is refused by its range (``RANGES``), None when it is accepted."""
    return RANGES[flag].problem(value)


def check_failure_rate(model: FailureModel, gpus: int, days: float, scale: float) -> None:
    """Raise InputRefused when the job's failure rate expects more than ``MAX_EVENTS`` failures in the
    simulated days (or overflows): a simulation that long plays no run to its end."""
    expected = model.job_rate(gpus, scale) * days * DAY
    if not expected <= MAX_EVENTS:
        count = f"{expected:.3g}" if math.isfinite(expected) else "countless"
        raise InputRefused(
            f"--failure-scale {scale:g} with --gpus {gpus:,} and --days {days:g}: {count} failures "
            f"expected, more than the {MAX_EVENTS:,} events one simulation plays; lower --failure-scale, "
            "--gpus or --days"
        )


def with_max_restarts(spec: GuardedTrainingJobSpec, value: int) -> GuardedTrainingJobSpec:
    """``spec`` with ``recovery.maxRestarts`` set to ``value``, validated by the spec's own model; raise
    InputRefused naming ``--max-restarts`` and the field otherwise."""
    try:
        recovery = RecoverySpec.model_validate(spec.recovery.model_dump() | {"max_restarts": value})
    except ValidationError as exc:
        reasons = "; ".join(str(item["msg"]) for item in exc.errors())
        raise InputRefused(f"--max-restarts {value}: spec.recovery.maxRestarts: {reasons}") from None
    return spec.model_copy(update={"recovery": recovery})

"""The checkpoint interval from the failure rate: the Young-Daly rule, torch-free.

A checkpoint costs the training loop ``C`` seconds (its stall on the training thread); a failure costs the
work done since the last checkpoint, half an interval ``T`` on average. The lost share of time is about
``C / T + T / (2 M)`` for a mean time between failures ``M``; it is smallest at ``T = sqrt(2 C M)``
(Young 1974; Daly 2006). ``checkpoint.everySteps: auto`` takes that interval, in steps of the measured
step time, within the user's bounds. The guardian, the operator's status and ``trainguard simulate``
all call the functions here, so the rule is written once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Where the mean time between failures came from: the user's assumption alone, or this job's restarts.
ASSUMED = "assumed"
OBSERVED = "observed"


def young_daly_seconds(save_seconds: float, mtbf_seconds: float) -> float:
    """The interval between checkpoints that loses the least time: ``sqrt(2 x cost x MTBF)`` seconds.

    Both inputs are clamped at zero (a negative measurement is noise), so the result is finite and
    non-negative for finite inputs."""
    return math.sqrt(2.0 * max(0.0, save_seconds) * max(0.0, mtbf_seconds))


def estimated_mtbf(assumed_mtbf_seconds: float, failures: int, run_seconds: float) -> tuple[float, str]:
    """This job's mean time between failures and its source (``ASSUMED`` or ``OBSERVED``).

    The assumption counts as one failure in ``assumed_mtbf_seconds`` of run time, added to what was seen
    (``failures`` restarts in ``run_seconds``): with none seen it is the assumption, and as restarts add
    up the observed rate takes over. More failures in the same time never lengthen the estimate."""
    failures, run = max(0, failures), max(0.0, run_seconds)
    mtbf = (run + assumed_mtbf_seconds) / (failures + 1)
    return mtbf, OBSERVED if failures else ASSUMED


@dataclass(frozen=True)
class CadenceChoice:
    """An automatic checkpoint interval and why: the numbers it came from, and the bound that held it."""

    steps: int
    save_seconds: float
    mtbf_seconds: float
    mtbf_source: str
    step_seconds: float
    optimal_seconds: float
    bound: str = ""  # "min", "max", or "" when the rule's own value was kept

    def reason(self) -> str:
        """One line for the status and the logs."""
        held = f", held at the {self.bound}imum" if self.bound else ""
        return (
            f"auto: every {self.steps} steps (save {self.save_seconds:.3g} s, MTBF {self.mtbf_seconds:.4g} s "
            f"{self.mtbf_source}, step {self.step_seconds:.3g} s: sqrt(2 x save x MTBF) = "
            f"{self.optimal_seconds:.4g} s{held})"
        )


def auto_interval(
    save_seconds: float, mtbf_seconds: float, step_seconds: float, min_steps: int, max_steps: int
) -> int:
    """The Young-Daly interval in whole steps of ``step_seconds``, within ``[min_steps, max_steps]``.

    Promises: the result is an int in the bounds (``min_steps`` wins if the bounds cross); it never
    shrinks when the save costs more or failures are rarer, and never grows when steps take longer.
    A step time of zero (not measured) gives ``max_steps`` unless the optimum is zero too."""
    low = max(1, min_steps)
    high = max(low, max_steps)
    optimal = young_daly_seconds(save_seconds, mtbf_seconds)
    step = max(0.0, step_seconds)
    if step == 0.0:
        return high if optimal > 0 else low
    steps = optimal / step
    if not math.isfinite(steps) or steps >= high:
        return high
    return max(low, round(steps))


def choose_interval(
    save_seconds: float,
    step_seconds: float,
    min_steps: int,
    max_steps: int,
    assumed_mtbf_seconds: float,
    failures: int = 0,
    run_seconds: float = 0.0,
) -> CadenceChoice:
    """``auto_interval`` with the MTBF estimated from ``estimated_mtbf``, and the reason kept."""
    mtbf, source = estimated_mtbf(assumed_mtbf_seconds, failures, run_seconds)
    steps = auto_interval(save_seconds, mtbf, step_seconds, min_steps, max_steps)
    optimal = young_daly_seconds(save_seconds, mtbf)
    unbounded = auto_interval(save_seconds, mtbf, step_seconds, 1, 2**62)
    bound = "min" if unbounded < steps else "max" if unbounded > steps else ""
    return CadenceChoice(steps, save_seconds, mtbf, source, step_seconds, optimal, bound)

"""What a job's settings cost at scale: a failure simulation driving trainguard's own rules. Pure.

``simulate`` plays a job of ``gpus`` GPUs for ``days`` days against a failure model
(``core.failure_models``): failures arrive as a Poisson process at the model's per-GPU rate; each is a
crash, a hang or a lost node. Training runs in steps of ``step_seconds``; a checkpoint stalls it
``save_stall_seconds`` and comes when the job's cadence says (``everySteps``, ``everySeconds``, or
``auto`` by ``contract.cadence.choose_interval`` with the job's failure history, as the guardian does).
A failure loses the time since the last checkpoint (the rework), then it is detected (a crash at once
but for ``crash_detection_seconds``, a hang after the hang timeout and the liveness probe's periods, a
lost node after ``lost_detection_seconds``), the recovery policy (``core.policy.decide``) decides (a
restart after its backoff, or giving up once ``maxRestarts`` are spent), and the job restarts
(``restart_seconds``) from its last checkpoint.

Figures: ``goodput`` is the share of the wall time spent on steps that are kept; ``ettr`` (effective
training time ratio) also counts the checkpoints' stalls as training time, which is how the published
ETTR figures count a running job. Deterministic for a seed; no clock, no I/O.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field, replace

from trainer_sidecar.contract.cadence import choose_interval
from trainer_sidecar.contract.settings import CheckpointPolicy
from trainguard.core.failure_models import DAY, FailureModel, Shows
from trainguard.core.policy import Action, Observation, RankObservation, decide
from trainguard.core.probes import probe_timing
from trainguard.core.spec import GuardedTrainingJobSpec


@dataclass(frozen=True)
class Costs:
    """What one step, one checkpoint and one recovery cost (seconds)."""

    step_seconds: float = 10.0
    save_stall_seconds: float = 5.0
    #: From the end of the backoff to the first step again: scheduling, start, checkpoint load.
    restart_seconds: float = 300.0
    crash_detection_seconds: float = 10.0
    lost_detection_seconds: float = 60.0


@dataclass(frozen=True)
class Scenario:
    """A job of ``gpus`` GPUs for ``days`` days, failing as ``model`` says times ``failure_scale``."""

    spec: GuardedTrainingJobSpec
    model: FailureModel
    gpus: int
    days: float
    costs: Costs = Costs()
    failure_scale: float = 1.0
    seed: int = 0
    #: Failures at these times (seconds from the start) and of these kinds instead of the model's draws
    #: (for worked examples); one that falls while the job is down is not counted.
    scripted: tuple[tuple[float, Shows], ...] | None = None


@dataclass
class Outcome:
    """Where a simulated job's time went (seconds), and its figures."""

    wall_seconds: float
    kept_steps: int = 0
    stall_seconds: float = 0.0
    rework_seconds: float = 0.0
    detection_seconds: float = 0.0
    backoff_seconds: float = 0.0
    restart_seconds: float = 0.0
    idle_seconds: float = 0.0  # after the policy gave up: the job no longer runs
    failures: int = 0
    restarts: int = 0
    checkpoints: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    gave_up_at: float | None = None
    gave_up_reason: str = ""
    last_interval_steps: int | None = None
    #: Each checkpoint interval the job used, with how many checkpoints used it.
    intervals: Counter[int] = field(default_factory=Counter)
    #: Checkpoints and failures played (the simulation's work, at most its ``max_events``).
    events: int = 0

    def useful_seconds(self, step_seconds: float) -> float:
        """Time spent on steps that were kept."""
        return self.kept_steps * step_seconds

    def goodput(self, step_seconds: float) -> float:
        """Kept steps' time over the wall time."""
        return self.useful_seconds(step_seconds) / self.wall_seconds if self.wall_seconds else 0.0

    def ettr(self, step_seconds: float) -> float:
        """Kept steps' time and the checkpoints' stalls over the wall time."""
        if not self.wall_seconds:
            return 0.0
        return (self.useful_seconds(step_seconds) + self.stall_seconds) / self.wall_seconds


def detection_seconds(kind: Shows, spec: GuardedTrainingJobSpec, costs: Costs) -> float:
    """How long a failure of ``kind`` goes unnoticed: a hang waits out the hang timeout and the liveness
    probe's failure threshold (``core.probes``); a crash and a lost node what ``costs`` says."""
    if kind is Shows.HANG:
        health = spec.health
        threshold = probe_timing(health.probe_period_seconds)["liveness_failure_threshold"]
        return float(health.hang_timeout_seconds + threshold * health.probe_period_seconds)
    if kind is Shows.LOST:
        return costs.lost_detection_seconds
    return costs.crash_detection_seconds


def _observed(kind: Shows) -> RankObservation:
    """The failed rank as the runner would see it."""
    if kind is Shows.HANG:
        return RankObservation(rank=0, alive=False, reason="no step within the hang timeout")
    if kind is Shows.LOST:
        return RankObservation(rank=0, lost=True, reason="the node is gone")
    return RankObservation(rank=0, exit_code=-9, reason="killed")


class _Cadence:
    """When the next checkpoint comes, as the guardian's ``CheckpointManager`` decides it."""

    def __init__(self, policy: CheckpointPolicy, costs: Costs) -> None:
        self.policy = policy
        self.costs = costs
        self.interval: int | None = None if policy.auto else int(policy.every_steps)
        self._history = (0, 0.0)  # the job's restarts and run time when the attempt started

    def restart(self, restarts: int, run_seconds: float) -> None:
        """A new attempt: auto chooses again after its first checkpoint, from the history so far."""
        if self.policy.auto:
            self.interval = None
            self._history = (restarts, run_seconds)

    def steps_to_next(self, step: int) -> int:
        """Steps from ``step`` (just checkpointed or resumed) to the next checkpoint."""
        step_seconds = self.costs.step_seconds
        every = self.policy.every_seconds
        if self.policy.auto and self.interval is None:
            first = self.policy.auto_first_seconds
            every = first if every is None else min(every, first)
        by_time = math.ceil(every / step_seconds) if every is not None else None
        if self.interval is None:
            by_steps = None
        elif self.policy.auto:
            by_steps = self.interval
        else:
            by_steps = self.interval - step % self.interval
        options = [n for n in (by_time, by_steps) if n is not None]
        return max(1, min(options)) if options else 1 << 62

    def saved(self) -> None:
        """A checkpoint was taken: auto chooses its interval from the costs and the failure history."""
        if self.policy.auto:
            restarts, run = self._history
            self.interval = choose_interval(
                self.costs.save_stall_seconds,
                self.costs.step_seconds,
                self.policy.auto_min_steps,
                self.policy.auto_max_steps,
                self.policy.assumed_mtbf_seconds,
                restarts,
                run,
            ).steps


#: The most checkpoints and failures one simulation plays (seconds of work): beyond it a scenario is
#: refused rather than run for hours (Llama 3's 54 days at a checkpoint a step is about 470,000). The
#: sweep's points share one more such budget, so ``trainguard simulate`` plays at most twice this.
MAX_EVENTS = 2_000_000


class ScenarioTooLarge(ValueError):
    """A scenario needs more than ``MAX_EVENTS`` checkpoints and failures."""


class _Failures:
    """When failures arrive and what each shows: the scenario's script, or the model's draws (a Poisson
    process at the job's rate, each of a cause drawn by its weight) from the scenario's seed."""

    def __init__(self, scenario: Scenario) -> None:
        self._rng = random.Random(scenario.seed)
        self._rate = scenario.model.job_rate(scenario.gpus, scenario.failure_scale)
        self._causes = scenario.model.causes
        self._weights = [c.count for c in self._causes]
        self._script = sorted(scenario.scripted) if scenario.scripted is not None else None

    def next_after(self, now: float) -> float:
        """When the next failure from ``now`` comes (inf: none)."""
        if self._script is not None:
            return next((at for at, _ in self._script if at >= now), math.inf)
        return now + self._rng.expovariate(self._rate) if self._rate > 0 else math.inf

    def kind_at(self, at: float) -> Shows:
        """What the failure at ``at`` shows."""
        if self._script is not None:
            return next(kind for when, kind in self._script if when == at)
        return self._rng.choices(self._causes, self._weights)[0].kind


class _Play:
    """One play of a scenario: the clock ``t``, the step of the last checkpoint (what a restart resumes),
    the next failure, the restarts and the attempt, and the outcome counted so far."""

    def __init__(self, scenario: Scenario) -> None:
        self.spec, self.costs = scenario.spec, scenario.costs
        self.end = scenario.days * DAY
        self.failures = _Failures(scenario)
        self.cadence = _Cadence(self.spec.checkpoint.policy(), self.costs)
        self.out = Outcome(wall_seconds=self.end)
        self.t = 0.0
        self.kept = 0
        self.failure_at = self.failures.next_after(self.t)
        self.restarts = 0
        self.attempt = 1

    def interval(self) -> bool:
        """Play up to the next checkpoint, the window's end or the next failure and its recovery; False
        once the window is over (or the policy gave up)."""
        costs = self.costs
        steps = self.cadence.steps_to_next(self.kept)
        span = steps * costs.step_seconds
        if self.t + span + costs.save_stall_seconds <= min(self.failure_at, self.end):
            self.t += span + costs.save_stall_seconds
            self.kept += steps
            self.out.stall_seconds += costs.save_stall_seconds
            self.out.checkpoints += 1
            self.cadence.saved()
            if self.cadence.interval is not None:
                self.out.intervals[self.cadence.interval] += 1
            return True
        if self.end <= self.failure_at:
            # The window ends mid-interval: the steps done so far are kept (the job goes on after it).
            self.kept += min(steps, int((self.end - self.t) / costs.step_seconds))
            self.t = self.end
            return False
        return self._failure()

    def _failure(self) -> bool:
        """The failure at ``failure_at``: the time since the last checkpoint is lost; then detection,
        decision, recovery. False once the window is over or the policy gave up."""
        out = self.out
        out.rework_seconds += self.failure_at - self.t
        kind = self.failures.kind_at(self.failure_at)
        out.failures += 1
        out.by_kind[kind.value] += 1
        self.t = self.failure_at
        detected = detection_seconds(kind, self.spec, self.costs)
        out.detection_seconds += min(detected, self.end - self.t)
        self.t += detected
        if self.t >= self.end:
            return False
        observation = Observation(
            attempt=self.attempt,
            ranks=[_observed(kind)],
            restarts=self.restarts,
            handled_attempt=self.attempt - 1,
        )
        decision = decide(self.spec.recovery, observation)
        if decision.action is not Action.RESTART:
            out.gave_up_at, out.gave_up_reason = self.t, decision.reason
            out.idle_seconds += self.end - self.t
            self.t = self.end
            return False
        self.restarts, self.attempt = decision.restarts, self.attempt + 1
        backoff = min(decision.delay_seconds, self.end - self.t)
        out.backoff_seconds += backoff
        self.t += backoff
        restart = min(self.costs.restart_seconds, max(0.0, self.end - self.t))
        out.restart_seconds += restart
        self.t += restart
        self.cadence.restart(self.restarts, self.t)
        self.failure_at = self.failures.next_after(self.t)
        return True


def simulate(scenario: Scenario, max_events: int | None = None) -> Outcome:
    """Play the scenario (see the module docstring); the same scenario and seed give the same outcome.
    Raises ``ScenarioTooLarge`` (naming what to change) past ``max_events`` events (``MAX_EVENTS``)."""
    limit = MAX_EVENTS if max_events is None else max_events
    play = _Play(scenario)
    events = 0
    while play.t < play.end:
        events += 1
        if events > limit:
            raise ScenarioTooLarge(
                f"more than {limit:,} checkpoints and failures to play: shorten --days, lower --gpus "
                "or --failure-scale, or lengthen --step-seconds or the checkpoint interval"
            )
        if not play.interval():
            break
    out = play.out
    out.kept_steps = play.kept
    out.restarts = play.restarts
    out.last_interval_steps = play.cadence.interval
    out.events = events
    return out


def sweep(scenario: Scenario, intervals: list[int], budget: int | None = None) -> list[tuple[int, float]]:
    """Goodput for each fixed ``everySteps`` in ``intervals`` (the rest of the scenario alike, the time
    cadence off so that the steps alone decide): where the chosen setting lies among the others. The
    points share ``budget`` events (``MAX_EVENTS``), in order; a point whose checkpoints alone (those of
    its interval without a failure) exceed what is left, or that plays past it, is left out."""
    left = MAX_EVENTS if budget is None else budget
    costs = scenario.costs
    results = []
    for every in intervals:
        if scenario.days * DAY / (every * costs.step_seconds + costs.save_stall_seconds) > left:
            continue  # too costly to play: left off the plot, without spending the budget on it
        checkpoint = scenario.spec.checkpoint.model_copy(update={"every_steps": every, "every_seconds": None})
        spec = scenario.spec.model_copy(update={"checkpoint": checkpoint})
        try:
            outcome = simulate(replace(scenario, spec=spec), max_events=left)
        except ScenarioTooLarge:
            left = 0  # it played all that was left
            continue
        left -= outcome.events
        results.append((every, outcome.goodput(costs.step_seconds)))
    return results


def ascii_plot(
    points: list[tuple[int, float]],
    chosen: tuple[float, float],
    references: list[tuple[str, float]],
    width: int = 64,
    height: int = 14,
) -> list[str]:
    """A text plot of goodput over the checkpoint interval (log scale): ``o`` the sweep, ``*`` the chosen
    setting (its interval in steps, its goodput), a dashed line for each reference ratio; a sweep point
    below the plotted range is a ``v`` on its bottom line."""
    xs = [math.log10(max(1, x)) for x, _ in points] + [math.log10(max(1.0, chosen[0]))]
    focus = [chosen[1]] + [r for _, r in references]
    x_low, x_high = min(xs), max(xs)
    y_high = min(1.0, max([y for _, y in points] + focus) + 0.01)
    y_low = max(0.0, min(focus) - 0.10)
    grid = [[" "] * width for _ in range(height)]

    def column(x: float) -> int:
        span = x_high - x_low
        return 0 if span == 0 else round((math.log10(max(1.0, x)) - x_low) / span * (width - 1))

    def row(y: float) -> int:
        return height - 1 - round((min(max(y, y_low), y_high) - y_low) / (y_high - y_low) * (height - 1))

    labels: dict[int, str] = {}
    for name, ratio in references:
        r = row(ratio)
        grid[r] = ["-"] * width
        labels[r] = f" {name} {ratio:.0%}"
    for x, y in points:
        grid[row(y)][column(x)] = "o" if y >= y_low else "v"
    grid[row(chosen[1])][column(chosen[0])] = "*"
    lines = []
    for index, cells in enumerate(grid):
        y = y_high - index * (y_high - y_low) / (height - 1)
        lines.append(f"{y:6.1%} |" + "".join(cells) + labels.get(index, ""))
    lines.append("       +" + "-" * width)
    left, right = f"{10**x_low:.0f}", f"{10**x_high:.0f} steps between checkpoints (log scale)"
    lines.append("        " + left + right.rjust(width - len(left)))
    return lines


#: The flag that sets each cost, for the inputs table.
COST_FLAGS = {
    "step_seconds": "--step-seconds",
    "save_stall_seconds": "--save-stall-seconds",
    "restart_seconds": "--restart-seconds",
    "crash_detection_seconds": "--crash-detection-seconds",
    "lost_detection_seconds": "--lost-detection-seconds",
}
#: Sweep of fixed intervals the plot places the chosen setting among.
SWEEP_STEPS = [1, 3, 10, 30, 100, 300, 1000, 3000, 10000]


def _duration(seconds: float) -> str:
    if seconds >= DAY:
        return f"{seconds / DAY:.2f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    return f"{seconds:g} s"


def report(
    scenario: Scenario,
    outcome: Outcome,
    points: list[tuple[int, float]],
    given: set[str],
    measured: dict[str, str] | None = None,
    references: list[tuple[str, float, str]] | None = None,
) -> list[str]:
    """The text ``trainguard simulate`` prints: the inputs with where each came from (``given``: the
    costs set by flag; ``measured``: cost name -> where it was measured), the figures, where the time
    went, the comparison with ``references`` (name, ratio, what) and the plot."""
    policy = scenario.spec.checkpoint
    measured = measured or {}
    lines = _input_lines(scenario, _input_rows(scenario, given, measured), measured)
    lines.append("")
    lines += _outcome_lines(scenario, outcome, references or [])
    lines.append("")
    lines.append(
        "goodput by checkpoint interval (o: fixed everySteps, * these settings; the dashed lines are the "
        "published ETTR figures, and goodput is at most ETTR)"
    )
    interval = outcome.last_interval_steps
    chosen_x = float(interval or (policy.every_steps if not policy.auto else 1))
    refs = [(name, ratio) for name, ratio, _ in references or []]
    lines += ascii_plot(points, (chosen_x, outcome.goodput(scenario.costs.step_seconds)), refs)
    return lines


def _input_rows(scenario: Scenario, given: set[str], measured: dict[str, str]) -> list[tuple[str, str, str]]:
    """The inputs table's rows: each input's name, value and where it came from."""
    spec, costs, model = scenario.spec, scenario.costs, scenario.model
    policy = spec.checkpoint

    def source(name: str) -> str:
        if name in measured:
            return f"measured: {measured[name]}"
        flag = COST_FLAGS[name]
        return f"given ({flag})" if name in given else f"assumed (default; {flag})"

    def scale(name: str) -> str:
        return f"given (--{name})" if name in given else f"the failure model's run (--{name})"

    rate_day = model.job_rate(scenario.gpus, scenario.failure_scale) * DAY
    cadence = f"everySteps {policy.every_steps}, everySeconds {policy.every_seconds}"
    if policy.auto:
        cadence += f", assumedMtbfSeconds {policy.assumed_mtbf_seconds}, autoMin/MaxSteps "
        cadence += (
            f"{policy.auto_min_steps}/{policy.auto_max_steps}, autoFirstSeconds {policy.auto_first_seconds}"
        )
    recovery = spec.recovery
    hang = detection_seconds(Shows.HANG, spec, costs)
    return [
        ("GPUs", f"{scenario.gpus:,}", scale("gpus")),
        ("days", f"{scenario.days:g}", scale("days")),
        (
            "failures per day",
            f"{rate_day:.2f}",
            f"published: {model.failures} in {model.seconds / DAY:g} d on {model.gpus:,} GPUs, per GPU, "
            f"x {scenario.failure_scale:g} (--failure-scale)",
        ),
        ("failure kind of each cause", "crash/hang/lost", "assumed (trainguard/core/failure_models.py)"),
        ("step time", _duration(costs.step_seconds), source("step_seconds")),
        ("checkpoint save stall", _duration(costs.save_stall_seconds), source("save_stall_seconds")),
        ("restart to first step", _duration(costs.restart_seconds), source("restart_seconds")),
        ("crash detection", _duration(costs.crash_detection_seconds), source("crash_detection_seconds")),
        ("lost-node detection", _duration(costs.lost_detection_seconds), source("lost_detection_seconds")),
        ("hang detection", _duration(hang), "job: hangTimeoutSeconds + 3 x probePeriodSeconds"),
        ("checkpoint cadence", cadence, "job: spec.checkpoint"),
        ("restarts allowed, backoff", f"{recovery.max_restarts}, {recovery.backoff_seconds} s",
         "job: spec.recovery (--max-restarts)"),
    ]  # fmt: skip


def _input_lines(scenario: Scenario, rows: list[tuple[str, str, str]], measured: dict[str, str]) -> list[str]:
    """The report's title and its inputs table."""
    width = max(len(r[0]) for r in rows)
    value_width = max(len(r[1]) for r in rows)
    lines = [
        f"trainguard simulate: {scenario.gpus:,} GPUs for {scenario.days:g} days, failure model "
        f"{scenario.model.name}, seed {scenario.seed}",
        "",
        f"{'input':<{width}}  {'value':<{value_width}}  source",
    ]
    lines += [f"{name:<{width}}  {value:<{value_width}}  {where}" for name, value, where in rows]
    if not measured:
        lines.append("Nothing above was measured by this command: give measured costs by flag.")
    return lines


def _outcome_lines(
    scenario: Scenario, outcome: Outcome, references: list[tuple[str, float, str]]
) -> list[str]:
    """The figures: failures and restarts, giving up, checkpoints, goodput and ETTR, where the time went,
    and the comparison with ``references``."""
    policy, step = scenario.spec.checkpoint, scenario.costs.step_seconds
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(outcome.by_kind.items()))
    lines = [f"failures      {outcome.failures} ({kinds or 'none'}); restarts {outcome.restarts}"]
    if outcome.gave_up_at is not None:
        lines.append(
            f"gave up       after {_duration(outcome.gave_up_at)}: {outcome.gave_up_reason} (the job fails "
            "there; raise recovery.maxRestarts for a job of this scale)"
        )
    common = ", ".join(f"{steps} steps x{n}" for steps, n in outcome.intervals.most_common(3))
    lines.append(
        f"checkpoints   {outcome.checkpoints}; interval at the end {outcome.last_interval_steps} steps"
        + (f" (most used: {common})" if policy.auto and common else "")
    )
    goodput, ettr = outcome.goodput(step), outcome.ettr(step)
    lines.append(f"goodput       {goodput:.1%}  (time on kept steps / wall time)")
    lines.append(f"ETTR          {ettr:.1%}  (the same, save stalls counted as training time)")
    wall = outcome.wall_seconds
    parts = [
        ("kept steps", outcome.useful_seconds(step)),
        ("save stalls", outcome.stall_seconds),
        ("rework", outcome.rework_seconds),
        ("detection", outcome.detection_seconds),
        ("backoff", outcome.backoff_seconds),
        ("restart", outcome.restart_seconds),
        ("after giving up", outcome.idle_seconds),
    ]
    lines.append("time          " + ", ".join(f"{name} {s / wall:.1%}" for name, s in parts if s > 0))
    for name, ratio, what in references:
        side = "above" if ettr >= ratio else "below"
        lines.append(
            f"vs {name:<10} ETTR {side} {ratio:.0%} by {abs(ettr - ratio) * 100:.1f} points ({what})"
        )
    return lines

"""What ``trainguard run`` shows: a live table on a terminal, plain event lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, TextIO

from rich.console import Console
from rich.live import Live
from rich.table import Table

from trainguard.core.observation import GangView
from trainguard.core.summary import duration_text

if TYPE_CHECKING:
    from trainguard.local.runner import LocalRunner
    from trainguard.local.supervisor import Event

_STYLE = {
    "failure": "bold red",
    "fail": "bold red",
    "restart": "yellow",
    "rollback": "magenta",
    "skip": "dim magenta",
    "recovered": "green",
    "succeeded": "bold green",
    "checkpoint": "cyan",
    "straggler": "bold yellow",
}


_COLUMNS = (
    "attempt",
    "state",
    "step",
    "loss",
    "steps/s",
    "eta",
    "lost",
    "skipped",
    "rollbacks",
    "restarts",
    "drop rate",
    "ckpt every",
    "hang timeout",
)


def state_text(view: GangView) -> str:
    """The gang's phase: one word when every reporting rank agrees, else each rank's, the first failing
    rank first; ranks that have not reported are named."""
    phases = view.phases
    if not phases:
        return "starting"
    if len(set(phases.values())) == 1:
        text = next(iter(phases.values())).value
    else:
        first = view.first_failing
        order = sorted(phases, key=lambda r: (r != first, r))
        text = ", ".join(f"{r}:{phases[r].value}" for r in order)
    missing = view.missing
    return text + (f" (no report: rank {', '.join(map(str, missing))})" if missing else "")


def step_text(view: GangView) -> str:
    """The gang's step (its slowest rank's), and the fastest rank's when it is ahead."""
    progress = view.progress
    if progress is None:
        return "0"
    if progress.fastest_step == progress.step:
        return str(progress.step)
    return f"{progress.step} (rank {progress.fastest_ranks[0]} at {progress.fastest_step})"


class PlainView:
    """One line per timeline event on ``stream`` (for logs and CI: nothing redraws)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.origin = time.time()

    def event(self, entry: Event) -> None:
        """Print one event."""
        print(self.line(entry), file=self.stream, flush=True)

    def line(self, entry: Event) -> str:
        """The text of one event line."""
        step = f" step {entry.step}" if entry.step is not None else ""
        elapsed = entry.time - self.origin
        return f"[{elapsed:7.1f}s] {entry.kind:<10} attempt {entry.attempt}{step}: {entry.message}"

    def update(self, runner: LocalRunner) -> None:
        """Nothing to redraw."""

    def close(self) -> None:
        """Nothing to release."""


class LiveView(PlainView):
    """Events scroll above a live table of the gang's state (a TTY only)."""

    def __init__(self, console: Console | None = None) -> None:
        super().__init__()
        self.console = console or Console()
        self.live = Live(console=self.console, refresh_per_second=4, transient=False)
        self.live.start()

    def event(self, entry: Event) -> None:
        """Print one event above the table."""
        self.console.print(self.line(entry), style=_STYLE.get(entry.kind, ""), highlight=False, markup=False)

    def update(self, runner: LocalRunner) -> None:
        """Redraw the table from the runner's view of the gang."""
        view = runner.gang_view()
        # The same numbers as the operator's status (trainguard.core.summary.pace), from the run's record.
        pace = runner.record.pace(time.time())
        speed = pace.steps_per_second
        table = Table(title=f"trainguard run: {runner.job.metadata.name}", expand=False)
        for column in _COLUMNS:
            table.add_column(column, justify="right")
        lead = view.lead
        loss = lead.loss if lead is not None else None
        rate = view.drop_rate
        table.add_row(
            str(runner.attempt),
            state_text(view),
            step_text(view),
            f"{loss:.4f}" if loss is not None else "-",
            f"{speed:.2f}" if speed is not None else "-",
            duration_text(pace.eta_seconds),
            duration_text(pace.lost_seconds),
            str(view.skipped_steps or 0),
            str(view.rollbacks or 0),
            str(runner.restarts),
            f"{rate:.4%}" if rate is not None and view.samples_seen else "-",
            str(view.checkpoint_every_steps or "-"),
            f"{view.hang_timeout_seconds:.1f} s" if view.hang_timeout_seconds is not None else "-",
        )
        # Why the checkpoint interval is what it is (everySteps auto: the numbers it came from).
        table.caption = view.checkpoint_cadence or None
        self.live.update(table)

    def close(self) -> None:
        """Stop redrawing."""
        self.live.stop()

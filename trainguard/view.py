"""What ``trainguard run`` shows: a live table on a terminal, plain event lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console
from rich.live import Live
from rich.table import Table

if TYPE_CHECKING:
    from trainguard.local import Event, LocalRunner

_STYLE = {
    "failure": "bold red",
    "fail": "bold red",
    "restart": "yellow",
    "rollback": "magenta",
    "skip": "dim magenta",
    "recovered": "green",
    "succeeded": "bold green",
    "checkpoint": "cyan",
}


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
        self._last: tuple[float, int] | None = None
        self._rate = 0.0

    def event(self, entry: Event) -> None:
        """Print one event above the table."""
        self.console.print(self.line(entry), style=_STYLE.get(entry.kind, ""), highlight=False, markup=False)

    def update(self, runner: LocalRunner) -> None:
        """Redraw the table from the runner's latest status."""
        status: dict[str, Any] = runner.ranks[0].status if runner.ranks else {}
        step = int(status.get("step") or 0)
        now = time.time()
        if self._last is not None and now - self._last[0] >= 1.0:
            self._rate = max(0.0, (step - self._last[1]) / (now - self._last[0]))
            self._last = (now, step)
        elif self._last is None:
            self._last = (now, step)
        table = Table(title=f"trainguard run: {runner.job.metadata.name}", expand=False)
        for column in (
            "attempt",
            "state",
            "step",
            "loss",
            "steps/s",
            "skipped",
            "rollbacks",
            "restarts",
            "drop rate",
        ):
            table.add_column(column, justify="right")
        loss = status.get("loss")
        seen = int(status.get("samples_seen") or 0)
        dropped = int(status.get("samples_dropped") or 0)
        table.add_row(
            str(runner.attempt),
            str(status.get("phase", "starting")),
            str(step),
            f"{loss:.4f}" if isinstance(loss, (int, float)) else "-",
            f"{self._rate:.1f}",
            str(status.get("skipped_steps", 0)),
            str(status.get("rollbacks", 0)),
            str(runner.restarts),
            f"{dropped / seen:.4%}" if seen else "-",
        )
        self.live.update(table)

    def close(self) -> None:
        """Stop redrawing."""
        self.live.stop()

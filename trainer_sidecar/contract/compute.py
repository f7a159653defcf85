"""A rank's own compute time per step, as its guardian measures and publishes it (``WorkerStatus``).

The guardian's activity marks take a clock reading when the training thread changes what it does
(``trainer_sidecar.guardian.activity``); the time spent in its own work (the loop, the data, the backward
pass, the guardian's step) is summed there, and at each step boundary the sum since the last boundary is
one step's compute. Time waiting in a collective, in a checkpoint or a busy section is not compute: a
rank that waits for a slow peer has a short compute, the slow peer a long one. ``ComputeWindow`` keeps
the last steps in memory (no sync, no write) and reads out their median and the best median seen, which
the gang view compares across ranks (``trainguard.core.straggler``).
"""

from __future__ import annotations

import statistics
from collections import deque

#: Steps a window holds unless the job says otherwise (``health.straggler.windowSteps``).
DEFAULT_WINDOW_STEPS = 8
#: The largest window accepted: its median is taken at each status write.
MAX_WINDOW_STEPS = 1000


class ComputeWindow:
    """The compute seconds of a rank's last ``steps`` steps: ``lap`` adds one at each step boundary (an
    append), ``reading`` gives the window's median and the best (lowest) median read so far.

    ``lap`` is called by the training thread alone; ``reading`` may be called from another thread (it
    copies the window in one C call first)."""

    __slots__ = ("_best", "_last_total", "_steps")

    def __init__(self, steps: int = DEFAULT_WINDOW_STEPS) -> None:
        if not 1 <= steps <= MAX_WINDOW_STEPS:
            raise ValueError(f"a compute window holds 1 to {MAX_WINDOW_STEPS} steps, not {steps}")
        self._steps: deque[float] = deque(maxlen=steps)
        self._last_total = 0.0
        self._best: float | None = None

    def since_lap(self, total: float) -> float:
        """The compute of the step under way: ``total`` (the running sum of own-work seconds) less the sum
        at the last boundary."""
        return max(0.0, total - self._last_total)

    def lap(self, total: float) -> None:
        """A step boundary at running sum ``total``: the step's compute joins the window."""
        self._steps.append(max(0.0, total - self._last_total))
        self._last_total = total

    def reading(self) -> tuple[float | None, float | None]:
        """(median of the window, best median so far); (None, best) until the window is full."""
        steps = tuple(self._steps)
        if len(steps) < (self._steps.maxlen or 1):
            return None, self._best
        median = statistics.median(steps)
        if self._best is None or median < self._best:
            self._best = median
        return median, self._best

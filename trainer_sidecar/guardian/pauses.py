"""Pauses the guardian can see: a long fetch from its own loader, a long step whose thread is computing.

The learned hang timeout (``trainer_sidecar.contract.hang``) is a tightening from the job's pace: after a
warm-up, no progress for 4 x the longest gap between steps (at least the floor) is a hang. A pause longer
than anything seen before is, to a clock, what a hang looks like, so a pace that changes (an epoch's start
that re-spawns the loader's workers, a shuffle, a curriculum's longer sequences) was killed, and killed
again after every restart: the pause was never recorded, its worker was killed first. What tells such a
pause from a hang is what the training thread is doing, which the guardian sees:

* **fetching the next batch** from the guardian's loader (``Activity.DATA``): a pause of the loader's
  (an epoch's start, a worker re-spawned, a slow shard), not of a step;
* **computing**: in the loop's forward pass or the backward (``COMPUTE_ACTIVITIES``) with its thread
  busy on the CPU (at least ``COMPUTING_CPU_SHARE`` of a core since the last look). A thread that sleeps,
  waits on a lock or in a collective uses none: that is what a hang looks like, and it stays one.

Once such a pause has lasted ``pause_threshold`` (twice the longest gap kept, at least
``MIN_PAUSE_SECONDS``: well inside any learned timeout, which is at least 4 x that gap and the floor), the
activity watch opens an implicit busy section for it (as for an evaluation the guardian infers from the
model's eval mode): the sidecar allows it the startup grace instead of the hang timeout, peers that wait
for it in a collective report that they wait, and it is no step gap, so the learned pace stays the
steps'. It ends when the thread stops fetching, or stops computing, or a step ends it; its end is
progress, so a thread that stops computing and then hangs is caught a hang timeout later. Nothing is
learned from the pause, so nothing has to survive a restart: the next attempt sees it as what it is again.

Not seen: a step whose time is spent waiting for a device (a GPU step's host waits in a synchronisation,
which may spin) or sleeping; a pause that long needs ``guardian.busy``. ``pause_change`` is pure;
``ThreadClock`` reads a thread's CPU clock.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from enum import StrEnum

from trainer_sidecar.contract.hang import GAP_MARGIN
from trainer_sidecar.contract.status import Activity, Phase

#: A pause is announced once it lasted at least this long ...
MIN_PAUSE_SECONDS = 2.0
#: ... and this many times the longest gap kept (half the learned timeout's margin: well inside it).
PAUSE_GAP_FACTOR = GAP_MARGIN / 2
#: The share of a core the training thread must have used since the last look to count as computing: a
#: thread blocked (asleep, on a lock, in a collective) uses next to none; one computing on a loaded
#: machine still gets far more.
COMPUTING_CPU_SHARE = 0.1
#: Where a step computes on the training thread: the loop's code (its forward pass) and the backward.
COMPUTE_ACTIVITIES = frozenset({Activity.LOOP, Activity.BACKWARD})


class PauseKind(StrEnum):
    """A pause the guardian can see; its value is what the busy section says."""

    DATA = "fetching the next batch (the guardian's loader)"
    COMPUTING = "a long step, computing"


class PauseChange(StrEnum):
    """What ``pause_change`` tells the activity watch to do."""

    NONE = "none"
    BEGIN_DATA = "begin-data"
    BEGIN_COMPUTING = "begin-computing"
    END = "end"  # the pause is over (the thread stopped fetching or computing): its end is progress
    STEPPED = "stepped"  # a step (or a rollback, or the loop's end) ended it


@dataclass(frozen=True)
class PauseLook:
    """One look of the activity watch at the training thread: the guardian's ``phase``, the thread's
    ``activity`` and how long it has lasted (``lasted``, seconds), the seconds since the last progress
    (``age``: a step boundary, a section's end), and the share of a core the thread used since the last
    look (``cpu_share``; None: not known)."""

    phase: Phase
    activity: Activity
    lasted: float
    age: float
    cpu_share: float | None


def pause_threshold(longest_gap: float) -> float:
    """How long a pause lasts before it is announced: ``PAUSE_GAP_FACTOR`` x the longest gap kept, at
    least ``MIN_PAUSE_SECONDS`` (a gap that is no finite non-negative number counts as none)."""
    longest = longest_gap if math.isfinite(longest_gap) and longest_gap >= 0 else 0.0
    return max(MIN_PAUSE_SECONDS, PAUSE_GAP_FACTOR * longest)


def computing(cpu_share: float | None) -> bool:
    """Whether a thread that used ``cpu_share`` of a core is computing (an unknown share is not)."""
    return cpu_share is not None and cpu_share >= COMPUTING_CPU_SHARE


def pause_change(opened: PauseKind | None, moved: bool, look: PauseLook, threshold: float) -> PauseChange:
    """Whether a pause section begins or ends, from one ``look``: the section open (``opened``; None:
    none), whether the progress moved since it opened (``moved``), and the ``threshold`` a pause must
    have lasted. Pure.

    An open section ends with ``STEPPED`` once the progress moved or the phase is no longer running; a
    data pause ends (``END``) once the thread is not fetching, a computing one once it is out of
    ``COMPUTE_ACTIVITIES`` or not computing. With none open, while running: a fetch that lasted
    ``threshold`` begins a data pause; a thread computing in ``COMPUTE_ACTIVITIES`` with no progress for
    ``threshold`` begins a computing one."""
    if opened is not None:
        if moved or look.phase is not Phase.RUNNING:
            return PauseChange.STEPPED
        if opened is PauseKind.DATA:
            still = look.activity is Activity.DATA
        else:
            still = look.activity in COMPUTE_ACTIVITIES and computing(look.cpu_share)
        return PauseChange.NONE if still else PauseChange.END
    if look.phase is not Phase.RUNNING:
        return PauseChange.NONE
    if look.activity is Activity.DATA and look.lasted >= threshold:
        return PauseChange.BEGIN_DATA
    if look.activity in COMPUTE_ACTIVITIES and look.age >= threshold and computing(look.cpu_share):
        return PauseChange.BEGIN_COMPUTING
    return PauseChange.NONE


class ThreadClock:
    """The CPU time of one thread (Linux's per-thread CPU clock), read from another thread: ``share``
    says what share of a core the thread used since the previous call. Where the clock cannot be read
    (another system, the thread gone), every share is None."""

    def __init__(self, thread_ident: int) -> None:
        try:
            self._clock: int | None = time.pthread_getcpuclockid(thread_ident)
        except (AttributeError, OSError, OverflowError):
            self._clock = None
        self._last: tuple[float, float] | None = None

    def share(self) -> float | None:
        """The thread's CPU seconds per wall second since the previous call (None on the first call,
        or when the clock cannot be read)."""
        if self._clock is None:
            return None
        try:
            cpu = time.clock_gettime(self._clock)
        except OSError:
            self._clock = None
            return None
        wall = time.monotonic()
        last, self._last = self._last, (wall, cpu)
        if last is None or wall <= last[0]:
            return None
        return max(0.0, cpu - last[1]) / (wall - last[0])

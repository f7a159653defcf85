"""How long a worker may go without progress before it is hung: a deadline learned from the job's own
pace, between a floor and a ceiling. Pure and torch-free: the guardian folds what it publishes into a
``ProgressGaps`` record (``GapLearner``), the sidecar turns the record into a deadline
(``hang_deadline``).

**Who measures: the guardian, at the status file.** The sidecar reads the status file only when it is
asked (a liveness probe every ``probePeriodSeconds``, 10 s by default, a scrape, a poll), so the gaps it
could time on its own clock are the gaps between its readers, not between steps: a worker stepping every
0.1 s and one stepping every 9 s look alike to it. The guardian knows every progress it publishes, on its
own monotonic clock, and what kind of stretch a gap was (stepping, or a pause it declared). So it times
the gap between two *published* progress changes (phase, step, step count: what the sidecar's hang clock
restarts on), which already holds the status interval's delay that the sidecar's age of a step carries.
A gap counts only when it began while the worker was running: a busy section (declared, or an
evaluation the guardian inferred from the model's eval mode), a rollback and the start are declared
pauses with their own allowance (the startup grace, a section's own bound) and are never step gaps; their
end is progress, so the next gap starts there.
A pause longer than anything seen before is, to this rule, a hang. So what the guardian can see for what
it is, a long fetch from its loader or a long step whose thread keeps computing, is declared as such a
pause as well, long before the deadline (``trainer_sidecar.guardian.pauses``): the rule only judges the
pauses no one can tell from a hang.

The worker's numbers only ever make the sidecar's verdict **stricter**, never looser (the sidecar
distrusts what a worker writes; see ``trainer_sidecar.sidecar.health``): the deadline is at most the
ceiling (``hangTimeoutSeconds``, the sidecar's own setting) whatever a worker publishes, and at least the
floor (``hangTimeoutFloorSeconds``, also the sidecar's own), so a worker can only bring its own deadline
down to the floor its user chose. A floor at or above the ceiling turns learning off: the fixed rule.

The rule, after ``WARMUP_GAPS`` gaps (before: the ceiling):
``min(ceiling, max(floor, GAP_MARGIN * longest gap after the warm-up, CHECKPOINT_MARGIN * checkpoint))``.
The longest gap (not a mean or a quantile) is kept because a hang verdict is final: a pause that happened
once (an epoch's data loader restart, a synchronous snapshot, a slow step under CPU contention) recurs,
and once seen it never again ends a worker. The record only grows, so the deadline never shrinks during a
run. The checkpoint term covers a save that waits for the previous write still in flight (the guardian
declares that wait as a busy section as well; the term also covers a guardian that does not).

**A resumed run keeps what its job learned.** The record is a job counter, saved with the guardian's
counters in every checkpoint; a worker that resumes from one starts from ``ProgressGaps.resumed``: the
longest gap carried over, and a short warm-up of its own (``RESUMED_WARMUP_GAPS``) instead of the whole
one: its first gaps (``RESUMED_SETUP_GAPS``: lazy set-up, compilation, a cold page cache) are only
counted, the next ones are kept, so a resumed run slower than the one that saved the record (another
node, another batch size) raises its deadline before the deadline applies. Without it every
restart judged its first ``WARMUP_GAPS`` gaps by the ceiling: a hang soon after a restart (a bad node, a
deadlock on resume) cost the ceiling, minutes, where the job had learned seconds. The sidecar needs no
other rule: the carried record is still the worker's, so it can still only make the verdict stricter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Gaps observed before the deadline is learned; the warm-up's own gaps (first steps, lazy set-up,
#: compilation) are not kept as the longest.
WARMUP_GAPS = 20
#: The deadline is at least this many times the longest gap seen after the warm-up.
GAP_MARGIN = 4.0
#: ... and at least this many times the last checkpoint's write (a save may wait for the previous one).
CHECKPOINT_MARGIN = 2.0
#: Gaps a resumed run counts as its own warm-up before the record it carried over applies again ...
RESUMED_WARMUP_GAPS = 5
#: ... of which the first are its set-up, never kept as the longest; the others are.
RESUMED_SETUP_GAPS = 2
#: The floor when none is given: with the default status interval (0.5 s) a fast job's published gaps are
#: about 0.5 s, so the floor is what bounds its deadline; 10 s stays clear of a peer's busy-section
#: announcement (up to ~4 s before a waiting rank says it waits) and of short undeclared pauses.
DEFAULT_FLOOR_SECONDS = 10.0


@dataclass(frozen=True)
class ProgressGaps:
    """What a worker learned of its pace: how many gaps between progress changes it saw while running
    (``count``), and the longest of those after the first ``WARMUP_GAPS`` (``longest``, seconds).

    ``kept_after``: in a record a resumed run started from (``resumed``), the count after which gaps are
    kept although the warm-up is not over (None: from the warm-up's end)."""

    count: int = 0
    longest: float = 0.0
    kept_after: int | None = None

    def observe(self, gap: float, warmup: int = WARMUP_GAPS) -> ProgressGaps:
        """The record after one more gap of ``gap`` seconds. A gap inside the first ``warmup`` (or up to
        ``kept_after``) is only counted; a gap that is not a finite non-negative number counts as
        unbounded (infinite), which makes the deadline the ceiling."""
        gap = gap if math.isfinite(gap) and gap >= 0 else math.inf
        count = self.count + 1
        kept_after = warmup if self.kept_after is None else min(warmup, self.kept_after)
        longest = self.longest if count <= kept_after else max(self.longest, gap)
        return ProgressGaps(count, longest, self.kept_after)

    def learned(self, warmup: int = WARMUP_GAPS) -> bool:
        """Whether the warm-up is over."""
        return self.count >= warmup

    def resumed(
        self,
        warmup: int = WARMUP_GAPS,
        resumed_warmup: int = RESUMED_WARMUP_GAPS,
        setup: int = RESUMED_SETUP_GAPS,
    ) -> ProgressGaps:
        """The record a run resumed from a checkpoint that saved this one starts with (see the module
        docstring): its longest gap, counted so that the next ``resumed_warmup`` gaps are the new
        process's warm-up, after which the deadline is learned again. Of those, the first ``setup``
        (compilation, cold caches) are only counted; the rest are kept, so that a resumed run slower
        than the one that saved the record (another node, another batch size) has raised the deadline
        before it applies. A record still in its warm-up, or whose longest gap is not a finite
        non-negative number, carries nothing: the resumed run learns from the start."""
        if not self.learned(warmup) or not (math.isfinite(self.longest) and self.longest >= 0):
            return ProgressGaps()
        count = max(0, warmup - max(0, resumed_warmup))
        return ProgressGaps(count, self.longest, count + max(0, setup))


def hang_deadline(
    ceiling: float,
    floor: float | None,
    gaps: ProgressGaps | None,
    checkpoint_seconds: float | None = None,
    warmup: int = WARMUP_GAPS,
) -> float:
    """Seconds without progress after which a running worker is hung (see the module docstring).

    Promises: never above ``ceiling``; never below ``min(floor, ceiling)``; the ceiling itself when
    learning is off (``floor`` None or at least the ceiling), before the warm-up, or without a record;
    non-decreasing in every gap observed and in ``checkpoint_seconds``; above every gap kept as the
    longest and above the checkpoint's write time whenever that is below the ceiling. Never NaN: a NaN or
    infinite input yields the ceiling."""
    if floor is None or not floor < ceiling or gaps is None or not gaps.learned(warmup):
        return ceiling
    measured = [gaps.longest] if checkpoint_seconds is None else [gaps.longest, checkpoint_seconds]
    if not all(math.isfinite(each) for each in measured):
        return ceiling
    wanted = max(floor, GAP_MARGIN * gaps.longest)
    if checkpoint_seconds is not None:
        wanted = max(wanted, CHECKPOINT_MARGIN * checkpoint_seconds)
    return min(ceiling, wanted)


#: What the sidecar's hang clock restarts on: phase, step, cumulative step count.
Progress = tuple[str, int, int]


@dataclass(frozen=True)
class GapLearner:
    """The writer's side: fold every status published into the ``ProgressGaps`` it carries.

    ``published`` is called with each status as it is written, on the writer's monotonic clock. A change
    of progress ends a gap; the gap counts when the previous progress was the running phase's (a declared
    pause, or the start, has its own allowance and is no step gap). Statuses that change no progress
    (a rewrite of the same step) end nothing. Fields: the record, the last progress published, when it
    was published, whether it was the running phase's, and the warm-up the record is folded with."""

    gaps: ProgressGaps = ProgressGaps()
    progress: Progress | None = None
    since: float = 0.0
    running: bool = False
    warmup: int = WARMUP_GAPS

    def published(self, progress: Progress, running: bool, now: float) -> GapLearner:
        """The learner after a status with ``progress`` (``running``: in the running phase, judged by
        the hang deadline) was written at ``now``."""
        if progress == self.progress:
            return self
        gaps = self.gaps
        if self.progress is not None and self.running:
            gaps = gaps.observe(max(0.0, now - self.since), self.warmup)
        return GapLearner(gaps, progress, now, running, self.warmup)

"""Which rank is a straggler: its own compute per step against the other ranks'. Pure.

In: each rank's compute per step (the median over its last steps, time waiting in collectives excluded:
``trainer_sidecar.contract.compute``) and its own best such median. A gang steps in lockstep, so a slow
rank makes every rank's step slow, but only the slow rank's *own* compute is long: its peers spend the
difference waiting for it in the step's collective.

Out, per rank: ``score``, its compute over the median of the other ranks' (1: the gang's pace; the
fastest rank's is at most 1), and ``own_score``, its compute over its own best (how much it slowed down
since it was at its best; None: no best yet). A rank is a straggler when its score is above the
threshold (``health.straggler.threshold``): its window's median is, so it stayed slow for about half the
window. Scaling every rank's compute alike changes no score (a slower phase of the job is not a
straggler); a rank whose peers have not measured a window yet is not scored.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class RankPace:
    """One rank's measured pace: its compute per step and its best (seconds; None: not measured)."""

    rank: int
    compute_seconds: float | None
    best_compute_seconds: float | None = None


@dataclass(frozen=True)
class RankScore:
    """One rank's score against the gang (``score``) and against its own best (``own_score``), and
    whether that makes it a straggler."""

    rank: int
    compute_seconds: float
    score: float
    own_score: float | None
    straggler: bool

    def describe(self) -> str:
        """The score in words: "rank 1's compute per step is 2.00x the other ranks' median (0.120 s; 2.00x
        its own best)"."""
        own = f"; {self.own_score:.2f}x its own best" if self.own_score is not None else ""
        return (
            f"rank {self.rank}'s compute per step is {self.score:.2f}x the other ranks' median "
            f"({self.compute_seconds:.3g} s{own})"
        )


def score_ranks(paces: Iterable[RankPace], threshold: float) -> tuple[RankScore, ...]:
    """Every measured rank's score, by rank; empty unless at least two ranks measured a positive pace
    (one rank has no peer to be slower than)."""
    measured = sorted(
        (p for p in paces if p.compute_seconds is not None and p.compute_seconds > 0), key=lambda p: p.rank
    )
    if len(measured) < 2:
        return ()
    scores = []
    for pace in measured:
        assert pace.compute_seconds is not None
        others = statistics.median(p.compute_seconds or 0.0 for p in measured if p is not pace)
        score = pace.compute_seconds / others
        best = pace.best_compute_seconds
        own = pace.compute_seconds / best if best else None
        scores.append(RankScore(pace.rank, pace.compute_seconds, score, own, score > threshold))
    return tuple(scores)


def worst_straggler(scores: Iterable[RankScore]) -> RankScore | None:
    """The straggler with the highest score (then the lowest rank); None when no rank is one."""
    flagged = [s for s in scores if s.straggler]
    return min(flagged, key=lambda s: (-s.score, s.rank)) if flagged else None

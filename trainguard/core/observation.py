"""One observation of a gang, shared by the operator, ``trainguard run`` and the live view. Pure.

In: each rank's ``WorkerStatus`` as last reported (None: the rank has not reported). Out: an immutable
``GangView`` with the rules of aggregation written once. The reported counters and measures (rollbacks,
skipped steps, samples, the checkpoint's duration and cadence, the declared last step...) are folded as
their entry in ``trainer_sidecar.contract.fields.REPORTED`` says, into ``GangView.reported``; the rules:

* progress: the slowest rank's step is the gang's step (a step is done when every rank did it, and a
  checkpoint holds what every rank did); the fastest rank's step beside it, and which ranks are which;
* the resumed step and whether the gang has stepped in this attempt (a rank has stepped when its last
  step is not older than its own process start: both times come from the same worker clock);
* rollbacks and skipped steps are one collective decision, equal on every rank: the largest reported
  (the newest report) is taken;
* samples are sharded: seen and dropped are summed over the ranks, and the drop rate is their ratio;
  unknown (None) unless every reporting rank counted its samples: a rank that completed steps but saw
  no sample did not count (its loop feeds itself, and the guardian sees no batch);
* the last step: the furthest step any rank reported; a rank completes a step only once every rank's
  gradients for it were reduced, so the gang computed it (the slowest rank's report may merely lag);
* the newest clean checkpoint any rank reports;
* the declared last step (``max_steps``): the largest any rank declared (every rank runs the same loop);
* the failing ranks (phase diverged or failed), and the first of them (the lowest step, then rank);
* stragglers: each rank's own compute per step scored against the other ranks' and its own best
  (``trainguard.core.straggler``); ``GangView.straggler`` names the worst one, for the policy.

``GangView.rank_observation`` turns a rank and what the executor knows of its process into the
policy's ``RankObservation``; the rule that a diverged phase counts before the exit code lives there. It
carries the rank's own step and activity (where its training thread was: in its own work, or waiting in
a collective) and where the executor placed it (pod, node): the evidence the policy names a hang's or a
crash's cause by, rather than the peers that waited for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from trainer_sidecar.contract.exitcodes import ExitCode, describe_exit, with_detail
from trainer_sidecar.contract.fields import Value, fold_ranks, rank_values
from trainer_sidecar.contract.inplace import LauncherState
from trainer_sidecar.contract.status import Activity, Phase, WorkerStatus, parse_status_document
from trainer_sidecar.contract.stopping import WriteInFlight
from trainguard.core.policy import RankObservation, StragglerObservation, killed_by_signal
from trainguard.core.straggler import RankPace, RankScore, score_ranks, worst_straggler

#: Phases in which a rank has failed by its own account.
FAILING_PHASES = frozenset({Phase.DIVERGED, Phase.FAILED})


@dataclass(frozen=True)
class SidecarReport:
    """One sidecar's ``/status`` answer (its liveness verdict and the worker's status), or why it could
    not be had."""

    reachable: bool
    alive: bool | None = None
    reason: str = ""
    status: WorkerStatus | None = None
    #: The hang timeout the sidecar judges its worker by now (learned from its pace; None: not said).
    hang_timeout_seconds: float | None = None
    #: The pod's launcher, where the worker runs under one (which attempt, running or exited).
    launcher: LauncherState | None = None

    @classmethod
    def from_document(cls, document: Any) -> SidecarReport:
        """Read a ``/status`` body (JSON text or bytes, or a decoded object) with the status contract's
        parser; anything it refuses reads as an unreachable sidecar, with its reason (never raises)."""
        parsed, why = parse_status_document(document)
        if parsed is None:
            return cls(reachable=False, reason=why)
        health = parsed.health
        return cls(
            reachable=True,
            alive=health.alive,
            reason=health.reason,
            status=parsed.status,
            hang_timeout_seconds=health.hang_timeout_seconds,
            launcher=parsed.launcher,
        )


@dataclass(frozen=True)
class CleanCheckpoint:
    """A clean checkpoint a rank reported: its step, where it is, its digest, when it was written."""

    step: int
    path: str
    sha256: str
    time: float

    def as_dict(self) -> dict[str, Any]:
        """The checkpoint as a plain JSON-ready mapping."""
        return {"step": self.step, "path": self.path, "sha256": self.sha256, "time": self.time}


@dataclass(frozen=True)
class RankState:
    """What one rank reported, as the view keeps it (a frozen copy: later reports do not change it).

    ``resumed_step`` is None while the rank is starting (it has not resumed yet); ``stepped`` says
    whether it completed a step since its process started.
    """

    rank: int
    phase: Phase
    step: int
    resumed_step: int | None
    stepped: bool
    started_at: float
    last_step_time: float | None
    loss: float | None
    grad_norm: float | None
    message: str
    exit_code: int | None = None
    activity: Activity | None = None
    activity_since: float | None = None
    compute_seconds: float | None = None
    best_compute_seconds: float | None = None
    checkpoint_write_since: float | None = None
    checkpoint_seconds: float | None = None
    #: Its value of every field of the registry (``trainer_sidecar.contract.fields``), by name.
    reported: Mapping[str, Value] = field(default_factory=dict)

    @classmethod
    def of(cls, rank: int, status: WorkerStatus) -> RankState:
        """The state of ``rank`` from its status."""
        last = status.last_step_time
        return cls(
            rank=rank,
            phase=status.phase,
            step=status.step,
            resumed_step=None if status.phase is Phase.STARTING else status.resumed_step,
            stepped=last is not None and last >= status.started_at,
            started_at=status.started_at,
            last_step_time=last,
            loss=status.loss,
            grad_norm=status.grad_norm,
            message=status.message,
            exit_code=status.exit_code,
            activity=status.activity,
            activity_since=status.activity_since,
            compute_seconds=status.compute_seconds,
            best_compute_seconds=status.best_compute_seconds,
            checkpoint_write_since=status.checkpoint_write_since,
            checkpoint_seconds=status.checkpoint_seconds,
            reported=rank_values(status),
        )


@dataclass(frozen=True)
class Progress:
    """The gang's step (the slowest rank's) and the fastest rank's step, with the ranks at each."""

    step: int
    fastest_step: int
    slowest_ranks: tuple[int, ...]
    fastest_ranks: tuple[int, ...]


@dataclass(frozen=True)
class ProcessState:
    """What the executor knows of one rank's process apart from its status.

    ``exit_code``: None while it runs (or before it started); negative means killed by that signal.
    ``alive``: the liveness verdict (None: not known). ``health_reason``: why it is not alive.
    ``exit_reason``: how it ended in words (default: the exit code described). ``lost``: why the rank is
    gone without an exit code of its own (deleted, evicted, node lost), or "". ``ended_at``: when it
    ended, in seconds on the executor's clock for all ranks (None: running, or not known). ``place``:
    where it runs, as the executor names it ("pod p on node n"; "": nothing to add).
    """

    exit_code: int | None = None
    alive: bool | None = None
    health_reason: str = ""
    exit_reason: str = ""
    lost: str = ""
    ended_at: float | None = None
    place: str = ""


@dataclass(frozen=True)
class GangView:
    """The gang as its ranks reported it (see the module docstring for every rule)."""

    world_size: int
    ranks: tuple[RankState, ...]
    progress: Progress | None
    resumed_step: int | None
    stepped: bool
    checkpoint: CleanCheckpoint | None
    #: The gang's value of every field of the registry (``trainer_sidecar.contract.fields``), each folded
    #: across the ranks as its field says, by name (None: not known).
    reported: Mapping[str, Value] = field(default_factory=dict)
    #: The hang timeout the gang is judged by now: the strictest of its ranks' sidecars (None: not said).
    hang_timeout_seconds: float | None = None

    @property
    def rollbacks(self) -> int | None:
        """In-process rollbacks: one collective decision, the largest reported."""
        return _count(self.reported.get("rollbacks"))

    @property
    def skipped_steps(self) -> int | None:
        """Skipped steps: one collective decision, the largest reported."""
        return _count(self.reported.get("skipped_steps"))

    @property
    def samples_seen(self) -> int | None:
        """Samples seen over all ranks (None unless every rank that stepped counted its samples)."""
        return _count(self.reported.get("samples_seen"))

    @property
    def samples_dropped(self) -> int | None:
        """Samples dropped over all ranks (None unless every rank that stepped counted its samples)."""
        return _count(self.reported.get("samples_dropped"))

    @property
    def checkpoint_seconds(self) -> float | None:
        """The slowest rank's last checkpoint write (seconds): what a stop must wait for."""
        return _measure(self.reported.get("checkpoint_seconds"))

    @property
    def max_steps(self) -> int | None:
        """The step the loop declared it ends at: the largest any rank declared (None: none did)."""
        return _count(self.reported.get("max_steps"))

    @property
    def checkpoint_every_steps(self) -> int | None:
        """The checkpoint interval in force, as rank 0 (which chooses it under auto) reported it."""
        return _count(self.reported.get("checkpoint_every_steps"))

    @property
    def checkpoint_cadence(self) -> str:
        """Why that interval, as rank 0 reported it ("": not said)."""
        cadence = self.reported.get("checkpoint_cadence")
        return cadence if isinstance(cadence, str) else ""

    @property
    def last_step(self) -> int | None:
        """The furthest step the gang was seen to reach: the fastest rank's (None: no report)."""
        return self.progress.fastest_step if self.progress is not None else None

    @property
    def missing(self) -> tuple[int, ...]:
        """The ranks of the world that have not reported."""
        reported = {r.rank for r in self.ranks}
        return tuple(r for r in range(self.world_size) if r not in reported)

    @property
    def phases(self) -> dict[int, Phase]:
        """Each reporting rank's phase."""
        return {r.rank: r.phase for r in self.ranks}

    @property
    def failing(self) -> tuple[int, ...]:
        """The ranks whose phase says they failed (diverged or failed), by rank."""
        return tuple(r.rank for r in self.ranks if r.phase in FAILING_PHASES)

    @property
    def first_failing(self) -> int | None:
        """The failing rank that failed first: the lowest step (then the lowest rank); None if none."""
        failing = [r for r in self.ranks if r.phase in FAILING_PHASES]
        return min(failing, key=lambda r: (r.step, r.rank)).rank if failing else None

    @property
    def drop_rate(self) -> float | None:
        """Dropped over seen samples over all reporting ranks (0 before any sample; None: no report)."""
        return _measure(self.reported.get("drop_rate"))

    def writes_in_flight(self, alive: Iterable[int]) -> tuple[WriteInFlight, ...]:
        """The checkpoint writes the ``alive`` ranks (whose processes still run: a dead rank's write died
        with it) reported still in flight (``contract.stopping``): what a stop of the gang after
        it lost a rank waits for."""
        running = set(alive)
        return tuple(
            WriteInFlight(r.checkpoint_write_since, r.checkpoint_seconds)
            for r in self.ranks
            if r.checkpoint_write_since is not None and r.rank in running
        )

    def rank(self, rank: int) -> RankState | None:
        """What ``rank`` reported, or None."""
        return next((r for r in self.ranks if r.rank == rank), None)

    @property
    def lead(self) -> RankState | None:
        """The lowest reporting rank (rank 0 when it reported): the one whose loss a chart shows."""
        return self.ranks[0] if self.ranks else None

    def straggler_scores(self, threshold: float) -> tuple[RankScore, ...]:
        """Each running rank's compute score against the others' (``trainguard.core.straggler``); ranks
        that are not running (starting, ended, failed) are not scored."""
        return score_ranks(
            (
                RankPace(r.rank, r.compute_seconds, r.best_compute_seconds)
                for r in self.ranks
                if r.phase is Phase.RUNNING
            ),
            threshold,
        )

    def straggler(
        self, threshold: float, places: Mapping[int, str] | None = None
    ) -> StragglerObservation | None:
        """The worst straggler at ``threshold`` as the policy takes it, with where the executor placed it
        (``places`` by rank: "pod p on node n"); None when no rank is one."""
        worst = worst_straggler(self.straggler_scores(threshold))
        if worst is None:
            return None
        return StragglerObservation(
            rank=worst.rank,
            score=worst.score,
            own_score=worst.own_score,
            reason=worst.describe(),
            place=(places or {}).get(worst.rank, ""),
        )

    def rank_observation(self, rank: int, process: ProcessState) -> RankObservation:
        """The policy's view of ``rank``: see ``rank_observation``."""
        return rank_observation(rank, self.rank(rank), process)


def rank_observation(rank: int, state: RankState | None, process: ProcessState) -> RankObservation:
    """The policy's view of one rank: its process as the executor saw it, and its own last report
    (see ``_judged``), with the rank's own evidence (its step and activity, when it reported) and the
    place the executor knows it by."""
    return replace(_judged(rank, state, process), **_evidence(state, process))


def _judged(rank: int, state: RankState | None, process: ProcessState) -> RankObservation:
    """How one rank is doing, from its process as the executor saw it and its own last report.

    A failed exit is judged by the code the worker's guardian declared in its last report when there is
    one, and described by it: a launcher such as torchrun exits 1 whatever its workers' codes were, and
    a worker that declared its failure may still die by a signal in the interpreter's teardown (PyTorch's
    gloo threads end in std::terminate or SIGSEGV now and then), which must not make the same failure
    look like another one to the deterministic-failure rule. For the same reason a worker that declared
    itself finished (its final checkpoint durable) and then died by a signal succeeded. A rank that reports
    ``diverged`` (or exited with the diverged code) is diverged, whatever else its
    exit code (or none yet), its liveness or its pod say: a diverged worker fails its liveness probe and
    may die in its teardown, and neither is a hang nor a crash. A rank that exited with a failure
    carries its own last message when that says why (phase ``failed``, or a configuration error: the
    message names the field and the reason).
    """
    code = process.exit_code
    exit_reason = process.exit_reason
    declared = state.exit_code if state is not None else None
    if code not in (None, 0) and declared is not None:
        if declared != 0:
            code, exit_reason = declared, describe_exit(declared)
        elif state is not None and state.phase is Phase.FINISHED and killed_by_signal(code):
            code = ExitCode.SUCCEEDED
    if code == ExitCode.SUCCEEDED:
        return RankObservation(rank=rank, exit_code=0, alive=None)
    alive = process.alive if code is None else None
    if code == ExitCode.DIVERGED or (state is not None and state.phase is Phase.DIVERGED):
        own = state.message if state is not None and state.phase is Phase.DIVERGED else ""
        why = own or exit_reason or process.health_reason
        return RankObservation(
            rank=rank, exit_code=code, alive=alive, reason=why, diverged=True, ended_at=process.ended_at
        )
    if process.lost:
        return RankObservation(rank=rank, alive=None, lost=True, reason=process.lost)
    if code is not None:
        reason = exit_reason or describe_exit(code)
        says_why = state is not None and (state.phase is Phase.FAILED or code == ExitCode.CONFIG_ERROR)
        if says_why and state is not None and state.message and state.message not in reason:
            reason = with_detail(reason, state.message)
        return RankObservation(
            rank=rank, exit_code=code, alive=None, reason=reason, ended_at=process.ended_at
        )
    return RankObservation(rank=rank, alive=alive, reason=process.health_reason if alive is False else "")


def _evidence(state: RankState | None, process: ProcessState) -> dict[str, Any]:
    """Where the rank was by its own last report, and where the executor placed it."""
    if state is None:
        return {"place": process.place}
    return {
        "step": state.step,
        "activity": state.activity,
        "activity_since": state.activity_since,
        "place": process.place,
    }


def _count(value: Value) -> int | None:
    return value if isinstance(value, int) else None


def _measure(value: Value) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _collective(values: Iterable[int]) -> int | None:
    found = list(values)
    return max(found) if found else None


def _newest_checkpoint(statuses: Iterable[WorkerStatus]) -> CleanCheckpoint | None:
    refs = [s.last_clean_checkpoint for s in statuses if s.last_clean_checkpoint is not None]
    if not refs:
        return None
    ref = max(refs, key=lambda c: c.step)
    return CleanCheckpoint(step=ref.step, path=ref.path, sha256=ref.sha256, time=ref.time)


def _progress(ranks: tuple[RankState, ...]) -> Progress | None:
    if not ranks:
        return None
    slowest = min(r.step for r in ranks)
    fastest = max(r.step for r in ranks)
    return Progress(
        step=slowest,
        fastest_step=fastest,
        slowest_ranks=tuple(r.rank for r in ranks if r.step == slowest),
        fastest_ranks=tuple(r.rank for r in ranks if r.step == fastest),
    )


def observe_gang(
    statuses: Mapping[int, WorkerStatus | None],
    world_size: int,
    hang_timeouts: Mapping[int, float | None] | None = None,
) -> GangView:
    """The gang view of ``world_size`` ranks from their statuses by rank (None or absent: not reported;
    a rank outside ``0 .. world_size - 1`` is ignored), with the hang timeout each rank's sidecar said it
    judges by (``hang_timeouts``; the gang's is the strictest)."""
    reported = {
        rank: status
        for rank, status in sorted(statuses.items())
        if status is not None and 0 <= rank < world_size
    }
    ranks = tuple(RankState.of(rank, status) for rank, status in reported.items())
    return GangView(
        world_size=world_size,
        ranks=ranks,
        progress=_progress(ranks),
        # Every rank resumes from the same checkpoint; the largest is taken should they disagree.
        resumed_step=_collective(r.resumed_step for r in ranks if r.resumed_step is not None),
        stepped=any(r.stepped for r in ranks),
        checkpoint=_newest_checkpoint(reported.values()),
        reported=fold_ranks({r.rank: r.reported for r in ranks}),
        hang_timeout_seconds=min(
            (t for r, t in (hang_timeouts or {}).items() if t is not None and 0 <= r < world_size),
            default=None,
        ),
    )

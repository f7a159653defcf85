"""How the sidecar judges its worker alive and ready. Pure: a reading of the status and of the sidecar's
clocks in, a verdict and the new tracking state out; no I/O, no clock of its own.

The worker's wall-clock timestamps are untrusted. On its own monotonic clock the sidecar remembers when it
first saw the worker (identified by ``pid`` and ``started_at``) and when the worker's progress (``phase``,
``step``, ``steps_total``) last changed, and it measures every time limit from those. A worker's
timestamps may only make a verdict stricter (a plausible past ``last_step_time`` older than the hang
timeout is a hang even when the sidecar itself has just started), never looser. A timestamp in the future
(beyond ``clock_skew_seconds``) is a failure to report: the worker gets the startup grace, then is not
alive.

The hang timeout of a running worker is learned from its pace (``trainer_sidecar.contract.hang``): the
worker publishes the gaps between its progress changes, timed where it writes them; the sidecar turns
them into a deadline with its own ceiling (``hang_timeout_seconds``) and floor
(``hang_timeout_floor_seconds``), so what a worker publishes can only bring its deadline down from the
ceiling to the floor, a stricter verdict, never a looser one. Only the running phase is judged by it:
starting, rolling back and busy sections keep their own allowances, and a worker without a readable
status is judged by the ceiling.

**The kill waits for a checkpoint write in flight.** A worker judged not alive by a time limit (a hang, a
busy section or a rollback overrun, no first step) may have a checkpoint write still running in the
background: it needs no collective, and losing it costs a whole checkpoint interval. The kubelet kills
such a worker with the probe's own grace, a moment (the worker cannot act on SIGTERM), so the liveness
probe keeps passing (``Health.kill_held``) while that write is expected to finish by the rule the
runners stop a broken gang by (``trainer_sidecar.contract.stopping``): twice the rank's last write from
when this one started; the startup grace for its first. The verdict itself (``alive``, what the
operator acts on) is unchanged. As with every claim of the worker, the hold is bounded by the sidecar's
own settings: never longer than the startup grace from the write's start, and never past the hang
timeout's ceiling plus the startup grace after the worker's last progress.

**Under the launcher** (``trainguard-launch``, which restarts its worker in place on an order), the
launcher's state (``trainer_sidecar.contract.inplace``) comes first (``under_launcher``): a worker that
exited, or is being stopped for an ordered attempt, is not alive at once, with its kill held while the
launcher waits for the order or stops it (bounded by the startup grace from the exit or the order); a
status older than the attempt the launcher runs is the previous attempt's, and the new worker gets the
startup grace from its start.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainer_sidecar.contract.allowance import OpenSection, busy_allowance
from trainer_sidecar.contract.hang import hang_deadline
from trainer_sidecar.contract.inplace import MAX_START_DELAY_SECONDS, LauncherPhase, LauncherState
from trainer_sidecar.contract.status import BusySection, Phase, WorkerStatus
from trainer_sidecar.contract.stopping import WriteInFlight, write_expected_by

#: How far in the future a worker's timestamp may be before it is implausible. The worker and its sidecar
#: read the same host clock, so this only has to absorb the clock being stepped back a little.
DEFAULT_CLOCK_SKEW_SECONDS = 30.0

#: A worker's identity: its process id and the wall-clock time its guardian was created.
WorkerIdentity = tuple[int, float]
#: What changes when a worker makes progress: its phase, step and cumulative step count.
Progress = tuple[Phase, int, int]
#: A busy section as the sidecar tells sections apart: what, since when, for how long, and which of the
#: sections alike it is (a section closed and opened again has another ``since``).
SectionKey = tuple[str, float, float | None, int]


@dataclass(frozen=True)
class HealthPolicy:
    """The limits a worker is judged by, in seconds: no progress for longer than ``hang_timeout_seconds``
    is a hang; a fresh worker (or a rollback) gets ``startup_grace_seconds``; timestamps more than
    ``clock_skew_seconds`` ahead of the sidecar's wall clock are implausible."""

    hang_timeout_seconds: float
    startup_grace_seconds: float
    clock_skew_seconds: float = DEFAULT_CLOCK_SKEW_SECONDS
    #: The learned hang deadline's floor (None, or at least ``hang_timeout_seconds``: not learned, the
    #: fixed rule); see ``hang_timeout``.
    hang_timeout_floor_seconds: float | None = None


def hang_timeout(policy: HealthPolicy, status: WorkerStatus | None) -> float:
    """The hang timeout a running worker is judged by now: learned from the gaps ``status`` publishes
    and its last checkpoint's write time, between the policy's floor and its ceiling
    (``contract.hang.hang_deadline``); the ceiling without a status or before the warm-up."""
    if status is None:
        return policy.hang_timeout_seconds
    return hang_deadline(
        policy.hang_timeout_seconds,
        policy.hang_timeout_floor_seconds,
        status.gaps,
        status.checkpoint_seconds,
    )


@dataclass(frozen=True)
class Clocks:
    """One reading of the sidecar's two clocks: ``monotonic`` (time limits are measured on it) and
    ``wall`` (unix seconds; the worker's timestamps are checked against it)."""

    monotonic: float
    wall: float


@dataclass(frozen=True)
class Health:
    """A verdict on a worker: ``alive`` drives liveness, ``ready`` readiness; ``reason`` says why.
    ``kill_held``: not alive, but its liveness probe still passes while its checkpoint write in flight is
    expected to finish (module docstring); never set on a worker judged alive."""

    alive: bool
    ready: bool
    reason: str
    kill_held: bool = False

    @property
    def liveness_passes(self) -> bool:
        """What ``/healthz`` answers: alive, or not alive with its kill held."""
        return self.alive or self.kill_held


@dataclass(frozen=True)
class Tracking:
    """What the sidecar remembers of its worker between readings; every time is on its monotonic clock.

    ``identity_since`` is where the current worker's startup grace counts from: the sidecar's start for
    the first worker it sees (as for no worker at all), the moment a later one (a worker restarted beside
    the sidecar) was first seen; ``progress_since`` when its progress last changed; ``stepped`` whether its
    step or step count changed while the sidecar watched it; ``sections`` when it first saw each of the
    worker's open busy sections (by ``SectionKey``)."""

    identity: WorkerIdentity | None
    identity_since: float
    progress: Progress | None
    progress_since: float
    stepped: bool = False
    sections: tuple[tuple[SectionKey, float], ...] = ()

    @classmethod
    def begin(cls, monotonic: float) -> Tracking:
        """The state of a sidecar that started at ``monotonic`` and has not seen a status yet."""
        return cls(identity=None, identity_since=monotonic, progress=None, progress_since=monotonic)


def section_keys(sections: list[BusySection]) -> list[SectionKey]:
    """The key of each section (see ``SectionKey``), in order."""
    counted: dict[tuple[str, float, float | None], int] = {}
    keys: list[SectionKey] = []
    for section in sections:
        base = (section.reason, section.since, section.seconds)
        counted[base] = counted.get(base, -1) + 1
        keys.append((*base, counted[base]))
    return keys


def _seen_sections(
    previous: tuple[tuple[SectionKey, float], ...], status: WorkerStatus, monotonic: float
) -> tuple[tuple[SectionKey, float], ...]:
    """When each open section of ``status`` was first seen: as remembered, or ``monotonic`` if new."""
    if status.phase is not Phase.BUSY:
        return ()
    remembered = dict(previous)
    return tuple((key, remembered.get(key, monotonic)) for key in section_keys(status.busy_sections))


def track(tracking: Tracking, status: WorkerStatus | None, monotonic: float) -> Tracking:
    """``tracking`` after reading ``status`` at ``monotonic``. An unreadable status changes nothing: it is
    no evidence of progress. A new identity (a worker restarted beside the sidecar) starts afresh."""
    if status is None:
        return tracking
    identity = (status.pid, status.started_at)
    progress = (status.phase, status.step, status.steps_total)
    if identity != tracking.identity:
        grace_from = tracking.identity_since if tracking.identity is None else monotonic
        sections = _seen_sections((), status, monotonic)
        return Tracking(identity, grace_from, progress, monotonic, sections=sections)
    sections = _seen_sections(tracking.sections, status, monotonic)
    if progress == tracking.progress:
        return tracking if sections == tracking.sections else replace(tracking, sections=sections)
    stepped = tracking.progress is None or progress[1:] != tracking.progress[1:]
    return replace(
        tracking,
        progress=progress,
        progress_since=monotonic,
        stepped=tracking.stepped or stepped,
        sections=sections,
    )


def implausible_timestamps(status: WorkerStatus, wall: float, clock_skew_seconds: float) -> str:
    """Which of the worker's timestamps lie in the future of ``wall`` by more than the skew allowance
    (empty: none). Anything that does not compare as at most the limit (NaN included) counts."""
    limit = wall + clock_skew_seconds
    stamps: dict[str, float | None] = {
        "started_at": status.started_at,
        "updated_at": status.updated_at,
        "last_step_time": status.last_step_time,
        "busy_since": status.busy_since,
        "checkpoint_write_since": status.checkpoint_write_since,
    }
    stamps.update({f"busy_sections[{i}].since": each.since for i, each in enumerate(status.busy_sections)})
    late = [
        f"{name} is {value - wall:.6g} s ahead of the sidecar's clock"
        for name, value in stamps.items()
        if value is not None and not value <= limit
    ]
    return "; ".join(late)


def _elapsed(since: float, clocks: Clocks, wall_start: float | None = None) -> float:
    """Seconds since ``since`` on the monotonic clock, or since ``wall_start`` on the wall clock if that
    is longer (a worker's timestamp may only make a limit come sooner)."""
    elapsed = clocks.monotonic - since
    if wall_start is not None:
        elapsed = max(elapsed, clocks.wall - wall_start)
    return elapsed


def _graced(elapsed: float, grace: float, within: str, after: str) -> Health:
    """Alive but not ready while ``elapsed`` is inside the grace, not alive after it."""
    if elapsed < grace:
        return Health(alive=True, ready=False, reason=within)
    return Health(alive=False, ready=False, reason=after)


def _unreported(tracking: Tracking, read_error: str, clocks: Clocks, policy: HealthPolicy) -> Health:
    grace, hang = policy.startup_grace_seconds, policy.hang_timeout_seconds
    stalled = _elapsed(tracking.progress_since, clocks)
    if tracking.stepped and stalled > hang:
        return Health(
            alive=False,
            ready=False,
            reason=f"no readable worker status and no step for {stalled:.1f} s (hang timeout {hang:g} s): "
            f"{read_error}",
        )
    waited = _elapsed(tracking.identity_since, clocks)
    return _graced(
        waited,
        grace,
        f"waiting for the worker status ({waited:.0f} s into the startup grace of {grace:g} s): {read_error}",
        f"no readable worker status after the startup grace of {grace:g} s: {read_error}",
    )


def _implausible(tracking: Tracking, what: str, clocks: Clocks, grace: float) -> Health:
    elapsed = _elapsed(tracking.identity_since, clocks)
    return _graced(
        elapsed,
        grace,
        f"worker status has implausible timestamps ({what}); {elapsed:.0f} s into the startup grace "
        f"of {grace:g} s",
        f"worker status has implausible timestamps after the startup grace of {grace:g} s: {what}",
    )


def _rolling_back(tracking: Tracking, status: WorkerStatus, clocks: Clocks, grace: float) -> Health:
    busy = _elapsed(tracking.progress_since, clocks, status.busy_since)
    return _graced(
        busy,
        grace,
        f"rolling back at step {status.step}: restoring and validating for {busy:.0f} s "
        f"(allowed: the startup grace of {grace:g} s)",
        f"rollback at step {status.step} not done within the startup grace of {grace:g} s ({busy:.0f} s)",
    )


def _start(since: float, clocks: Clocks, wall_start: float | None) -> float:
    """Where a limit counts from on the monotonic clock: ``since``, or earlier if the worker's wall-clock
    ``wall_start`` says so (a worker's timestamp may only make a limit come sooner)."""
    return since if wall_start is None else min(since, clocks.monotonic - (clocks.wall - wall_start))


def open_sections(tracking: Tracking, status: WorkerStatus, clocks: Clocks) -> list[OpenSection]:
    """The busy sections the sidecar judges, each with its start on the monotonic clock.

    A worker that lists its sections (``busy_sections``): each from when the sidecar first saw it (or its
    claimed ``since``, if earlier), preceded by the whole busy stretch, from the worker's last progress
    on the sidecar's clock, with no limit of its own (so at most the grace, whatever the worker claims).
    An older worker (``busy_since`` only): the one section it states, from its last progress."""
    if not status.busy_sections:
        start = _start(tracking.progress_since, clocks, status.busy_since)
        return [OpenSection(start, status.busy_seconds, status.busy_reason)]
    first = min(section.since for section in status.busy_sections)
    first = first if status.busy_since is None else min(first, status.busy_since)
    outermost = status.busy_sections[0].reason
    opened = [OpenSection(_start(tracking.progress_since, clocks, first), None, outermost)]
    seen = dict(tracking.sections)
    for key, section in zip(section_keys(status.busy_sections), status.busy_sections, strict=True):
        since = seen.get(key, clocks.monotonic)  # not tracked (a caller's own tracking): first seen now
        opened.append(OpenSection(_start(since, clocks, section.since), section.seconds, section.reason))
    return opened


def _busy(tracking: Tracking, status: WorkerStatus, clocks: Clocks, grace: float) -> Health:
    allowance = busy_allowance(open_sections(tracking, status, clocks), clocks.monotonic, grace)
    assert allowance is not None  # a cap bounds every section, and there is at least one
    busy, allowed = allowance.elapsed, allowance.allowed
    what = allowance.section.reason or status.busy_reason or "busy"
    if allowance.within:
        return Health(
            alive=True,
            ready=False,
            reason=f"busy at step {status.step} ({what}) for {busy:.0f} s (allowed: {allowed:g} s)",
        )
    return Health(
        alive=False,
        ready=False,
        reason=f"busy at step {status.step} ({what}) for {busy:.0f} s, longer than the {allowed:g} s allowed",
    )


def _starting(tracking: Tracking, status: WorkerStatus, clocks: Clocks, grace: float) -> Health:
    since_start = _elapsed(tracking.identity_since, clocks, status.started_at)
    return _graced(
        since_start,
        grace,
        f"starting: no step yet, {since_start:.0f} s into the startup grace of {grace:g} s",
        f"no step within startup grace of {grace:g} s (worker started {since_start:.0f} s ago)",
    )


def _step_of_this_run(status: WorkerStatus) -> float | None:
    """The worker's claimed last step time, if it is a step of this process (not of the run before)."""
    last = status.last_step_time
    return last if last is not None and last >= status.started_at else None


#: Added to a hang's reason when the status shows the last step finished and no busy section open: the
#: worker may be stuck inside the next step, or in the loop's own code between steps (a long evaluation
#: or save that was not marked), which the status cannot tell apart. Bounded: a fixed text.
OUTSIDE_STEPS_HINT = (
    "; the last step finished and no busy section is open: if the loop is evaluating or saving, wrap "
    'that in guardian.busy("eval")'
)


def _stepping(tracking: Tracking, status: WorkerStatus, clocks: Clocks, policy: HealthPolicy) -> Health:
    age = _elapsed(tracking.progress_since, clocks, _step_of_this_run(status))
    hang = hang_timeout(policy, status)
    if age > hang:
        between_steps = (
            status.phase is Phase.RUNNING and status.busy_since is None and not status.busy_sections
        )
        timeout = f"{hang:g} s"
        if hang < policy.hang_timeout_seconds:
            timeout = f"{hang:.1f} s, learned from its pace, at most {policy.hang_timeout_seconds:g} s"
        return Health(
            alive=False,
            ready=False,
            reason=f"no step for {age:.1f} s (hang timeout {timeout}), last step {status.step}"
            + (OUTSIDE_STEPS_HINT if between_steps else ""),
        )
    return Health(
        alive=True,
        ready=True,
        reason=f"{status.phase.value}: step {status.step}, last step {max(age, 0.0):.1f} s ago",
    )


def _ending(tracking: Tracking, status: WorkerStatus, clocks: Clocks, policy: HealthPolicy) -> Health:
    """A worker that published ``failed`` with the code it exits with: its guardian does so as its
    process ends (an exception left the loop), and the exit code tells the crash. Until then it is alive
    but not ready, as a stopped worker is; judged not alive only if it has not ended within the hang
    timeout of the sidecar seeing it fail. Judging it not alive at once made a crash in progress read as
    a hang, named before the peer whose death caused it had been seen to end."""
    detail = f": {status.message}" if status.message else ""
    limit = hang_timeout(policy, status)
    if clocks.monotonic - tracking.progress_since <= limit:
        return Health(
            alive=True,
            ready=False,
            reason=f"worker failed at step {status.step}{detail}; its process is ending",
        )
    return Health(
        alive=False,
        ready=False,
        reason=f"worker phase is failed{detail}; its process did not end within {limit:g} s",
    )


def _kill_held(
    health: Health, tracking: Tracking, status: WorkerStatus, clocks: Clocks, policy: HealthPolicy
) -> Health:
    """``health``, with its kill held while the worker's checkpoint write in flight is expected to finish
    (module docstring); ``health`` itself when it is alive or no write is in flight or the hold is over."""
    since = status.checkpoint_write_since
    if health.alive or since is None:
        return health
    grace = policy.startup_grace_seconds
    writing = clocks.wall - since
    allowed = min(write_expected_by(WriteInFlight(since, status.checkpoint_seconds)) - since, grace)
    stalled = clocks.monotonic - tracking.progress_since
    if not (writing < allowed and stalled < policy.hang_timeout_seconds + grace):
        return health
    return replace(
        health,
        kill_held=True,
        reason=f"{health.reason}; the kill waits for its checkpoint write in flight "
        f"for {max(writing, 0.0):.0f} s (expected within {allowed:g} s)",
    )


def judge(
    tracking: Tracking, status: WorkerStatus | None, read_error: str, clocks: Clocks, policy: HealthPolicy
) -> Health:
    """The verdict on a worker whose latest reading is ``status`` (None: unreadable, ``read_error`` says
    why), given the ``tracking`` that already includes that reading. Promises, in order of precedence:

    The startup grace counts from the sidecar's start for the first worker it sees, from the moment it
    first saw a later one (a restart beside it) for that one (``Tracking.identity_since``).

    * no status: alive but not ready for the startup grace, then not alive; the reason carries
      ``read_error``. A worker seen stepping before is not alive as soon as its last progress is older
      than the hang timeout (an unreadable status is no progress).
    * phase diverged or failed: not alive; the reason names the phase and the worker's message.
    * phase finished: alive and ready. Phase stopped (told to stop, exiting): alive, not ready.
    * a timestamp in the future: alive but not ready for the startup grace, then not alive; the reason
      names the timestamps.
    * phase rolling-back with ``busy_since`` set: alive but not ready while the rollback has taken less
      than the startup grace (since the sidecar saw it begin, or since ``busy_since`` if that is earlier);
      then not alive. A rollback makes no steps, and its validation may take far longer than the hang
      timeout.
    * phase busy with ``busy_since`` set (``Guardian.busy``, or waiting for a busy peer): the same, while
      every open section is within its own bound, measured from its own start (``busy_seconds`` capped at
      the startup grace, the grace when not given; see ``trainer_sidecar.contract.allowance``), and the
      whole busy stretch within the grace. A worker older than ``busy_sections`` states one section.
    * no step in this run of the worker (none seen by the sidecar, and ``last_step_time`` is None or older
      than ``started_at``): alive but not ready for the startup grace (counted from ``started_at`` if
      that is earlier), then not alive.
    * otherwise: not alive once its progress has not changed for longer than the hang timeout (or its
      ``last_step_time`` of this run is older than that); else alive and ready. The hang timeout is
      ``hang_timeout(policy, status)``: learned from the worker's pace, between the floor and the
      ceiling.

    A worker not alive by one of the last four rules has its kill held (``Health.kill_held``) while its
    checkpoint write in flight is expected to finish (module docstring).
    """
    grace = policy.startup_grace_seconds
    if status is None:
        return _unreported(tracking, read_error, clocks, policy)
    if status.phase is Phase.FAILED and status.exit_code is not None:
        return _ending(tracking, status, clocks, policy)
    if status.phase in (Phase.DIVERGED, Phase.FAILED):
        detail = f": {status.message}" if status.message else ""
        return Health(alive=False, ready=False, reason=f"worker phase is {status.phase.value}{detail}")
    if status.phase is Phase.FINISHED:
        return Health(alive=True, ready=True, reason=f"worker finished at step {status.step}")
    if status.phase is Phase.STOPPED:
        detail = f": {status.message}" if status.message else ""
        return Health(alive=True, ready=False, reason=f"worker stopped at step {status.step}{detail}")
    implausible = implausible_timestamps(status, clocks.wall, policy.clock_skew_seconds)
    if implausible:
        return _implausible(tracking, implausible, clocks, grace)
    if status.phase is Phase.ROLLING_BACK and status.busy_since is not None:
        health = _rolling_back(tracking, status, clocks, grace)
    elif status.phase is Phase.BUSY and status.busy_since is not None:
        health = _busy(tracking, status, clocks, grace)
    elif not tracking.stepped and _step_of_this_run(status) is None:
        health = _starting(tracking, status, clocks, grace)
    else:
        health = _stepping(tracking, status, clocks, policy)
    return _kill_held(health, tracking, status, clocks, policy)


def assess_health(
    tracking: Tracking, status: WorkerStatus | None, read_error: str, clocks: Clocks, policy: HealthPolicy
) -> tuple[Health, Tracking]:
    """Fold one reading into ``tracking`` and judge it: the verdict (see ``judge``) and the new state."""
    tracked = track(tracking, status, clocks.monotonic)
    return judge(tracked, status, read_error, clocks, policy), tracked


def _stopping(launcher: LauncherState, since: float, wall: float, grace: float) -> Health:
    """A worker its launcher is stopping for a newer attempt (ordered at ``since``, on the sidecar's
    clock ``wall``): not alive, its kill held for ``grace`` from the order, or from the attempt's start
    when the order delays it."""
    if launcher.starts_at is not None and launcher.starts_at > since:
        # The order's backoff: the hold counts from the attempt's start, at most the longest delay
        # an order may ask after the order.
        starts = min(launcher.starts_at, since + MAX_START_DELAY_SECONDS)
        return Health(
            alive=False,
            ready=False,
            kill_held=wall - starts < grace,
            reason=f"the launcher stopped the worker; attempt {launcher.attempt} starts in "
            f"{max(0.0, starts - wall):.0f} s (the gang's backoff)",
        )
    waited = wall - since
    return Health(
        alive=False,
        ready=False,
        kill_held=waited < grace,
        reason=f"the launcher is stopping the worker for attempt {launcher.attempt} ({waited:.0f} s)",
    )


def under_launcher(
    health: Health,
    launcher: LauncherState | None,
    status: WorkerStatus | None,
    clocks: Clocks,
    policy: HealthPolicy,
) -> Health:
    """``health`` (the status file's verdict) as the launcher's state changes it (module docstring):

    * no launcher: ``health``;
    * the worker exited: not alive; its kill held while the launcher waits for an order, at most the
      startup grace from the exit (``since`` of the state: the launcher's claim; a time ahead of the
      sidecar's clock by more than the skew holds nothing, and a running state that claims one is
      ignored);
    * stopping for a newer attempt: not alive, its kill held the same way from the order, or from the
      attempt's start when the order delays it (a backoff);
    * running, and no status, or one older than the attempt's start (the previous attempt's): alive, not
      ready, for the startup grace from the start, then not alive;
    * otherwise ``health``.
    """
    if launcher is None:
        return health
    grace = policy.startup_grace_seconds
    ahead = launcher.since - clocks.wall
    if ahead > policy.clock_skew_seconds:
        # A claim the sidecar cannot time: it holds nothing and excuses nothing.
        if launcher.phase is LauncherPhase.RUNNING:
            return health
        return Health(
            alive=False,
            ready=False,
            reason=f"the launcher's state is {launcher.phase.value} for attempt {launcher.attempt}, "
            f"since a time {ahead:.0f} s ahead of the sidecar's clock",
        )
    since = min(launcher.since, clocks.wall)
    waited = clocks.wall - since
    held = waited < grace
    if launcher.phase is LauncherPhase.EXITED:
        return Health(
            alive=False,
            ready=False,
            kill_held=held,
            reason=f"the worker of attempt {launcher.attempt} exited with code {launcher.exit_code}"
            + (f"; the launcher waits for an order ({waited:.0f} s of {grace:g} s)" if held else ""),
        )
    if launcher.phase is LauncherPhase.STOPPING:
        return _stopping(launcher, since, clocks.wall, grace)
    # Both times are read from the pod's one clock, by processes of one container: no skew to allow.
    if status is not None and status.started_at >= launcher.since:
        return health
    return _graced(
        waited,
        grace,
        f"attempt {launcher.attempt} started in place {waited:.0f} s ago; waiting for its worker's status "
        f"(startup grace {grace:g} s)",
        f"attempt {launcher.attempt}'s worker wrote no status within the startup grace of {grace:g} s",
    )

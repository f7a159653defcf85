"""The recovery policy: given what was observed of a gang, what to do next. Pure: no I/O, no clock.

Both the operator and ``trainguard run`` call ``decide`` and carry out its decision; nothing about
restarts is decided anywhere else. A gang is restarted as a whole because a single restarted rank
cannot rejoin a running collective.

Idempotence: an observation names the attempt it was made in and the last attempt whose failure was
already acted on. A failure of an attempt that was already handled yields WAIT, so an operator that
restarts in the middle of a recovery does not restart the gang twice.

Attribution: when several ranks have failed by the time the executor looks, the decision names one, and
its reason names that rank first ("rank C ..."; "ranks A, B ..." only when nothing tells them apart, the
lowest blamed), the ranks that waited for it or failed with it after. A misconfigured, fenced or diverged
rank comes before a crashed one, a crash before a lost or hung rank; among ranks failing alike, the one
that ended first (then one killed by a signal; then, by their activity, one that was in its own work
before one in a collective; then the lowest rank), since a rank whose peer died usually exits 1 from the
collective a moment later.

A crash whose reason says a peer's connection went away (gloo's "Connection closed by peer", NCCL's
remote error: ``lost_a_peer``) is an effect, named only when no rank failed otherwise (a peer lost or
hung is named first, and the crash after it: "rank 0 crashed after losing it as a peer"). Each pod's end
reaches the executor on its own, so the effect is often seen before its cause: while every failure seen
is such an effect and another rank still runs, the decision is WAIT for up to
``PEER_FAILURE_GRACE_SECONDS`` after the effect ended (``Observation.now``, on the clock of
``ended_at``), for the cause's own exit to show. After that the effect is named (a peer that never
exits is hung, and judged so by its liveness).

Hangs are read from where each rank's guardian last said its training thread was
(``RankObservation.activity``, the status contract's ``Activity``). A gang steps in lockstep: when one
rank stops, the others stop in their next collective and look hung too. Among hung ranks the cause is
one in its own work (the loop's code, the data, the guardian's step, a checkpoint, a busy section), then
one in its backward pass, then one that reported nothing, and last one waiting in a collective (the
guardian's, or one the loop called through torch.distributed); among equals the lowest step, then the
one that entered its activity first, then the lowest rank. The reason names it first, its place when the
executor knows it (pod, node), then the ranks that waited for it ("rank 1 hung at step 15 in its own
work (the loop: next batch or forward pass): ...; rank 0 waited for it in a collective"), hung or still
running. When every hung rank is waiting in a collective, a running rank that reports its own work (or
its backward pass) is what they wait for (its liveness may merely not have failed yet: each sidecar
times its own rank, so the waiting rank's verdict often fires first); so is a running rank in its own
work when the hung ranks are in their backward pass (under DDP they wait there for its gradients). It is
named first all the same ("rank 1 hung at step 40 in its own work (...): its own liveness had not failed
yet, rank 0's had (...); rank 0 waited for it in the backward pass"). When they all wait and no such rank
exists, the lowest step (then the earliest, then the lowest rank) is named, and the reason says they
were all waiting. A gang that reports no activity (workers older than the field) is named as before:
every hung rank, lowest first.

What the guardian can and cannot tell apart: it marks its own calls, and the waits of the collectives
the loop calls through torch.distributed where the host blocks in them (gloo; a barrier). Under
DistributedDataParallel the gradient all-reduce runs inside the backward pass (in C++), so a rank in
backward may be computing or waiting for a peer's gradients: a rank stuck in its own forward pass never
reaches backward and is told apart (loop before backward), but two ranks both in backward are not (the
step, the time, the rank decide). Under NCCL a collective's wait returns before the GPU finished it, and
the host waits at the loop's next host sync: a rank waiting so reads as its own work.

Stragglers: a running gang whose view names a straggler (``Observation.straggler``, from
``trainguard.core.straggler``) is restarted only under ``health.straggler.action: restart`` and while
restarts are left (the restart counts against ``maxRestarts``, with its backoff); the executor's next
attempt keeps off the straggler's node. Otherwise, and whenever a rank has failed, it is only reported.

Deterministic failures: a failure that repeats exactly is not retried ``maxRestarts`` times. Every
failure decided carries its ``FailureSignature`` (kind, step, exit code, the failing rank's own reason,
the attempt, and how many attempts in a row failed so); the executor records it and hands it back as
the next observation's ``previous_failure``. When ``recovery.deterministicFailureLimit`` attempts in a
row (default 2; 0: never) crashed with the same exit code and reason at the same step, the job fails
with ``FailureKind.DETERMINISTIC``: a resumed attempt that crashes where the one before did, after
replaying the same steps from the same checkpoint, will crash there again. Only a crash by the
process's own exit code counts: a hang, a lost pod or node, a kill by a signal (the OOM killer, a
liveness kill, a preemption: the cause is outside the process and usually passes) and a divergence (the
restart changes the run with a remediation) always get the full policy, and a crash at another step
(progress was made, or lost) or with another reason is a new failure. The reason is compared without
what varies between two runs of the same code (``trainguard.core.cause.stable_cause``: pids, memory
addresses, times, durations, temporary paths, IP addresses, ports, thread ids): a DataLoader worker a
corrupt sample kills is named by its pid, a new one every attempt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from trainer_sidecar.contract.exitcodes import ExitCode, describe_exit
from trainer_sidecar.contract.settings import Remediation
from trainer_sidecar.contract.status import Activity
from trainguard.core.cause import stable_cause
from trainguard.core.spec import RecoverySpec, StragglerSpec


class Action(StrEnum):
    """What the executor does."""

    CONTINUE = "continue"  # nothing wrong: keep watching
    WAIT = "wait"  # a decision was already taken for this attempt: carry it out, decide nothing new
    RESTART = "restart"  # stop the whole gang now, start the next attempt after delay_seconds
    SUCCEED = "succeed"  # the job finished: final
    FAIL = "fail"  # give up: final


class FailureKind(StrEnum):
    """Why a rank counts as failed."""

    CRASH = "Crashed"
    HANG = "Hung"
    DIVERGED = "Diverged"
    CONFIG = "ConfigError"
    FENCED = "Fenced"
    LOST = "Lost"
    #: Not a rank's failure: the verdict on a crash that repeated identically (see the module docstring).
    DETERMINISTIC = "DeterministicFailure"
    #: Not a failure either: a rank slower than the gang, restarted away from under ``action: restart``.
    STRAGGLER = "Straggler"


@dataclass(frozen=True)
class RankObservation:
    """One rank as seen by the executor.

    ``exit_code`` is None while the process (container) runs; negative means killed by that signal.
    ``alive`` is the sidecar's liveness verdict (None: not known yet); ``lost`` means the pod or node
    is gone without an exit code (deleted, evicted, node lost). ``ended_at`` is when the process ended,
    in seconds on any clock the executor uses for all ranks alike (None: running, or not known).
    The rank's own evidence, from its last status (None: not reported): ``step``, ``activity`` (where its
    training thread was) and ``activity_since`` (since when, on the worker's clock). ``place`` is where
    the executor knows it ("pod p on node n"; "": nothing to add).
    """

    rank: int
    exit_code: int | None = None
    alive: bool | None = True
    reason: str = ""
    diverged: bool = False
    lost: bool = False
    ended_at: float | None = None
    step: int | None = None
    activity: Activity | None = None
    activity_since: float | None = None
    place: str = ""


@dataclass(frozen=True)
class StragglerObservation:
    """The worst straggler of the gang view (``GangView.straggler``): its rank, its score against the other
    ranks and against its own best, the score in words, and where the executor placed it."""

    rank: int
    score: float
    own_score: float | None = None
    reason: str = ""
    place: str = ""


#: A signature's cause is cut to this many characters, so that it is stored whole (the status caps
#: messages at 1024) and compares equal when read back.
MAX_CAUSE_CHARS = 1000
#: What ends a text cut short: by a signature (and a worker's status), or by the operator's status.
_CUT_MARKS = ("...", "…")
#: The fewest characters two causes, one of them cut short, must agree on to count as the same.
MIN_CUT_CAUSE_CHARS = 200


def signature_cause(reason: str) -> str:
    """The cause a signature keeps of a failing rank's ``reason``: made stable (``stable_cause``: no pid,
    memory address, time, temporary path, IP address or port in it) and cut to ``MAX_CAUSE_CHARS``
    (marked "...")."""
    cause = stable_cause(reason)
    return cause if len(cause) <= MAX_CAUSE_CHARS else cause[: MAX_CAUSE_CHARS - 3] + "..."


def _whole_part(cause: str) -> str | None:
    """What of a cause cut short is whole: without its mark and its last two words (the cut may have split
    a volatile token, a time or a duration of two words, so that it no longer reads as one). None: not cut."""
    for mark in _CUT_MARKS:
        if cause.endswith(mark):
            return cause[: -len(mark)].rsplit(" ", 2)[0]
    return None


def same_cause(first: str, second: str) -> bool:
    """Whether two failures' causes are the same: alike once made stable (``stable_cause``, so that a raw
    cause recorded by an older version compares too), or, when either was cut short (a status message,
    the termination message, a signature: each at its own length), alike as far as both are whole, over
    at least ``MIN_CUT_CAUSE_CHARS`` characters."""
    first, second = stable_cause(first), stable_cause(second)
    if first == second:
        return True
    cut_first, cut_second = _whole_part(first), _whole_part(second)
    if cut_first is not None and cut_second is not None:
        whole, other = sorted((cut_first, cut_second), key=len)
    elif cut_first is not None:
        whole, other = cut_first, second
    elif cut_second is not None:
        whole, other = cut_second, first
    else:
        return False
    return len(whole) >= MIN_CUT_CAUSE_CHARS and other.startswith(whole)


@dataclass(frozen=True)
class FailureSignature:
    """What identifies a failure when the next one is compared with it, as plain values an executor can
    store (the operator in ``status.lastFailure``, the local runner in memory).

    ``kind``, ``step`` (the step the failure's reason names; None: not known), ``exit_code`` and
    ``cause`` (the failing rank's own reason: its exit described, with the worker's message or log line,
    made stable by ``signature_cause``) are compared (the cause by ``same_cause``); ``attempt`` is the
    attempt that failed and ``repeats`` how many attempts in a row, up to it, failed with this signature
    (1: the first).
    """

    kind: FailureKind
    step: int | None
    exit_code: int | None
    cause: str
    attempt: int
    repeats: int = 1

    @property
    def repeatable(self) -> bool:
        """Whether a repeat of this failure says it is deterministic: a crash by the process's own exit
        code (not a signal from outside, not a hang, a lost rank or a divergence)."""
        return self.kind is FailureKind.CRASH and not killed_by_signal(self.exit_code)

    def same_as(self, other: FailureSignature) -> bool:
        """Whether ``other`` is the same failure: same kind, step and exit code, and the same cause by
        ``same_cause`` (whatever pids, addresses, times or ports its text names)."""
        return (self.kind, self.step, self.exit_code) == (other.kind, other.step, other.exit_code) and (
            same_cause(self.cause, other.cause)
        )

    def following(self, previous: FailureSignature | None) -> FailureSignature:
        """This failure with ``repeats`` counted on from ``previous`` (the failure of the attempt before,
        if any): a repeatable failure the same as a previous one of the attempt just before is one repeat
        more; anything else starts at 1."""
        repeated = (
            previous is not None
            and self.repeatable
            and previous.attempt == self.attempt - 1
            and self.same_as(previous)
        )
        return replace(self, repeats=previous.repeats + 1 if repeated and previous else 1)


@dataclass(frozen=True)
class Observation:
    """Everything the policy looks at, as plain values."""

    attempt: int
    ranks: Sequence[RankObservation]
    restarts: int = 0
    handled_attempt: int = 0
    terminal: Action | None = None
    terminal_reason: str = ""
    #: The furthest step the gang was seen to reach in the view ``ranks`` were observed in (None: not
    #: known). A failure's reason names it, and the decision carries it, so that whatever reports the
    #: failure (a restart's ``last_step``) takes its number from the same look as the reason.
    step: int | None = None
    #: The failure the executor acted on last (the previous attempt's), as it recorded it (None: none).
    previous_failure: FailureSignature | None = None
    #: The gang's worst straggler at the job's threshold (None: none, or not scored).
    straggler: StragglerObservation | None = None
    #: When the observation was made, on the clock of the ranks' ``ended_at`` (None: not known, and a
    #: failure that only lost a peer is decided on at once).
    now: float | None = None


@dataclass(frozen=True)
class Decision:
    """The policy's answer."""

    action: Action
    reason: str = ""
    delay_seconds: float = 0.0
    remediation: Remediation | None = None
    failure: FailureKind | None = None
    rank: int | None = None
    exit_code: int | None = None
    restarts: int = 0
    #: For a failure: the step its reason names (``Observation.step``; None: not known).
    step: int | None = None
    #: For a failure: its signature, for the executor to record and hand back (``previous_failure``).
    signature: FailureSignature | None = None


def backoff_seconds(recovery: RecoverySpec, restarts_done: int) -> float:
    """Wait before the next restart when ``restarts_done`` restarts already happened (last entry caps)."""
    schedule = recovery.backoff_seconds
    return float(schedule[min(max(restarts_done, 0), len(schedule) - 1)])


def classify(rank: RankObservation) -> FailureKind | None:
    """Whether one rank has failed, and how."""
    if rank.exit_code == ExitCode.DIVERGED or rank.diverged:
        return FailureKind.DIVERGED
    if rank.exit_code == ExitCode.CONFIG_ERROR:
        return FailureKind.CONFIG
    if rank.exit_code == ExitCode.FENCED:
        return FailureKind.FENCED
    if rank.exit_code not in (None, 0):
        return FailureKind.CRASH
    if rank.lost:
        return FailureKind.LOST
    if rank.exit_code is None and rank.alive is False:
        return FailureKind.HANG
    return None


#: How a failure of each kind reads after "rank N".
_VERBS = {
    FailureKind.CRASH: "crashed",
    FailureKind.HANG: "hung",
    FailureKind.DIVERGED: "diverged",
    FailureKind.CONFIG: "stopped",
    FailureKind.FENCED: "stopped",
    FailureKind.LOST: "lost",
}

# Which failure explains a gang's state best, when several ranks fail at once: a diverged or
# misconfigured rank makes its peers crash or hang in the collective, not the other way round.
_PRIORITY = [
    FailureKind.CONFIG,
    FailureKind.FENCED,
    FailureKind.DIVERGED,
    FailureKind.CRASH,
    FailureKind.LOST,
    FailureKind.HANG,
]


def killed_by_signal(exit_code: int | None) -> bool:
    """Whether an exit code says the process was killed by a signal (negative: the signal's number, as
    Python reports it; 129 to 192: 128 + N, as a shell or a container runtime reports it)."""
    return exit_code is not None and (exit_code < 0 or 128 < exit_code <= 192)


_NEVER = float("inf")

#: The activities in which a rank waits for its peers in a collective: the guardian's own, and one the
#: loop (its model, its optimizer) called through torch.distributed.
WAITING = frozenset({Activity.COLLECTIVE, Activity.LOOP_COLLECTIVE})


def waiting_order(activity: Activity | None) -> int:
    """How much an activity says a rank waits for its peers (0: its own work; 1: the backward pass, which
    under DDP holds the gradient all-reduce; 2: not reported; 3: a collective): the lower, the likelier
    the rank is a hang's cause."""
    if activity in WAITING:
        return 3
    if activity is None:
        return 2
    return 1 if activity is Activity.BACKWARD else 0


#: How long after a rank failed for losing a peer the decision waits for that peer's own failure to
#: show (a kubelet reports a container's end within about a second; two pods' ends arrive apart).
PEER_FAILURE_GRACE_SECONDS = 5.0

#: What a collective's transport says when the process at the other end went away, lowercased: gloo
#: (its TCP pair), NCCL (a remote error), the TCP store. A rank failing so was waiting for a peer.
_PEER_LOSS_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote worker",
    "remote process exited",
    "ncclremoteerror",
    "failed to recv, got 0 bytes",
)


def lost_a_peer(reason: str) -> bool:
    """Whether a rank's failure reason says a peer's connection went away first: the rank failed
    because another did (its failure is an effect, not a cause)."""
    lowered = reason.lower()
    return any(marker in lowered for marker in _PEER_LOSS_MARKERS)


def _awaiting_the_cause(
    failures: Sequence[tuple[FailureKind, RankObservation]], observation: Observation
) -> bool:
    """Whether every failure seen lost a peer, another rank still runs, and the first of them ended within
    the grace: the cause's own exit is probably on its way (see the module docstring)."""
    if observation.now is None:
        return False
    if not all(k is FailureKind.CRASH and lost_a_peer(r.reason) for k, r in failures):
        return False
    failed = {r.rank for _, r in failures}
    if not any(r.rank not in failed and r.exit_code is None for r in observation.ranks):
        return False
    ended = [r.ended_at for _, r in failures if r.ended_at is not None]
    if not ended:
        return False
    # Both sides of zero: an executor whose clock is behind the node's (a container's end is the
    # node's time) sees the end in the future; the wait stays bounded either way.
    return abs(observation.now - min(ended)) < PEER_FAILURE_GRACE_SECONDS


def _root_cause_order(kind: FailureKind, rank: RankObservation) -> tuple[bool, int, float, bool, int, int]:
    # A rank that says it lost a peer comes after every rank that failed otherwise (a peer lost, hung,
    # diverged: that is what it lost), whenever each ended.
    # Among ranks failing alike, the one that ended first is the cause, its peers' failures the effect
    # (a rank whose peer vanished exits 1 from the collective). Ending times may tie (a container's is
    # in whole seconds): then a rank killed by a signal (OOM, a liveness kill) is the likelier cause than
    # one that exited by itself; then one that was in its own work than one in a collective; then the
    # lowest rank. The signal comes first: a killed rank could not publish where it was (its activity is
    # stale), and a peer waiting in a collective the guardian does not see (under NCCL the host waits at
    # the loop's next host sync, not in the collective) reads as its own work.
    ended = rank.ended_at if rank.ended_at is not None else _NEVER
    evidence = waiting_order(rank.activity)
    return (
        lost_a_peer(rank.reason),
        _PRIORITY.index(kind),
        ended,
        not killed_by_signal(rank.exit_code),
        evidence,
        rank.rank,
    )


def _hang_order(rank: RankObservation) -> tuple[int, float, float, int]:
    """Among hung ranks: own work first, then the lowest step, the earliest activity, the lowest rank."""
    step = rank.step if rank.step is not None else _NEVER
    since = rank.activity_since if rank.activity_since is not None else _NEVER
    return (waiting_order(rank.activity), step, since, rank.rank)


#: What each activity reads as in a reason.
_DOING = {
    Activity.LOOP: "the loop: next batch or forward pass",
    Activity.DATA: "fetching the next batch",
    Activity.BACKWARD: "the backward pass",
    Activity.STEP: "the guardian's step",
    Activity.COLLECTIVE: "a collective",
    Activity.LOOP_COLLECTIVE: "a collective of the loop's (torch.distributed)",
    Activity.CHECKPOINT: "a checkpoint",
    Activity.BUSY: "a busy section",
}


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def deterministic_reason(signature: FailureSignature, reason: str) -> str:
    """The verdict on a failure repeated identically: the attempts, the step, the exit reason and the
    last failure's own reason (``reason``)."""
    first = signature.attempt - signature.repeats + 1
    attempts = list(range(first, signature.attempt + 1))
    named = ", ".join(map(str, attempts[:-1])) + f" and {attempts[-1]}"
    at = f"at step {signature.step}" if signature.step is not None else "before any step was reported"
    return (
        f"deterministic failure: attempts {named} failed alike {at} ({signature.cause}), so another "
        f"restart would fail there too; not retried; last: {reason}"
    )


def _where(rank: RankObservation) -> str:
    """Where the rank's training thread was, as a reason says it after "hung"."""
    if rank.activity is None:
        return ""
    if rank.activity is Activity.BACKWARD:
        return " in its backward pass"
    if rank.activity in WAITING:
        return f" waiting in {_DOING[rank.activity]}"
    return f" in its own work ({_DOING[rank.activity]})"


def _named(rank: RankObservation) -> str:
    """ "rank N", with its place when the executor knows it."""
    return f"rank {rank.rank} ({rank.place})" if rank.place else f"rank {rank.rank}"


def _waited(culprit: RankObservation, others: Sequence[RankObservation]) -> str:
    """The other ranks, by what they were doing: waiting for ``culprit``, or hung too."""
    groups: dict[str, list[int]] = {}
    for other in others:
        if other.activity in WAITING or (
            other.activity is Activity.BACKWARD and waiting_order(culprit.activity) == 0
        ):
            words = f"waited for it in {_DOING[other.activity]}"
        elif other.activity is None:
            words = "hung too"
        else:
            words = f"hung too (in {_DOING[other.activity]})"
        groups.setdefault(words, []).append(other.rank)
    return "; ".join(f"{_ranks(sorted(ranks))} {words}" for words, ranks in groups.items())


def _running_cause(first: RankObservation, ranks: Sequence[RankObservation]) -> RankObservation | None:
    """A rank still running that the hung ranks wait for, when the first of them (``first``) waits: one
    further from a collective than it is, whose liveness may merely not have failed yet (each sidecar times
    its own rank). Waiting in a collective: a peer in its own work or its backward pass; in the backward
    pass (under DDP the gradient all-reduce): a peer in its own work, which never reached its own."""
    if not (first.activity in WAITING or first.activity is Activity.BACKWARD):
        return None
    closer = min(2, waiting_order(first.activity))
    running = [
        r for r in ranks if classify(r) is None and r.exit_code is None and waiting_order(r.activity) < closer
    ]
    return min(running, key=_hang_order) if running else None


def _waiting_for(
    culprit: RankObservation, hung: Sequence[RankObservation], ranks: Sequence[RankObservation]
) -> list[RankObservation]:
    """The ranks a hang's reason names after its culprit: the other hung ranks, and the ranks still running
    that already wait for it (in a collective; in the backward pass, for a culprit in its own work)."""
    waits = waiting_order(culprit.activity) == 0
    running = [
        r
        for r in ranks
        if r.rank != culprit.rank
        and classify(r) is None
        and r.exit_code is None
        and (r.activity in WAITING or (waits and r.activity is Activity.BACKWARD))
    ]
    return [r for r in hung if r.rank != culprit.rank] + running


def _hang_reason(
    hung: Sequence[RankObservation], ranks: Sequence[RankObservation], at: str
) -> tuple[RankObservation, str]:
    """The rank a hang is blamed on and the reason, when some hung rank reported its activity: the culprit
    first ("rank C hung at step S in ..."), then the ranks that waited for it."""
    first = min(hung, key=_hang_order)
    what = first.reason or "hung"
    culprit = _running_cause(first, ranks) or first
    if culprit is first and first.activity in WAITING:
        every = "every one waiting in a collective (for a peer that is gone, or the network)"
        others = [r for r in hung if r is not first]
        if not others:
            return first, f"{_named(first)} hung{at}{_where(first)}, {every}: {what}"
        too = _ranks(sorted(r.rank for r in others))
        return first, f"{_named(first)} hung{at}{_where(first)}: {what}; {too} too, {every}"
    if culprit is not first:
        # Named first all the same; the verdict that fired first is a waiting rank's, and said so.
        what = f"its own liveness had not failed yet, rank {first.rank}'s had ({what})"
    reason = f"{_named(culprit)} hung{at}{_where(culprit)}: {what}"
    waiting = _waiting_for(culprit, hung, ranks)
    return culprit, reason + (f"; {_waited(culprit, waiting)}" if waiting else "")


def _failure_reason(
    kind: FailureKind, rank: RankObservation, failures: Sequence[tuple[FailureKind, RankObservation]], at: str
) -> str:
    """The reason of a failure other than a hang read from activities: the rank blamed first ("rank C
    crashed first at step S: ..."), then the ranks that failed alike; "ranks A, B ..." (lowest first, the
    one blamed) only when nothing tells them apart."""
    what = rank.reason or (describe_exit(rank.exit_code) if rank.exit_code is not None else _VERBS[kind])
    waited = [r for k, r in failures if k is kind and r is not rank]
    if not waited:
        return f"rank {rank.rank} {_VERBS[kind]}{at}: {what}"
    key = _root_cause_order(kind, rank)[:-1]
    peers_lost = not lost_a_peer(rank.reason) and any(lost_a_peer(r.reason) for r in waited)
    if rank.ended_at is None and all(_root_cause_order(kind, r)[:-1] == key for r in waited):
        return f"{_ranks(sorted([rank.rank, *(r.rank for r in waited)]))} {_VERBS[kind]}{at}: {what}"
    ended = rank.ended_at
    first = ended is not None and all(r.ended_at is None or ended <= r.ended_at for r in waited)
    note = ""
    if peers_lost:
        note = " (after losing it as a peer)"
    elif all(r.activity in WAITING for r in waited):
        note = " (in a collective its exit broke)"
    verb = _VERBS[kind] + (" first" if first else "")
    return f"rank {rank.rank} {verb}{at}: {what}; {_ranks(sorted(r.rank for r in waited))} too{note}"


def _lost_it(
    kind: FailureKind, rank: RankObservation, failures: Sequence[tuple[FailureKind, RankObservation]]
) -> str:
    """The ranks that crashed for losing the blamed rank as a peer, when it failed otherwise (a crash's
    reason names its own alike)."""
    if kind is FailureKind.CRASH:
        return ""
    lost = sorted(
        r.rank for k, r in failures if k is FailureKind.CRASH and r is not rank and lost_a_peer(r.reason)
    )
    return f"; {_ranks(lost)} crashed after losing it as a peer" if lost else ""


def _straggler_decision(
    recovery: RecoverySpec, straggler: StragglerSpec | None, observation: Observation
) -> Decision:
    """A running gang with a straggler: under ``action: restart`` (and restarts left) a gang restart whose
    next attempt avoids the straggler's node; otherwise go on (the executor reports it)."""
    restarts = observation.restarts
    found = observation.straggler
    if found is None or straggler is None or straggler.action != "restart":
        return Decision(Action.CONTINUE, restarts=restarts)
    if observation.attempt <= observation.handled_attempt:
        return Decision(Action.WAIT, "this attempt's straggler is already being handled", restarts=restarts)
    place = f" ({found.place})" if found.place else ""
    at = f" at step {observation.step}" if observation.step is not None else ""
    reason = f"rank {found.rank}{place} is a straggler{at}: {found.reason}"
    if restarts >= recovery.max_restarts:
        return Decision(
            Action.CONTINUE,
            f"{reason}; not restarted: restarts exhausted ({restarts} of {recovery.max_restarts})",
            rank=found.rank,
            restarts=restarts,
        )
    return Decision(
        Action.RESTART,
        f"{reason}; restarting the gang away from its node",
        delay_seconds=backoff_seconds(recovery, restarts),
        failure=FailureKind.STRAGGLER,
        rank=found.rank,
        restarts=restarts + 1,
        step=observation.step,
        signature=FailureSignature(
            FailureKind.STRAGGLER, observation.step, None, found.reason[:MAX_CAUSE_CHARS], observation.attempt
        ),
    )


def decide(
    recovery: RecoverySpec, observation: Observation, straggler: StragglerSpec | None = None
) -> Decision:
    """Decide what to do about a gang. See the module docstring for the guarantees. ``straggler``: the
    job's ``health.straggler`` (None: report only); a failure always comes before a straggler."""
    restarts = observation.restarts
    if observation.terminal in (Action.SUCCEED, Action.FAIL):
        return Decision(observation.terminal, observation.terminal_reason, restarts=restarts)

    failures = [(kind, r) for r in observation.ranks if (kind := classify(r)) is not None]
    if not failures:
        if observation.ranks and all(r.exit_code == 0 for r in observation.ranks):
            return Decision(Action.SUCCEED, "every rank exited 0", restarts=restarts)
        return _straggler_decision(recovery, straggler, observation)
    if observation.attempt <= observation.handled_attempt:
        return Decision(Action.WAIT, "this attempt's failure is already being handled", restarts=restarts)
    if _awaiting_the_cause(failures, observation):
        lost = _ranks(sorted(r.rank for _, r in failures))
        return Decision(
            Action.WAIT,
            f"{lost} failed for losing a peer: waiting up to {PEER_FAILURE_GRACE_SECONDS:g} s for the "
            "peer's own failure",
            restarts=restarts,
        )

    return _recovery(recovery, _failure(observation, failures))


def _failure(observation: Observation, failures: Sequence[tuple[FailureKind, RankObservation]]) -> Decision:
    """The gang's failure as one ``FAIL`` decision: its root cause (the rank, the reason naming it and
    the others it took down) and its signature, following the previous failure's."""
    restarts = observation.restarts
    kind, rank = min(failures, key=lambda f: _root_cause_order(*f))
    hung = [r for k, r in failures if k is FailureKind.HANG]
    at = f" at step {observation.step}" if observation.step is not None else ""
    if kind is FailureKind.HANG and any(r.activity is not None for r in hung):
        first = min(hung, key=_hang_order)
        what = first.reason or _VERBS[kind]
        rank, reason = _hang_reason(hung, observation.ranks, at)
    else:
        what = rank.reason or (describe_exit(rank.exit_code) if rank.exit_code is not None else _VERBS[kind])
        reason = _failure_reason(kind, rank, failures, at)
    reason += _lost_it(kind, rank, failures)
    signature = FailureSignature(
        kind, observation.step, rank.exit_code, signature_cause(what), observation.attempt
    ).following(observation.previous_failure)
    return Decision(
        Action.FAIL,
        reason,
        failure=kind,
        rank=rank.rank,
        exit_code=rank.exit_code,
        restarts=restarts,
        step=observation.step,
        signature=signature,
    )


def _recovery(recovery: RecoverySpec, failed: Decision) -> Decision:
    """What ``recovery`` does about the ``failed`` decision: fail for good (a permanent kind, a failure
    repeated ``deterministic_failure_limit`` times, restarts exhausted) or restart after the backoff."""
    kind, signature, reason, restarts = failed.failure, failed.signature, failed.reason, failed.restarts
    if kind in (FailureKind.CONFIG, FailureKind.FENCED):  # the exit code's description says permanent
        return failed
    limit = recovery.deterministic_failure_limit
    if limit and signature is not None and signature.repeats >= limit:
        return replace(
            failed,
            reason=deterministic_reason(signature, reason),
            failure=FailureKind.DETERMINISTIC,
        )
    if restarts >= recovery.max_restarts:
        return replace(
            failed, reason=f"restarts exhausted ({restarts} of {recovery.max_restarts}); last: {reason}"
        )
    return replace(
        failed,
        action=Action.RESTART,
        delay_seconds=backoff_seconds(recovery, restarts),
        remediation=recovery.on_divergence if kind is FailureKind.DIVERGED else None,
        restarts=restarts + 1,
    )

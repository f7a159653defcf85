"""The sidecar: a tiny HTTP server beside the training container that turns the worker's status file into
probes and metrics.

Endpoints (one port):

* ``GET /healthz`` - 200 ``ok`` while the worker is alive, 503 with the reason otherwise. This is the
  *training container's* liveness probe target: a hung or diverged worker gets restarted by the kubelet.
  A hung worker's checkpoint write in flight holds that kill while it is expected to finish (200 with
  the reason; ``sidecar.health``).
* ``GET /readyz`` - 200 once the worker is stepping (or finished), 503 with the reason otherwise.
* ``GET /status`` - JSON: the worker status as read, the health verdict and the sidecar's settings. Always
  200, also when the status file is missing or unreadable (then ``"status": null`` and the reason).
* ``GET /metrics`` - Prometheus text exposition from a private registry.
* ``POST /restart`` - a restart order for the pod's launcher (``trainguard-launch``), taken only with the
  token whose SHA-256 the sidecar was given (``--order-token-sha256``) and a signature that verifies under
  its signing key (``--order-signing-key``), for this pod (``--pod-name``), unexpired and never seen
  before (``OrderDesk``); written into the status directory for the launcher
  (``trainer_sidecar.contract.inplace``). 202 when taken, 200 when its attempt already runs or was
  ordered (nothing done), else the refusal and why.

``/healthz``, ``/readyz``, ``/status`` and ``/metrics`` change nothing and tell nothing secret: no token,
digest or key is in any answer (the pod's network should still reach the sidecar only from the operator,
the kubelet and Prometheus: a NetworkPolicy).

The status file is re-read on every request (it is a few hundred bytes; only a regular file of at most
``MAX_STATUS_BYTES`` is read). A missing, half-written, oversized, special or garbage file is a reason in the
answer, never an exception or a hang: the sidecar itself must not be what fails. Health is judged on the
sidecar's own clock (``sidecar.health``); the configuration is one model (``SidecarSettings``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hmac
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Annotated, Any, cast
from urllib.parse import urlsplit

from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, ValidationInfo, field_validator

from trainer_sidecar.contract.env import (
    HANG_TIMEOUT_ENV,
    HANG_TIMEOUT_FLOOR_ENV,
    JOB_NAME_ENV,
    LOCAL_RANKS_ENV,
    NAMESPACE_ENV,
    ORDER_SIGNING_KEY_ENV,
    ORDER_TOKEN_DIGEST_ENV,
    POD_NAME_ENV,
    SIDECAR_HOST_ENV,
    SIDECAR_PORT_ENV,
    STARTUP_GRACE_ENV,
    STATUS_FILE_ENV,
)
from trainer_sidecar.contract.exitcodes import ExitCode
from trainer_sidecar.contract.fields import Fold, ReportedField, surfaced
from trainer_sidecar.contract.hang import DEFAULT_FLOOR_SECONDS
from trainer_sidecar.contract.inplace import (
    MAX_FILE_BYTES as MAX_ORDER_BYTES,
)
from trainer_sidecar.contract.inplace import (
    ORDER_CLOCK_SKEW_SECONDS,
    ORDER_PATH,
    SIGNING_KEY_PATTERN,
    LauncherState,
    OrderClaims,
    Refusal,
    Verdict,
    check_order,
    order_token_digest,
    order_verdict,
    pod_identity,
    read_launcher_state,
    read_order,
    write_order,
)
from trainer_sidecar.contract.status import (
    MAX_LOCAL_RANKS,
    HealthReport,
    Phase,
    SidecarInfo,
    SidecarStatusDocument,
    WorkerStatus,
    local_status_file,
    read_status,
)
from trainer_sidecar.sidecar.health import (
    DEFAULT_CLOCK_SKEW_SECONDS,
    Clocks,
    Health,
    HealthPolicy,
    Tracking,
    assess_health,
    hang_timeout,
    implausible_timestamps,
    under_launcher,
)

logger = logging.getLogger(__name__)


DEFAULT_PORT = 9400
DEFAULT_HOST = "0.0.0.0"
DEFAULT_HANG_TIMEOUT_SECONDS = 300.0
DEFAULT_STARTUP_GRACE_SECONDS = 600.0
DEFAULT_JOB_NAME = "local"
DEFAULT_NAMESPACE = "default"

#: The only labels any sample carries (plus ``phase`` on the phase gauge): bounded cardinality.
LABEL_NAMES = ("job", "namespace")


def counter_fields() -> dict[str, ReportedField]:
    """Worker status field -> its reported field with a sidecar counter (``ReportedField.counter``), the
    registry read now. The worker's values are cumulative over the job."""
    return {spec.name: spec for spec in surfaced("counter")}


#: Worker status field -> exported counter name, as the registry listed them when this module loaded.
COUNTER_FIELDS: Mapping[str, str] = {
    name: spec.counter.name for name, spec in counter_fields().items() if spec.counter is not None
}


@dataclass(frozen=True)
class Reading:
    """One read of the status file: what was read (or why nothing was), the sidecar's clocks at the time,
    the verdict, the sidecar's age of the worker's last step, the counter totals after it, and the hang
    timeout the worker is judged by (learned from its pace; None: not known, the policy's ceiling)."""

    clocks: Clocks
    status: WorkerStatus | None
    read_error: str
    health: Health
    seconds_since_step: float | None = None
    counters: Mapping[str, float] = field(default_factory=dict)
    hang_timeout_seconds: float | None = None
    #: The launcher's state when the worker runs under ``trainguard-launch`` (None: not, or unreadable, then
    #: ``launcher_error`` says why).
    launcher: LauncherState | None = None
    launcher_error: str = ""


def fold_counters(
    last_seen: Mapping[str, int], totals: Mapping[str, float], status: WorkerStatus
) -> tuple[dict[str, int], dict[str, float]]:
    """The monotonic totals after reading ``status``: each counter grows by what the worker's count rose
    since ``last_seen``; a decrease (a resume from an older checkpoint) only moves the baseline."""
    seen = dict(last_seen)
    grown = dict(totals)
    for name in counter_fields():
        value: int = getattr(status, name)
        grown[name] += max(0, value - seen[name])
        seen[name] = value
    return seen, grown


@dataclass
class _Watched:
    """One status file of the pod (``local_rank`` None: ``<stem>.json``), its health tracking and its
    counter baselines; ``judged`` once it held a valid status: it counts for the pod's health from then
    on (a rank does not stop counting by removing or spoiling its file)."""

    path: Path
    local_rank: int | None
    tracking: Tracking
    judged: bool = False
    last_seen: dict[str, int] = field(default_factory=lambda: dict.fromkeys(counter_fields(), 0))
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(counter_fields(), 0.0))

    @property
    def label(self) -> str:
        """How reasons name this file's worker."""
        return self.path.name if self.local_rank is None else f"local rank {self.local_rank}"

    def fetch(self) -> tuple[WorkerStatus | None, str]:
        """The file's status, or None and why: unreadable, or it claims a local rank other than its name's
        (an older worker's status, which claims none, is taken as named)."""
        status, read_error = read_status(self.path)
        if status is None:
            return None, read_error
        claims = (status.local_rank, status.local_world_size)
        if self.local_rank is None and status.local_world_size > 1:
            return (
                None,
                f"status file {self.path} claims local rank {claims[0]} of {claims[1]}, not a pod of one",
            )
        if self.local_rank is not None and claims != (0, 1) and status.local_rank != self.local_rank:
            return None, f"status file {self.path} claims local rank {claims[0]} of {claims[1]}"
        return status, ""

    def read(self, fetched: tuple[WorkerStatus | None, str], clocks: Clocks, policy: HealthPolicy) -> Reading:
        """Judge what ``fetch`` returned, and fold its counts into this file's totals."""
        status, read_error = fetched
        health, self.tracking = assess_health(self.tracking, status, read_error, clocks, policy)
        if status is not None:
            self.last_seen, self.totals = fold_counters(self.last_seen, self.totals, status)
        return Reading(
            clocks=clocks,
            status=status,
            read_error=read_error,
            health=health,
            seconds_since_step=_seconds_since_step(self.tracking, status, clocks, policy),
            counters=dict(self.totals),
            hang_timeout_seconds=hang_timeout(policy, status),
        )


@functools.lru_cache(maxsize=16)
def _candidates(status_file: Path) -> tuple[tuple[int | None, Path, str], ...]:
    """Every name ``pod_status_files`` looks at, built once per status file."""
    names: list[tuple[int | None, Path]] = [(None, status_file)]
    names += [
        (rank, local_status_file(status_file, rank, MAX_LOCAL_RANKS)) for rank in range(MAX_LOCAL_RANKS)
    ]
    return tuple((rank, path, os.fspath(path)) for rank, path in names)


def pod_status_files(status_file: Path) -> dict[int | None, Path]:
    """The status files of the pod that exist now: ``status_file`` itself (key None) and
    ``<stem>-<N><suffix>`` for each local rank N below ``MAX_LOCAL_RANKS`` (``local_status_file``'s
    names). Bounded: only these ``MAX_LOCAL_RANKS + 1`` names are looked at (``status-999999.json``,
    ``status-x.json`` or ``status-01.json`` never are; about half a millisecond), and nothing is read
    here."""
    return {rank: path for rank, path, name in _candidates(status_file) if os.path.lexists(name)}


#: At most this many files are named one by one in a pod's reason (the rest are counted).
MAX_NAMED_FILES = 8


def _listed(parts: Sequence[str]) -> str:
    """``parts`` joined, at most ``MAX_NAMED_FILES`` of them named."""
    shown = "; ".join(parts[:MAX_NAMED_FILES])
    more = len(parts) - MAX_NAMED_FILES
    return f"{shown}; and {more} more" if more > 0 else shown


def _shown(readings: Sequence[Reading], failing: Sequence[int]) -> int:
    """The local rank whose status stands for the pod: the first failing one, else the slowest."""
    if failing:
        return failing[0]
    steps = {i: r.status.step for i, r in enumerate(readings) if r.status is not None}
    return min(steps, key=lambda i: steps[i]) if steps else 0


def _combined(readings: Sequence[Reading], watched: Sequence[_Watched], ignored: Sequence[str]) -> Reading:
    """One reading for a pod of several status files (see ``WorkerStatusCollector.read``); ``ignored``:
    why files named like status files do not count."""
    failing = [i for i, r in enumerate(readings) if not r.health.alive]
    # The pod's kill waits while every rank not alive has its own kill held.
    held = bool(failing) and all(readings[i].health.kill_held for i in failing)
    worst = failing or [i for i, r in enumerate(readings) if not r.health.ready]
    shown = _shown(readings, failing)
    if worst:
        reason = _listed([f"{watched[i].label}: {readings[i].health.reason}" for i in worst])
    elif len(readings) == 1:
        reason = readings[0].health.reason
    else:
        reason = f"{len(readings)} local ranks: {readings[shown].health.reason}"
    # Data each rank reads for itself (a SUM) is summed over the local ranks; a decision every rank takes
    # alike (a MAX) is the largest.
    counters = {
        name: (sum if spec.fold is Fold.SUM else max)(r.counters[name] for r in readings)
        for name, spec in counter_fields().items()
    }
    errors = [f"{w.path}: {r.read_error}" for w, r in zip(watched, readings, strict=True) if r.read_error]
    ages = [r.seconds_since_step for r in readings if r.seconds_since_step is not None]
    timeouts = [r.hang_timeout_seconds for r in readings if r.hang_timeout_seconds is not None]
    return Reading(
        clocks=readings[shown].clocks,
        status=readings[shown].status,
        read_error=_listed([*errors, *ignored]),
        health=Health(alive=not failing, ready=not worst, reason=reason, kill_held=held),
        seconds_since_step=max(ages, default=None),
        counters=counters,
        # The strictest: the pod is not alive once any of its ranks passed its own.
        hang_timeout_seconds=min(timeouts, default=None),
    )


def _seconds_since_step(
    tracking: Tracking, status: WorkerStatus | None, clocks: Clocks, policy: HealthPolicy
) -> float | None:
    """Seconds since the worker's last step of this run: since its progress last changed on the sidecar's
    clock, or since its claimed ``last_step_time`` if longer. None without a plausible step of this run."""
    if status is None or status.last_step_time is None or status.last_step_time < status.started_at:
        return None
    if implausible_timestamps(status, clocks.wall, policy.clock_skew_seconds):
        return None  # no age to tell; the verdict reports the timestamps
    return max(0.0, clocks.monotonic - tracking.progress_since, clocks.wall - status.last_step_time)


def _rank_order(rank: int | None) -> int:
    """``<stem>.json`` first, then the local ranks in order."""
    return -1 if rank is None else rank


class WorkerStatusCollector(Collector):
    """Reads the status file on every scrape (and every probe), judges the worker's health on the sidecar's
    own clock (``trainer_sidecar.sidecar.health``), and exposes both as ``trainguard_*`` metrics.

    Counters stay monotonic for the collector's lifetime. The worker's counts are cumulative over the job,
    but they go *down* when the worker resumes from a checkpoint older than its last status (the steps after
    that checkpoint are redone). Exporting them raw would look like a counter reset to Prometheus, and the
    redone work would vanish from ``increase()``. So per counter the collector keeps ``(last_seen, total)``
    and adds ``max(0, new - last_seen)`` on each read: a decrease only moves the baseline, the increase after
    it is counted again. ``last_seen`` starts at 0, so the first read exports the worker's cumulative count,
    and a restarted sidecar picks up where the worker is rather than at zero.

    Gauges whose value is unknown (no status, no step yet, no loss) are omitted rather than exported as NaN.
    Reads are serialised: the health tracking must see the file's versions in the order they were read.
    """

    def __init__(
        self,
        status_file: Path,
        *,
        hang_timeout_seconds: float,
        startup_grace_seconds: float,
        job: str,
        namespace: str,
        local_ranks: int = 1,
        clock_skew_seconds: float = DEFAULT_CLOCK_SKEW_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        hang_timeout_floor_seconds: float | None = None,
    ) -> None:
        self.status_file = status_file
        self.policy = HealthPolicy(
            hang_timeout_seconds, startup_grace_seconds, clock_skew_seconds, hang_timeout_floor_seconds
        )
        self.job = job
        self.namespace = namespace
        self._monotonic = monotonic
        self._wall = wall
        self.started_at = wall()
        self.local_ranks = local_ranks
        self._lock = threading.Lock()
        self._begun = self._last_monotonic = monotonic()
        self._watched: dict[int | None, _Watched] = {}
        self._width = local_ranks  # how many worker processes the pod is known to run

    def _file(self, local_rank: int | None) -> _Watched:
        """The watched file of ``local_rank`` (None: ``<stem>.json``), watched from the sidecar's start."""
        if local_rank not in self._watched:
            path = (
                self.status_file if local_rank is None else local_status_file(self.status_file, local_rank, 2)
            )
            self._watched[local_rank] = _Watched(path, local_rank, Tracking.begin(self._begun))
        return self._watched[local_rank]

    def read(self) -> Reading:
        """Read every status file of the pod, judge health, fold the counts into the monotonic totals.
        Never raises, and never blocks on a file (``read_status`` reads regular files only, boundedly).

        The files judged: those the worker processes of the pod are expected to write, and every one
        that holds a valid status (``pod_status_files`` finds them, whatever ``local_ranks`` says: a
        command that runs torchrun itself writes ``<stem>-N.json``). Expected are local ranks 0 to W - 1,
        W the largest of ``local_ranks`` and the ``local_world_size`` any valid file ever claimed, or
        ``<stem>.json`` while W is 1; a file that once held a valid status stays judged. A missing or
        unreadable expected file is judged as a worker without a status (the reason names it); a file
        named like a status file that is neither expected nor valid is only reported in ``read_error``.

        With several files judged, the pod is alive and ready only when all of them are; the status
        shown is the first failing file's, else the slowest one's."""
        with self._lock:
            # A monotonic clock that went backwards (a test's, a broken one) is held where it was.
            self._last_monotonic = max(self._last_monotonic, self._monotonic())
            clocks = Clocks(monotonic=self._last_monotonic, wall=self._wall())
            present = pod_status_files(self.status_file)
            fetched = {rank: self._file(rank).fetch() for rank in sorted(present, key=_rank_order)}
            claimed = [s.local_world_size for s, _ in fetched.values() if s is not None]
            self._width = max([self._width, *claimed])
            expected: set[int | None] = set(range(self._width)) if self._width > 1 else {None}
            for rank, (status, _) in fetched.items():
                if status is not None:
                    self._file(rank).judged = True  # it held a status: it counts from now on
            for rank in expected:
                self._file(rank)
            judged = [
                watched
                for rank, watched in sorted(self._watched.items(), key=lambda item: _rank_order(item[0]))
                if watched.judged or rank in expected
            ]
            readings = []
            for watched in judged:
                got = fetched.get(watched.local_rank)
                if got is None:  # an expected file that is not there
                    got = (None, f"status file {watched.path} does not exist yet")
                readings.append(watched.read(got, clocks, self.policy))
            ignored = [
                f"{self._watched[rank].path}: ignored, not a status this pod is expected to write: {why}"
                for rank, (status, why) in fetched.items()
                if status is None and not self._watched[rank].judged and rank not in expected
            ]
        reading = readings[0] if len(readings) == 1 and not ignored else _combined(readings, judged, ignored)
        launcher, launcher_error = read_launcher_state(self.status_file.parent)
        health = under_launcher(reading.health, launcher, reading.status, reading.clocks, self.policy)
        return replace(reading, health=health, launcher=launcher, launcher_error=launcher_error)

    def describe(self) -> Iterable[Metric]:
        """Nothing declared up front: the registry is private, and describing must not read the file."""
        return []

    def collect(self) -> Iterable[Metric]:
        """The metric families for one fresh read of the status file."""
        reading = self.read()
        labels = [self.job, self.namespace]
        yield from _health_families(reading, labels)
        yield from _gauge(
            "trainguard_worker_hang_timeout_seconds",
            "The hang timeout the worker is judged by now: learned from its pace (between the floor and "
            "hangTimeoutSeconds), or hangTimeoutSeconds before the warm-up.",
            labels,
            _hang_timeout_of(reading, self.policy),
        )
        if reading.status is not None:
            yield from _status_families(reading, reading.status, labels)
        yield from _counter_families(reading, labels)

    def document(self, reading: Reading) -> SidecarStatusDocument:
        """The ``/status`` body for ``reading``: the status or why none, health, the sidecar's settings."""
        return SidecarStatusDocument(
            status=reading.status,
            read_error=reading.read_error,
            health=HealthReport(
                **asdict(reading.health),
                hang_timeout_seconds=_hang_timeout_of(reading, self.policy),
            ),
            time=reading.clocks.wall,
            launcher=reading.launcher,
            launcher_error=reading.launcher_error,
            sidecar=SidecarInfo(
                started_at=self.started_at,
                hang_timeout_seconds=self.policy.hang_timeout_seconds,
                startup_grace_seconds=self.policy.startup_grace_seconds,
                hang_timeout_floor_seconds=self.policy.hang_timeout_floor_seconds,
            ),
        )


def _hang_timeout_of(reading: Reading, policy: HealthPolicy) -> float:
    """The hang timeout ``reading``'s worker is judged by (the ceiling when none was learned)."""
    timeout = reading.hang_timeout_seconds
    return policy.hang_timeout_seconds if timeout is None else timeout


def _gauge(name: str, doc: str, labels: list[str], value: float | None) -> Iterable[Metric]:
    """A one-sample gauge family, or nothing when the value is unknown or not finite."""
    if value is None or not math.isfinite(value):
        return []
    family = GaugeMetricFamily(name, doc, labels=LABEL_NAMES)
    family.add_metric(labels, value)
    return [family]


def _health_families(reading: Reading, labels: list[str]) -> Iterable[Metric]:
    """The alive and ready gauges of the verdict."""
    yield from _gauge(
        "trainguard_worker_alive",
        "1 while the sidecar judges the worker alive, else 0 (its liveness probe also passes while a hung "
        "worker's checkpoint write in flight finishes).",
        labels,
        float(reading.health.alive),
    )
    yield from _gauge(
        "trainguard_worker_ready",
        "1 while the worker is stepping or finished (its readiness probe passes), else 0.",
        labels,
        float(reading.health.ready),
    )


def _status_families(reading: Reading, status: WorkerStatus, labels: list[str]) -> Iterable[Metric]:
    """The phase family and the gauges of a status that could be read."""
    phase = GaugeMetricFamily(
        "trainguard_worker_phase",
        "The worker's phase: 1 for the current one, 0 for the others.",
        labels=[*LABEL_NAMES, "phase"],
    )
    for each in Phase:
        phase.add_metric([*labels, each.value], float(status.phase is each))
    yield phase
    for name, doc, value in _status_gauges(reading, status):
        yield from _gauge(name, doc, labels, value)


def _status_gauges(reading: Reading, status: WorkerStatus) -> list[tuple[str, str, float | None]]:
    """(name, help, value) of every gauge taken from the worker's status; a None value is omitted."""
    gauges: list[tuple[str, str, float | None]] = [
        ("trainguard_worker_step", "The worker's current training step.", status.step),
        ("trainguard_worker_loss", "Loss of the last finite step.", status.loss),
        (
            "trainguard_worker_grad_norm",
            "Total L2 gradient norm of the last step, before clipping.",
            status.grad_norm,
        ),
        (
            "trainguard_worker_drop_ratio",
            "Dropped samples over samples seen, over the job.",
            status.drop_rate,
        ),
        (
            "trainguard_worker_lr_scale",
            "Factor the guardian's remediation applies to the learning rates (1 = unchanged).",
            status.lr_scale,
        ),
        (
            "trainguard_worker_compute_seconds",
            "The worker's own compute per step, time waiting in collectives excluded: the median over its "
            "last steps (the job's health.straggler.windowSteps).",
            status.compute_seconds,
        ),
    ]
    if reading.seconds_since_step is not None:
        gauges += [
            (
                "trainguard_worker_last_step_timestamp_seconds",
                "Wall-clock time of the worker's last step (unix seconds).",
                status.last_step_time,
            ),
            (
                "trainguard_worker_seconds_since_last_step",
                "Seconds since the worker's last step, as of this scrape (on the sidecar's own clock; the "
                "worker's timestamp only when it is older).",
                reading.seconds_since_step,
            ),
        ]
    checkpoint = status.last_clean_checkpoint
    if checkpoint is not None:
        gauges += [
            (
                "trainguard_worker_last_clean_checkpoint_step",
                "Step of the newest clean checkpoint on the checkpoint volume.",
                checkpoint.step,
            ),
            (
                "trainguard_worker_last_clean_checkpoint_timestamp_seconds",
                "Wall-clock time the newest clean checkpoint was written (unix seconds).",
                checkpoint.time if checkpoint.time > 0 else None,
            ),
        ]
    return gauges


def _counter_families(reading: Reading, labels: list[str]) -> Iterable[Metric]:
    """The monotonic counters, also without a status (they keep their totals)."""
    for name, spec in counter_fields().items():
        if spec.counter is None:
            continue
        counter = CounterMetricFamily(
            spec.counter.name,
            f"{spec.counter.help} Monotonic over the sidecar's lifetime, also across resumes.",
            labels=LABEL_NAMES,
        )
        counter.add_metric(labels, reading.counters[name])
        yield counter


#: At most this many nonces of unexpired orders are remembered; only signed orders are, so an order
#: beyond it is refused (503) rather than a nonce forgotten early.
MAX_REMEMBERED_NONCES = 1024

#: The HTTP answer to each refusal of ``check_order``.
REFUSAL_STATUS: Mapping[Refusal, HTTPStatus] = {
    Refusal.MALFORMED: HTTPStatus.BAD_REQUEST,
    Refusal.FORGED: HTTPStatus.UNAUTHORIZED,
    Refusal.MISDIRECTED: HTTPStatus.FORBIDDEN,
    Refusal.EXPIRED: HTTPStatus.FORBIDDEN,
}


class OrderDesk:
    """Takes the restart orders of one pod (``pod``, ``contract.inplace.pod_identity``) for its launcher,
    whose files are in ``status_dir``, one order at a time: of orders that arrive together, each is taken
    or refused whole, and exactly one of competing attempts is taken (``order_verdict``).

    An order is taken with the token whose SHA-256 is ``token_sha256``, a signature that verifies under
    ``signing_key``, claims for this pod that have not expired (``check_order``), a nonce not seen before
    (remembered until the order expires) and an attempt newer than any the pod runs or was ordered. An
    order that verifies, for the attempt the pod runs or was ordered already, is answered 200 and changes
    nothing: an operator that restarted between its status write and its orders may send it again."""

    def __init__(
        self,
        status_dir: Path,
        token_sha256: str,
        signing_key: str,
        pod: str,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.status_dir = status_dir
        self.pod = pod
        self._digest = token_sha256
        self._key = signing_key
        self._wall = wall
        self._lock = threading.Lock()
        self._nonces: dict[str, float] = {}  # nonce -> when it may be forgotten (it has expired by then)

    def take(self, authorization: str, body: bytes) -> tuple[HTTPStatus, str]:
        """The answer to one order: ``authorization`` its header, ``body`` its body. Never raises for
        what a client sends."""
        scheme, _, token = authorization.partition(" ")
        if scheme != "Bearer" or not hmac.compare_digest(order_token_digest(token.strip()), self._digest):
            return HTTPStatus.UNAUTHORIZED, "a restart order needs the job's token (Authorization: Bearer)"
        claims, refusal, reason = check_order(self._key, body, self.pod, self._wall())
        if claims is None:
            assert refusal is not None
            return REFUSAL_STATUS[refusal], reason
        with self._lock:  # check-newer-than-current and the write are one step
            return self._take(claims)

    def _take(self, claims: OrderClaims) -> tuple[HTTPStatus, str]:
        now = self._wall()
        self._nonces = {nonce: until for nonce, until in self._nonces.items() if until >= now}
        if claims.nonce in self._nonces:
            return HTTPStatus.CONFLICT, "this order was taken before (a replay)"
        if len(self._nonces) >= MAX_REMEMBERED_NONCES:
            return HTTPStatus.SERVICE_UNAVAILABLE, "too many orders at once: try again once they expire"
        self._nonces[claims.nonce] = claims.expires_at + ORDER_CLOCK_SKEW_SECONDS
        state, reason = read_launcher_state(self.status_dir)
        if state is None:
            return HTTPStatus.CONFLICT, f"no launcher runs in this pod{': ' + reason if reason else ''}"
        order = claims.order
        verdict, why = order_verdict(order.attempt, state, read_order(self.status_dir).order)
        if verdict is Verdict.TAKEN:
            return HTTPStatus.OK, why
        if verdict is Verdict.REFUSE:
            return HTTPStatus.CONFLICT, why
        try:
            write_order(self.status_dir, order)
        except OSError as exc:
            return HTTPStatus.SERVICE_UNAVAILABLE, f"cannot write the order into {self.status_dir}: {exc}"
        logger.info("restart order for attempt %d (stop: %s) written", order.attempt, order.stop.value)
        return HTTPStatus.ACCEPTED, why


class _Handler(BaseHTTPRequestHandler):
    """Serves the four endpoints from the server's collector; logs access at debug level only."""

    server_version = "trainguard-sidecar"
    protocol_version = "HTTP/1.1"
    timeout = 10.0  # a stalled client must not hold a handler thread for ever

    def _sidecar(self) -> _SidecarHTTPServer:
        return cast(_SidecarHTTPServer, self.server)

    def do_GET(self) -> None:
        """Dispatch a GET by path (the query string is ignored)."""
        path = urlsplit(self.path).path
        try:
            self._dispatch(path)
        except (BrokenPipeError, ConnectionResetError):
            logger.debug("client went away during %s", path)
        except Exception:
            logger.exception("error serving %s", path)
            with contextlib.suppress(OSError):
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, b"internal error\n", "text/plain; charset=utf-8")

    def _dispatch(self, path: str) -> None:
        collector = self._sidecar().collector
        if path == "/healthz":
            health = collector.read().health
            if health.kill_held:  # not alive, but its kill waits: say why the probe passes
                self._send(HTTPStatus.OK, self._reason_body(health.reason), "text/plain; charset=utf-8")
            else:
                self._send_verdict(health.alive, health.reason)
        elif path == "/readyz":
            health = collector.read().health
            self._send_verdict(health.ready, health.reason)
        elif path == "/status":
            document = collector.document(collector.read()).to_document()
            body = json.dumps(document, indent=2) + "\n"
            self._send(HTTPStatus.OK, body.encode(), "application/json")
        elif path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            self._send(HTTPStatus.OK, encoder(self._sidecar().registry), content_type)
        else:
            self._send(HTTPStatus.NOT_FOUND, f"not found: {path}\n".encode(), "text/plain; charset=utf-8")

    def do_POST(self) -> None:
        """``POST /restart``: take a restart order for the pod's launcher (``_take_order``)."""
        path = urlsplit(self.path).path
        try:
            if path == ORDER_PATH:
                code, message = self._take_order()
                self._send(code, self._reason_body(message), "text/plain; charset=utf-8")
            else:
                self._send(HTTPStatus.NOT_FOUND, f"not found: {path}\n".encode(), "text/plain; charset=utf-8")
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            logger.debug("client went away during POST %s", path)
        except Exception:
            logger.exception("error serving POST %s", path)
            with contextlib.suppress(OSError):
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, b"internal error\n", "text/plain; charset=utf-8")

    def _take_order(self) -> tuple[HTTPStatus, str]:
        """Read a restart order's body, bounded, and hand it to the server's ``OrderDesk``: 404 when this
        sidecar takes no orders, 411/413 for a body without a length or too large (not read), else the
        desk's answer."""
        desk = self._sidecar().orders
        if desk is None:
            return HTTPStatus.NOT_FOUND, "this sidecar takes no restart orders (no order token is set)"
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            return HTTPStatus.LENGTH_REQUIRED, "a restart order needs a Content-Length"
        if not 0 < length <= MAX_ORDER_BYTES:
            return HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"a restart order is 1 to {MAX_ORDER_BYTES} bytes"
        return desk.take(self.headers.get("Authorization", ""), self.rfile.read(length))

    def _send_verdict(self, good: bool, reason: str) -> None:
        if good:
            self._send(HTTPStatus.OK, b"ok\n", "text/plain; charset=utf-8")
        else:
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, self._reason_body(reason), "text/plain; charset=utf-8")

    @staticmethod
    def _reason_body(reason: str) -> bytes:
        # A path from the command line may hold bytes that are not UTF-8 (surrogates in str).
        return f"{reason}\n".encode(errors="backslashreplace")

    def _send(self, code: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        """Access and error lines go to the logging module at debug level, not to stderr."""
        logger.debug("%s - %s", self.address_string(), format % args)


class _SidecarHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server (daemon handler threads) that carries the collector and its registry."""

    daemon_threads = True
    allow_reuse_address = True
    #: Connections waiting to be accepted (socketserver's default is 5): the kubelet's probes, Prometheus,
    #: the operator's polls and orders may come at once; beyond the backlog a connection is reset.
    request_queue_size = 64
    #: Where restart orders are taken (None: no orders taken).
    orders: OrderDesk | None = None

    def __init__(
        self,
        address: tuple[str, int],
        collector: WorkerStatusCollector,
        registry: CollectorRegistry,
        address_family: socket.AddressFamily,
    ) -> None:
        self.address_family = address_family
        self.collector = collector
        self.registry = registry
        super().__init__(address, _Handler)


class SidecarServer:
    """The sidecar's HTTP server, embeddable: binds in the constructor, serves on a daemon thread after
    ``start()``, and releases the port on ``stop()``.

    ``port=0`` picks a free port; ``port`` and ``url`` tell which. The metrics live on a private
    ``CollectorRegistry`` (``registry``), never on prometheus_client's global one.
    """

    def __init__(
        self,
        status_file: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        hang_timeout_seconds: float = DEFAULT_HANG_TIMEOUT_SECONDS,
        startup_grace_seconds: float = DEFAULT_STARTUP_GRACE_SECONDS,
        job: str = DEFAULT_JOB_NAME,
        namespace: str = DEFAULT_NAMESPACE,
        local_ranks: int = 1,
        hang_timeout_floor_seconds: float = DEFAULT_FLOOR_SECONDS,
        order_token_sha256: str = "",
        order_signing_key: str = "",
        pod_name: str = "",
    ) -> None:
        settings = SidecarSettings(
            status_file=Path(status_file),
            host=host,
            port=port,
            hang_timeout_seconds=hang_timeout_seconds,
            startup_grace_seconds=startup_grace_seconds,
            job=job,
            namespace=namespace,
            local_ranks=local_ranks,
            hang_timeout_floor_seconds=hang_timeout_floor_seconds,
            order_token_sha256=order_token_sha256,
            order_signing_key=SecretStr(order_signing_key),
            pod_name=pod_name,
        )
        self.host = settings.host
        self.collector = WorkerStatusCollector(
            settings.status_file,
            hang_timeout_seconds=settings.hang_timeout_seconds,
            startup_grace_seconds=settings.startup_grace_seconds,
            job=settings.job,
            namespace=settings.namespace,
            local_ranks=settings.local_ranks,
            hang_timeout_floor_seconds=settings.hang_timeout_floor_seconds,
        )
        self.registry = CollectorRegistry()
        self.registry.register(self.collector)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._httpd = _SidecarHTTPServer((self.host, settings.port), self.collector, self.registry, family)
        if settings.order_token_sha256:
            self._httpd.orders = OrderDesk(
                settings.status_file.parent,
                settings.order_token_sha256,
                settings.order_signing_key.get_secret_value(),
                pod_identity(settings.namespace, settings.pod_name),
            )
        self._thread: threading.Thread | None = None

    @classmethod
    def from_settings(cls, settings: SidecarSettings) -> SidecarServer:
        """A server configured by validated ``settings`` (bound, not yet serving)."""
        values = settings.model_dump()
        values["order_signing_key"] = settings.order_signing_key.get_secret_value()
        return cls(**values)

    @property
    def port(self) -> int:
        """The port actually bound (the chosen one when constructed with port 0)."""
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` of the server (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        """Serve requests on a background daemon thread; returns at once. Starting twice is an error."""
        if self._thread is not None:
            raise RuntimeError("sidecar server already started")
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="trainguard-sidecar-http",
            daemon=True,
        )
        self._thread.start()
        logger.info("trainguard-sidecar serving %s for %s", self.url, self.collector.status_file)

    def stop(self) -> None:
        """Stop serving and close the socket; waits for the serving thread. Safe to call more than once."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> SidecarServer:
        """Start serving; ``with SidecarServer(...) as server:`` stops it on exit."""
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Stop serving."""
        self.stop()


#: Longest hang timeout or startup grace accepted: a week. Limits are measured on a float monotonic clock
#: that stays exact far beyond; a week bounds what a probe can sensibly wait for and refuses absurd values.
MAX_DURATION_SECONDS = 7 * 24 * 3600.0

Seconds = Annotated[float, Field(allow_inf_nan=False, le=MAX_DURATION_SECONDS)]


class SidecarSettings(BaseModel):
    """The sidecar's configuration, validated in one place: every flag defaults from its environment
    variable (``SETTING_SOURCES``), then from the field's default."""

    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)

    status_file: Path = Field(description="The worker's status file (required).")
    host: str = Field(DEFAULT_HOST, min_length=1, max_length=255, description="Address to listen on.")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="Port to listen on; 0 picks a free one.")
    hang_timeout_seconds: Seconds = Field(
        DEFAULT_HANG_TIMEOUT_SECONDS,
        gt=0,
        description="A worker without progress for this long is not alive.",
    )
    startup_grace_seconds: Seconds = Field(
        DEFAULT_STARTUP_GRACE_SECONDS,
        ge=0,
        description="Time a worker gets to publish its status and make its first step (and a rollback).",
    )
    hang_timeout_floor_seconds: Seconds = Field(
        DEFAULT_FLOOR_SECONDS,
        gt=0,
        description="The least hang timeout learned from the worker's pace (the hang timeout is the "
        "ceiling); at or above the hang timeout: not learned, the fixed rule.",
    )
    job: str = Field(DEFAULT_JOB_NAME, min_length=1, max_length=253, description="The job label on metrics.")
    namespace: str = Field(
        DEFAULT_NAMESPACE, min_length=1, max_length=253, description="The namespace label on metrics."
    )
    local_ranks: int = Field(
        1,
        ge=1,
        le=MAX_LOCAL_RANKS,
        description="Worker processes in the pod (torchrun's --nproc-per-node): with more than one, each "
        "writes <status file stem>-<local rank><suffix>, and the pod is alive only while all are.",
    )

    order_token_sha256: str = Field(
        "",
        pattern=r"^([0-9a-f]{64})?$",
        description="The SHA-256 (64 hex digits) of the token POST /restart must carry; empty: the sidecar "
        "takes no restart orders.",
    )

    order_signing_key: SecretStr = Field(
        SecretStr(""),
        validate_default=True,
        description="The key (64 hex digits) a restart order's signature is checked with; required with "
        "an order token digest.",
    )
    pod_name: str = Field(
        "",
        max_length=253,
        validate_default=True,
        description="The pod's own name (an order names the pod it is for); required with an order token "
        "digest.",
    )

    @field_validator("order_signing_key")
    @classmethod
    def _signing_key(cls, value: SecretStr, info: ValidationInfo) -> SecretStr:
        key = value.get_secret_value()
        if key and not re.fullmatch(SIGNING_KEY_PATTERN, key):
            raise ValueError("must be 64 hex digits (lower case)")
        if info.data.get("order_token_sha256") and not key:
            raise ValueError("is required to take restart orders (an order token digest is set)")
        return value

    @field_validator("pod_name")
    @classmethod
    def _pod_name(cls, value: str, info: ValidationInfo) -> str:
        if info.data.get("order_token_sha256") and not value:
            raise ValueError("is required to take restart orders (an order token digest is set)")
        return value

    @field_validator("status_file", mode="before")
    @classmethod
    def _required_path(cls, value: object) -> object:
        if isinstance(value, str) and (not value.strip() or "\0" in value):
            raise ValueError("must be a path (not empty, no NUL byte)")
        return value


#: Field name -> (flag, environment variable) it is set from.
SETTING_SOURCES: Mapping[str, tuple[str, str]] = {
    "status_file": ("--status-file", STATUS_FILE_ENV),
    "host": ("--host", SIDECAR_HOST_ENV),
    "port": ("--port", SIDECAR_PORT_ENV),
    "hang_timeout_seconds": ("--hang-timeout-seconds", HANG_TIMEOUT_ENV),
    "startup_grace_seconds": ("--startup-grace-seconds", STARTUP_GRACE_ENV),
    "hang_timeout_floor_seconds": ("--hang-timeout-floor-seconds", HANG_TIMEOUT_FLOOR_ENV),
    "job": ("--job", JOB_NAME_ENV),
    "namespace": ("--namespace", NAMESPACE_ENV),
    "local_ranks": ("--local-ranks", LOCAL_RANKS_ENV),
    "order_token_sha256": ("--order-token-sha256", ORDER_TOKEN_DIGEST_ENV),
    "order_signing_key": ("--order-signing-key", ORDER_SIGNING_KEY_ENV),
    "pod_name": ("--pod-name", POD_NAME_ENV),
}

#: Settings whose value an error message never shows.
SECRET_SETTINGS = frozenset({"order_signing_key"})


class SettingsError(ValueError):
    """A flag or environment value is invalid; the message names the flag and the variable."""


def load_settings(flags: Mapping[str, str | None], environ: Mapping[str, str]) -> SidecarSettings:
    """The settings from ``flags`` (field name -> the flag's value, None when not given) over ``environ``
    over the defaults. Raises ``SettingsError`` naming the flag and the variable of the first bad value."""
    raw: dict[str, str] = {}
    for name, (_, env) in SETTING_SOURCES.items():
        value = flags.get(name)
        if value is None:
            value = environ.get(env)
        if value is not None:
            raw[name] = value
    try:
        return SidecarSettings.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors(include_url=False, include_input=False)[0]
        name = str(error["loc"][0]) if error["loc"] else ""
        flag, env = SETTING_SOURCES.get(name, ("--status-file", STATUS_FILE_ENV))
        given = f", got {raw[name]!r}" if name in raw and name not in SECRET_SETTINGS else ""
        problem = "is required" if error["type"] == "missing" else error["msg"]
        raise SettingsError(f"{flag} (or ${env}): {problem}{given}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainguard-sidecar",
        description="Serve a training worker's status file as liveness/readiness probes, JSON and metrics.",
    )
    for name, (flag, env) in SETTING_SOURCES.items():
        info = SidecarSettings.model_fields[name]
        default = "required" if info.is_required() else f"default {info.default}"
        parser.add_argument(flag, dest=name, default=None, help=f"{info.description} (env {env}; {default})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``trainguard-sidecar`` command. Serves until SIGTERM or SIGINT, then shuts down and returns 0.

    Every flag defaults from its environment variable. Invalid values return 2 (``ExitCode.CONFIG_ERROR``)
    with a message on stderr naming the flag and the variable; so does a port that cannot be bound. Once
    listening it prints ``trainguard-sidecar listening on http://HOST:PORT`` to stdout (flushed), so a
    parent that passed ``--port 0`` learns the port.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or argparse's own usage errors (already printed)
        return exc.code if isinstance(exc.code, int) else int(ExitCode.CONFIG_ERROR)
    try:
        settings = load_settings(vars(args), os.environ)
    except SettingsError as exc:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = SidecarServer.from_settings(settings)
    except OSError as exc:
        print(
            f"{parser.prog}: error: cannot listen on {settings.host}:{settings.port} "
            f"(--host/${SIDECAR_HOST_ENV}, --port/${SIDECAR_PORT_ENV}): {exc}",
            file=sys.stderr,
        )
        return int(ExitCode.CONFIG_ERROR)
    _serve_until_signalled(server)
    logger.info("trainguard-sidecar stopped")
    return int(ExitCode.SUCCEEDED)


def _serve_until_signalled(server: SidecarServer) -> None:
    """Serve until SIGTERM or SIGINT, then stop the server and restore the previous signal handlers."""
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        print(f"trainguard-sidecar listening on {server.url}", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    raise SystemExit(main())

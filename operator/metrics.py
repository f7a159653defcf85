"""The operator's Prometheus metrics, on a private registry served over HTTP.

Labels are ``job`` and ``namespace`` only (plus ``phase`` on the phase gauge, ``kind``, one of the
policy's failure kinds, on the failures counter, ``way``, one of ``RESTART_WAYS``, on the restarts
counter, and ``rank`` on the straggler score, at most 256 ranks a job): cardinality is bounded by the
number of GuardedTrainingJobs. Values are in base units (seconds, ratios). The gauges mirror the jobs'
status; the counters count what this operator process did (Prometheus handles the reset when it
restarts).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from trainguard_operator.status import JobStatus, Phase, parse_time

from trainer_sidecar.contract.fields import surfaced

LABELS = ("job", "namespace")
#: How a gang restart was carried out: in the gang's own pods, or as a new PyTorchJob or TrainJob.
IN_PLACE = "in_place"
NEW_PYTORCHJOB = "new_pytorchjob"
NEW_TRAINJOB = "new_trainjob"
RESTART_WAYS = (IN_PLACE, NEW_PYTORCHJOB, NEW_TRAINJOB)

#: The gauges of the operator's own status numbers: status attribute, metric name, help.
JOB_GAUGES = (
    ("attempt", "trainguard_job_attempt", "Current gang attempt (1-based)."),
    (
        "goodput",
        "trainguard_job_goodput_ratio",
        "Share of wall time since the first attempt spent on steps the final model kept (0..1).",
    ),
    (
        "steps_per_second",
        "trainguard_job_steps_per_second",
        "Steps per second of the current attempt's progress.",
    ),
    ("eta_seconds", "trainguard_job_eta_seconds", "Seconds to the declared max steps at the current rate."),
    (
        "lost_seconds",
        "trainguard_job_lost_seconds",
        "Wall time since the first attempt not spent on steps the final model kept (recoveries, "
        "rollbacks, the start).",
    ),
)


def _status_gauges() -> list[tuple[str, str, str]]:
    """Every status gauge: the operator's own, then the reported fields' (the registry read now)."""
    reported = [(f.status, f.metric, f.description) for f in surfaced("metric") if f.status and f.metric]
    return [*JOB_GAUGES, *reported]


class OperatorMetrics:
    """All operator metrics, on their own registry (never prometheus_client's global one)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.restarts = self._counter(
            "trainguard_job_restarts",
            "Whole-gang restarts started by this operator, by way: in_place (the gang's pods kept) or "
            "new_pytorchjob, new_trainjob.",
            (*LABELS, "way"),
        )
        self.in_place_fallbacks = self._counter(
            "trainguard_job_in_place_fallbacks",
            "Restarts in place given up for a new PyTorchJob (an order refused, a pod lost, a launcher "
            "that did not take the order in time); each was counted once as an in_place restart.",
        )
        self.failures = self._counter(
            "trainguard_job_failures",
            "Gang failures acted on (restart or give-up), by the policy's failure kind.",
            (*LABELS, "kind"),
        )
        self.reconcile_errors = self._counter(
            "trainguard_job_reconcile_errors",
            "Reconcile steps that failed (API errors, conflicts) and were retried.",
        )
        #: One gauge per number of the job's status, by status attribute: the operator's own
        #: (``JOB_GAUGES``) and each reported field's with a metric (``trainer_sidecar.contract.fields``).
        self.status_gauges = {
            name: self._gauge(metric, documentation) for name, metric, documentation in _status_gauges()
        }
        self.last_clean_checkpoint_step = self._gauge(
            "trainguard_job_last_clean_checkpoint_step", "Step of the newest clean checkpoint."
        )
        self.phase = self._gauge(
            "trainguard_job_phase", "1 for the job's current phase, 0 for the others.", (*LABELS, "phase")
        )
        self.last_restart = self._gauge(
            "trainguard_job_last_restart_timestamp_seconds",
            "When the last gang restart was decided (unix seconds).",
        )
        self.straggler_score = self._gauge(
            "trainguard_worker_straggler_score",
            "A rank's own compute per step over the median of the other ranks' (1: the gang's pace; "
            "health.straggler.threshold flags a straggler). Label rank: bounded by the world size.",
            (*LABELS, "rank"),
        )
        self.time_to_recover = self._histogram(
            "trainguard_job_time_to_recover_seconds",
            "From a gang failure to the first training step of the attempt that replaced it.",
            (10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200),
        )
        self.reconcile_seconds = self._histogram(
            "trainguard_operator_reconcile_duration_seconds",
            "Duration of one reconcile step (API reads, sidecar polls, writes).",
            (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            labels=(),
        )
        self._kinds: dict[tuple[str, str], set[str]] = {}
        self._scored: dict[tuple[str, str], set[str]] = {}  # the ranks with a straggler score, by job
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def _counter(self, name: str, documentation: str, labels: Sequence[str] = LABELS) -> Counter:
        return Counter(name, documentation, labels, registry=self.registry)

    def _gauge(self, name: str, documentation: str, labels: Sequence[str] = LABELS) -> Gauge:
        return Gauge(name, documentation, labels, registry=self.registry)

    def _histogram(
        self, name: str, documentation: str, buckets: Sequence[float], labels: Sequence[str] = LABELS
    ) -> Histogram:
        return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)

    def observe_status(self, job: str, namespace: str, status: JobStatus) -> None:
        """Set the gauges from a job's status (unknown values are left as they were)."""
        labels = (job, namespace)
        for gauge, value in (
            *((gauge, status.reported_value(name)) for name, gauge in self.status_gauges.items()),
            (
                self.last_clean_checkpoint_step,
                status.last_clean_checkpoint.step if status.last_clean_checkpoint else None,
            ),
        ):
            if value is not None:
                gauge.labels(*labels).set(value)
        scored = {str(r): v for r, v in enumerate(status.straggler_scores or []) if v is not None}
        for rank in self._scored.get(labels, set()) - scored.keys():
            with contextlib.suppress(KeyError):
                self.straggler_score.remove(*labels, rank)
        for rank, value in scored.items():
            self.straggler_score.labels(*labels, rank).set(value)
        self._scored[labels] = set(scored)
        if status.phase:
            for phase in Phase:
                self.phase.labels(*labels, phase.value).set(float(phase.value == status.phase))

    def restarted(self, job: str, namespace: str, kind: str, when: str | None, way: str) -> None:
        """Count a gang restart decided at ``when`` (RFC 3339) for a failure of ``kind``, carried out
        ``way`` (one of ``RESTART_WAYS``)."""
        if way not in RESTART_WAYS:
            raise ValueError(f"restart way {way!r} is not one of {RESTART_WAYS}")
        self.restarts.labels(job, namespace, way).inc()
        self.gave_up(job, namespace, kind)
        moment = parse_time(when)
        if moment is not None:
            self.last_restart.labels(job, namespace).set(moment.timestamp())

    def gave_up(self, job: str, namespace: str, kind: str) -> None:
        """Count a failure acted on (a restart or a give-up)."""
        self._kinds.setdefault((job, namespace), set()).add(kind)
        self.failures.labels(job, namespace, kind).inc()

    def forget(self, job: str, namespace: str) -> None:
        """Drop every series of a deleted job."""
        for way in RESTART_WAYS:
            with contextlib.suppress(KeyError):
                self.restarts.remove(job, namespace, way)
        for metric in (
            self.in_place_fallbacks,
            self.reconcile_errors,
            *self.status_gauges.values(),
            self.last_clean_checkpoint_step,
            self.last_restart,
            self.time_to_recover,
        ):
            with contextlib.suppress(KeyError):
                metric.remove(job, namespace)
        for phase in Phase:
            with contextlib.suppress(KeyError):
                self.phase.remove(job, namespace, phase.value)
        for rank in self._scored.pop((job, namespace), set()):
            with contextlib.suppress(KeyError):
                self.straggler_score.remove(job, namespace, rank)
        for kind in self._kinds.pop((job, namespace), set()):
            self.failures.remove(job, namespace, kind)

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the bound port."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def stop(self) -> None:
        """Stop serving and release the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

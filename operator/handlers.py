"""The kopf handlers: thin glue between kopf, the API server, the sidecars and ``reconcile``.

One reconcile step (``reconcile_job``) reads the GuardedTrainingJob fresh from the API server (never
kopf's cached copy, which may predate the operator's own last write), lists its PyTorchJobs and pods,
polls the current attempt's sidecars, asks ``reconcile.reconcile`` for a plan and carries it out. It
runs on creation and resume, on spec updates, and in a per-job daemon every ``probePeriodSeconds``
(sooner while a restart is due). Steps of one job never overlap (a per-job lock). At creation and resume
kopf starts the create/resume handler and the daemon at once: whichever takes the lock second does not
repeat the step the other just took (the daemon waits out the rest of that step's requeue instead).
Nothing else is kept in memory, so the operator can be restarted at any point.

Transient API errors and 409 conflicts become ``kopf.TemporaryError`` with a delay: kopf retries the
handler (the daemon is re-invoked after the delay), and the retry starts from a fresh read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import kopf
import kubernetes
import urllib3
from trainguard_operator.kube import KubeApi, connection_info, is_transient, load_configuration
from trainguard_operator.metrics import OperatorMetrics
from trainguard_operator.pods import pods_to_poll
from trainguard_operator.poll import SidecarPoller
from trainguard_operator.reconcile import (
    IMMUTABLE_FIELDS,
    RESIZABLE_FIELDS,
    Plan,
    PlanAction,
    World,
    changed_paths,
    reconcile,
)
from trainguard_operator.settings import OperatorSettings, OperatorSettingsError

from trainguard.core.spec import GROUP, PLURAL, VERSION

RUNTIME_KEY = "trainguard_runtime"
SETTINGS_KEY = "trainguard_settings"
LOCK_KEY = "trainguard_lock"
LAST_STEP_KEY = "trainguard_last_step"

log = logging.getLogger("trainguard.operator")


@dataclass
class Runtime:
    """The operator-wide objects the handlers share (created at startup, closed at cleanup)."""

    settings: OperatorSettings
    api: KubeApi
    poller: SidecarPoller
    metrics: OperatorMetrics
    metrics_port: int


@dataclass(frozen=True)
class Outcome:
    """What a reconcile step tells its caller: when to come back, and whether the job is final."""

    requeue_seconds: float
    done: bool


def _runtime(memo: Mapping[str, Any]) -> Runtime:
    found = memo.get(RUNTIME_KEY)
    if not isinstance(found, Runtime):
        raise kopf.TemporaryError("the operator is still starting", delay=1)
    return found


def _lock(memo: kopf.Memo) -> asyncio.Lock:
    lock = memo.get(LOCK_KEY)
    if not isinstance(lock, asyncio.Lock):
        lock = memo[LOCK_KEY] = asyncio.Lock()
    return lock


@dataclass(frozen=True)
class LastStep:
    """When this process last finished a step of a job (``time.monotonic()``), and its outcome."""

    finished: float
    outcome: Outcome


def _last_step(memo: kopf.Memo) -> LastStep | None:
    found = memo.get(LAST_STEP_KEY)
    return found if isinstance(found, LastStep) else None


async def _step(rt: Runtime, memo: kopf.Memo, namespace: str, name: str) -> Outcome:
    """One reconcile step (the caller holds the job's lock), remembered for ``_last_step``."""
    outcome = await reconcile_job(rt, namespace, name)
    memo[LAST_STEP_KEY] = LastStep(time.monotonic(), outcome)
    return outcome


# ------------------------------------------------------------------------------------- lifecycle ---
@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Configure kopf, start the metrics server, and create the API client and the sidecar poller."""
    # kopf's own bookkeeping goes to annotations under trainguard.dev, never into our status.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="trainguard.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="trainguard.dev")
    settings.persistence.finalizer = "trainguard.dev/finalizer"
    settings.posting.level = logging.INFO
    configured = memo.get(SETTINGS_KEY)
    try:
        operator_settings = (
            configured if isinstance(configured, OperatorSettings) else OperatorSettings.from_env()
        )
    except OperatorSettingsError as exc:
        raise kopf.PermanentError(f"invalid operator settings: {exc}") from exc
    metrics = OperatorMetrics()
    try:
        port = metrics.serve(operator_settings.metrics_host, operator_settings.metrics_port)
    except OSError as exc:  # the port is still held, e.g. by the previous process
        raise kopf.TemporaryError(f"cannot serve metrics: {exc}", delay=5) from exc
    memo[RUNTIME_KEY] = Runtime(
        settings=operator_settings,
        api=KubeApi.connect(),
        poller=SidecarPoller(
            operator_settings.sidecar_port,
            operator_settings.poll_concurrency,
            operator_settings.poll_timeout_seconds,
        ),
        metrics=metrics,
        metrics_port=port,
    )
    logger.info("trainguard operator metrics on %s:%d", operator_settings.metrics_host, port)


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf's credentials: the same as the operator's own API client (in-cluster, or ``$KUBECONFIG``)."""
    return connection_info(load_configuration())


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Stop the metrics server and close the clients."""
    found = memo.get(RUNTIME_KEY)
    if isinstance(found, Runtime):
        await found.poller.close()
        found.api.close()
        found.metrics.stop()


# ----------------------------------------------------------------------------------- the step ---
async def reconcile_job(rt: Runtime, namespace: str, name: str) -> Outcome:
    """One reconcile step of one job (see the module docstring). Raises TemporaryError to be retried."""
    started = time.monotonic()
    try:
        body = await rt.api.get_job(namespace, name)
        if body is None:
            return Outcome(rt.settings.crd_retry_seconds, done=True)
        jobs = await rt.api.list_pytorchjobs(namespace, name)
        pods = await rt.api.list_pods(namespace, name)
        sidecars = await rt.poller.reports(pods_to_poll(body, pods))
        plan = reconcile(World(body, jobs, pods, sidecars, datetime.now(UTC)), rt.settings)
        await _execute(rt, body, plan)
    except kubernetes.client.ApiException as exc:
        rt.metrics.reconcile_errors.labels(name, namespace).inc()
        if exc.status == 403:
            raise kopf.TemporaryError(
                f"forbidden ({exc.reason}): check the operator's RBAC", delay=rt.settings.crd_retry_seconds
            ) from exc
        if is_transient(exc):
            raise kopf.TemporaryError(
                f"API error {exc.status} ({exc.reason}); retrying", delay=rt.settings.api_retry_seconds
            ) from exc
        raise
    except (urllib3.exceptions.HTTPError, OSError, TimeoutError) as exc:
        rt.metrics.reconcile_errors.labels(name, namespace).inc()
        raise kopf.TemporaryError(
            f"API server unreachable ({exc}); retrying", delay=rt.settings.api_retry_seconds
        ) from exc
    finally:
        rt.metrics.reconcile_seconds.observe(time.monotonic() - started)
    return Outcome(plan.requeue_seconds, plan.done)


async def _execute(rt: Runtime, body: Mapping[str, Any], plan: Plan) -> None:
    """Carry out a plan in the order ``Plan`` documents.

    The events go out right after the write that makes the plan's outcome durable (the status write, or
    the creation of an attempt), so a step retried after a failed write neither loses nor repeats them.
    """
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    version = meta.get("resourceVersion")
    posted = False

    def post_events() -> None:
        nonlocal posted
        if posted:
            return
        posted = True
        for note in plan.events:
            kopf.event(
                kopf.Body(cast(kopf.RawBody, dict(body))),
                type=note.type,
                reason=note.reason,
                message=note.message,
            )
            # The module's logger, not kopf's per-object one: kopf posts the latter's INFO records as
            # Events too, which would post every one of these twice.
            log_at = logging.WARNING if note.type == "Warning" else logging.INFO
            log.log(log_at, "%s/%s %s: %s", namespace, name, note.reason, note.message)

    async def write_status() -> None:
        if plan.patch:
            await rt.api.patch_status(namespace, name, plan.patch, version)
        post_events()

    if plan.write_status_first:
        await write_status()
    for old in plan.delete:
        if plan.stop_pods_within_seconds is not None:
            grace = plan.stop_pods_within_seconds
            if stopped := await rt.api.stop_pods(namespace, old, grace):
                log.info("%s/%s: stopping %d pod(s) of %s within %d s", namespace, name, stopped, old, grace)
        if await rt.api.delete_pytorchjob(namespace, old):
            log.info("%s/%s: deleted PyTorchJob %s", namespace, name, old)
    if plan.create is not None:
        created = await rt.api.create_pytorchjob(plan.create)
        verb = "created" if created else "found"
        log.info("%s/%s: %s PyTorchJob %s", namespace, name, verb, plan.create["metadata"]["name"])
        if created:
            post_events()
    if not plan.write_status_first:
        await write_status()

    status = plan.status
    rt.metrics.observe_status(name, namespace, status)
    decision = plan.decision
    kind = decision.failure.value if decision is not None and decision.failure is not None else "Unknown"
    if plan.action is PlanAction.RESTART:
        failure = status.last_failure
        rt.metrics.restarted(name, namespace, kind, failure.time if failure else None)
    elif plan.action is PlanAction.FAIL:
        rt.metrics.gave_up(name, namespace, kind)
    if plan.recovered_seconds is not None:
        rt.metrics.time_to_recover.labels(name, namespace).observe(plan.recovered_seconds)


# ---------------------------------------------------------------------------------- handlers ---
@kopf.on.resume(GROUP, VERSION, PLURAL, id="admit-on-resume")
@kopf.on.create(GROUP, VERSION, PLURAL, id="admit-on-create")
async def admit(name: str, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    """A new (or, after an operator restart, an existing) job: validate it and make sure its attempt
    exists. An invalid spec gets the SpecInvalid condition and a Warning event, and no PyTorchJob.

    The job's daemon starts at the same moment; when it has already finished a step (it began after this
    process saw the job, as this one would), that step is not repeated."""
    rt = _runtime(memo)
    async with _lock(memo):
        if _last_step(memo) is None:
            await _step(rt, memo, namespace or "default", name)


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def spec_updated(
    name: str,
    namespace: str | None,
    old: Any,
    new: Any,
    body: kopf.Body,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """A spec change: say which changes are accepted (Normal event); the refused ones get the
    SpecChangeRefused condition and a Warning event from the reconcile step that follows."""
    rt = _runtime(memo)
    paths = changed_paths(old or {}, new or {}, "spec")
    immutable = tuple(f"spec.{key}" for key in IMMUTABLE_FIELDS if key not in RESIZABLE_FIELDS)
    accepted = [p for p in paths if not p.startswith(immutable)]
    if accepted:
        kopf.info(
            body,
            reason="SpecChangeAccepted",
            message=f"accepted changes to {', '.join(accepted)}: recovery and dataQuality apply to the "
            "next decisions; health and guard apply to polling now and to the pods from the next attempt; "
            "replicas and nprocPerNode from the next gang restart",
        )
    async with _lock(memo):
        await _step(rt, memo, namespace or "default", name)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0, backoff=10.0)
async def supervise(
    name: str,
    namespace: str | None,
    memo: kopf.Memo,
    stopped: kopf.DaemonStopped,
    **_: Any,
) -> None:
    """Reconcile the job every probe period (or when a wait ends) until it succeeds or fails.

    On its first round, a step that another handler finished less than its requeue time ago (the
    create/resume handler's, started by kopf with this daemon) counts as this round's: the daemon waits
    out the rest of it instead of repeating it."""
    rt = _runtime(memo)
    first = True
    while not stopped:
        async with _lock(memo):
            last = _last_step(memo) if first else None
            if last is not None and time.monotonic() - last.finished < last.outcome.requeue_seconds:
                outcome = last.outcome
                wait = last.outcome.requeue_seconds - (time.monotonic() - last.finished)
            else:
                outcome = await _step(rt, memo, namespace or "default", name)
                wait = outcome.requeue_seconds
        first = False
        if outcome.done:
            log.info("%s/%s is final; supervision ends", namespace, name)
            return
        await stopped.wait(wait)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
async def deleted(name: str, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    """Forget a deleted job's metric series; its PyTorchJobs go by garbage collection (owner references)."""
    found = memo.get(RUNTIME_KEY)
    if isinstance(found, Runtime):
        found.metrics.forget(name, namespace or "default")

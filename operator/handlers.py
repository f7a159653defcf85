"""The kopf handlers: thin glue between kopf, the watches, the sidecars and ``reconcile``.

The operator holds what it needs of its PyTorchJobs and pods in memory (``kube.Watches``: a list, then a
watch, of the objects labelled with a job; ``cache`` keeps them). One reconcile step (``reconcile_job``)
takes the GuardedTrainingJob as kopf's watch shows it, unless the operator's own last status write
returned a newer copy (``cache.fresher_body``; when that cannot be told, or after a conflict, it reads the
job from the API server), takes its PyTorchJobs and pods from the cache, polls the current attempt's
sidecars, asks ``reconcile.reconcile`` for a plan and carries it out: the API server is asked only to
write. It runs on creation and resume, on spec updates, and in a per-job daemon. The daemon looks again
when a change of the job's PyTorchJob or pods arrives (the watch wakes it at once), and by the clock only
while the plan asks for it (``Plan.clock``: pods running, whose sidecars are polled every
``probePeriodSeconds``; a backoff or a bounded wait): a job with nothing running costs nothing at rest.
Steps of one job never overlap (a per-job lock); a step another handler took counts as the daemon's.
Nothing that decides is kept only in memory, so the operator can be restarted at any point: the first
steps wait until the watches have listed everything once.

Transient API errors and 409 conflicts become ``kopf.TemporaryError`` with a delay: kopf retries the
handler (the daemon is re-invoked after the delay), and the retry after a conflict reads the job fresh.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
import kubernetes
import urllib3
from trainguard_operator.backends import Backend
from trainguard_operator.backends.choice import BACKENDS
from trainguard_operator.backends.pytorchjob import PYTORCHJOB
from trainguard_operator.cache import JobKey, fresher_body, without_managed_fields, write_still_ahead
from trainguard_operator.inplace import order_signer
from trainguard_operator.kube import KubeApi, Watches, connection_info, is_transient, load_configuration
from trainguard_operator.metrics import IN_PLACE, OperatorMetrics
from trainguard_operator.pacing import LastStep, Outcome, wait_before_step
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
from trainguard_operator.slim_watch import install as slim_kopf_watches
from trainguard_operator.status import JobStatus

from trainguard.core.spec import GROUP, PLURAL, VERSION

# Here, at import: kopf imports this module (``kopf run -m``, ``python -m trainguard_operator``) before it
# starts its watches.
slim_kopf_watches()

RUNTIME_KEY = "trainguard_runtime"
SETTINGS_KEY = "trainguard_settings"
STATE_KEY = "trainguard_job"
#: How often a daemon looks whether kopf's copy of its job caught up with the operator's own last write.
CATCH_UP_SECONDS = 1.0

log = logging.getLogger("trainguard.operator")


@dataclass
class JobState:
    """What this process keeps of one job between steps (in the job's kopf memo)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: Set when the daemon should look again (a change arrived, or another handler took a step).
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    #: A change of the job's PyTorchJob or pods arrived since the last step began.
    changed: bool = True
    last: LastStep | None = None
    #: The job as the operator's own last status write returned it.
    written: Mapping[str, Any] | None = None
    #: Read the job from the API server at the next step (a write conflicted).
    read_fresh: bool = False
    #: The attempt last ordered in place, and the pods that did not take its order (with why).
    refused_attempt: int | None = None
    refusals: dict[str, str] = field(default_factory=dict)


@dataclass
class Runtime:
    """The operator-wide objects the handlers share (created at startup, closed at cleanup)."""

    settings: OperatorSettings
    api: KubeApi
    poller: SidecarPoller
    metrics: OperatorMetrics
    metrics_port: int
    watches: Watches
    jobs: dict[JobKey, JobState] = field(default_factory=dict)

    def changed(self, keys: set[JobKey]) -> None:
        """Wake the reconcile of each job whose PyTorchJob or pods changed."""
        for key in keys:
            state = self.jobs.get(key)
            if state is not None:
                state.changed = True
                state.wake.set()


def _runtime(memo: Mapping[str, Any]) -> Runtime:
    found = memo.get(RUNTIME_KEY)
    if not isinstance(found, Runtime):
        raise kopf.TemporaryError("the operator is still starting", delay=1)
    return found


def _state(rt: Runtime, memo: kopf.Memo, namespace: str, name: str) -> JobState:
    state = memo.get(STATE_KEY)
    if not isinstance(state, JobState):
        state = memo[STATE_KEY] = JobState()
    rt.jobs[namespace, name] = state
    return state


async def _step(
    rt: Runtime, state: JobState, namespace: str, name: str, body: Mapping[str, Any] | None
) -> Outcome:
    """One reconcile step (the caller holds the job's lock), remembered in ``state.last``."""
    if not await rt.watches.wait_listed(rt.settings.api_retry_seconds * 5):
        raise kopf.TemporaryError(
            "the watches have not listed everything yet", delay=rt.settings.api_retry_seconds
        )
    state.changed = False
    try:
        outcome = await reconcile_job(rt, state, namespace, name, body)
    except BaseException:
        state.changed = True
        raise
    state.last = LastStep(time.monotonic(), outcome)
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
    settings.networking.error_backoffs = operator_settings.api_error_backoffs()
    metrics = OperatorMetrics()
    try:
        port = metrics.serve(operator_settings.metrics_host, operator_settings.metrics_port)
    except OSError as exc:  # the port is still held, e.g. by the previous process
        raise kopf.TemporaryError(f"cannot serve metrics: {exc}", delay=5) from exc
    api = KubeApi.connect()
    runtime: Runtime | None = None

    def changed(keys: set[JobKey]) -> None:
        if runtime is not None:
            runtime.changed(keys)

    watches = Watches(
        api.client.configuration,
        list(operator_settings.namespaces),
        changed,
        retry_seconds=operator_settings.api_retry_seconds,
        absent_retry_seconds=operator_settings.crd_retry_seconds,
    )
    runtime = memo[RUNTIME_KEY] = Runtime(
        settings=operator_settings,
        api=api,
        poller=SidecarPoller(
            operator_settings.sidecar_port,
            operator_settings.poll_concurrency,
            operator_settings.poll_timeout_seconds,
        ),
        metrics=metrics,
        metrics_port=port,
        watches=watches,
    )
    watches.start()
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
        await found.watches.close()
        await found.poller.close()
        found.api.close()
        found.metrics.stop()


# ----------------------------------------------------------------------------------- the step ---
async def reconcile_job(
    rt: Runtime, state: JobState, namespace: str, name: str, watched: Mapping[str, Any] | None
) -> Outcome:
    """One reconcile step of one job (see the module docstring), ``watched`` being the job as kopf's
    watch shows it (None: read it from the API server). A write that conflicts (kopf's own writes race
    the copy it handed over) is retried at once, once, from a fresh read. Raises TemporaryError to be
    retried."""
    started = time.monotonic()
    try:
        try:
            return await _reconcile(rt, state, namespace, name, watched)
        except kubernetes.client.ApiException as exc:
            if exc.status != 409:
                raise
            rt.metrics.reconcile_errors.labels(name, namespace).inc()
            state.read_fresh = True
            return await _reconcile(rt, state, namespace, name, None)
    except kubernetes.client.ApiException as exc:
        rt.metrics.reconcile_errors.labels(name, namespace).inc()
        if exc.status == 409:
            state.read_fresh = True
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


async def _reconcile(
    rt: Runtime, state: JobState, namespace: str, name: str, watched: Mapping[str, Any] | None
) -> Outcome:
    # A snapshot: kopf's body of a daemon is a live view, updated while the step awaits.
    chosen = None
    if watched is not None and not state.read_fresh:
        chosen = fresher_body(copy.deepcopy(dict(watched)), state.written)
        state.written = write_still_ahead(watched, state.written)
    body = chosen if chosen is not None else await rt.api.get_job(namespace, name)
    if body is None:
        return Outcome(rt.settings.crd_retry_seconds, done=True)
    state.read_fresh = False
    cache = rt.watches
    held = {
        kind: None if objects.absent else objects.of_job(namespace, name)
        for kind, objects in cache.children.items()
    }
    jobs = held.pop(PYTORCHJOB.kind, None)
    pods = cache.pods.of_job(namespace, name)
    sidecars = await rt.poller.reports(pods_to_poll(body, pods))
    attempt = JobStatus.from_body(body).attempt
    refusals = state.refusals if attempt is not None and attempt == state.refused_attempt else {}
    plan = reconcile(World(body, jobs, pods, sidecars, datetime.now(UTC), refusals, held), rt.settings)
    await _execute(rt, state, body, plan)
    return Outcome(plan.requeue_seconds, plan.done, plan.clock)


#: A failure's restart or give-up is the goodput at stake: its calls do not queue behind admissions.
URGENT_ACTIONS = (PlanAction.RESTART, PlanAction.RESTART_IN_PLACE, PlanAction.FALL_BACK, PlanAction.FAIL)


async def _execute(rt: Runtime, state: JobState, body: Mapping[str, Any], plan: Plan) -> None:
    """Carry out a plan in the order ``Plan`` documents.

    The events go out right after the write that makes the plan's outcome durable (the status write, or
    the creation of an attempt), so a step retried after a failed write neither loses nor repeats them;
    the metrics follow the status write.
    """
    api = rt.api.urgent() if plan.action in URGENT_ACTIONS else rt.api
    if plan.write_status_first:
        await _write_status(rt, state, api, body, plan, post_events=True)
    if plan.order is not None:
        await _give_orders(rt, state, body, plan)
    backend = BACKENDS[plan.backend]
    for old in plan.delete:
        await _delete_attempt(rt, api, body, backend, old, plan.stop_pods_within_seconds)
    created = plan.create is not None and await _create_attempt(rt, api, body, backend, plan.create)
    if created and not plan.write_status_first:
        await _post_events(api, body, plan)
    if not plan.write_status_first:
        await _write_status(rt, state, api, body, plan, post_events=not created)


async def _write_status(
    rt: Runtime, state: JobState, api: KubeApi, body: Mapping[str, Any], plan: Plan, *, post_events: bool
) -> None:
    """Write the plan's status patch (remembering the job as written), then post its events when
    ``post_events`` (not yet posted) and record its metrics."""
    meta = body["metadata"]
    if plan.patch:
        state.written = without_managed_fields(
            await api.patch_status(meta["namespace"], meta["name"], plan.patch, meta.get("resourceVersion"))
        )
    if post_events:
        await _post_events(api, body, plan)
    # With the status write, as the events: a restart or a give-up is counted once it is recorded,
    # not after the stopping of the old gang that follows it (which a retry does not repeat).
    _record_metrics(rt.metrics, meta["name"], meta["namespace"], plan)


async def _post_events(api: KubeApi, body: Mapping[str, Any], plan: Plan) -> None:
    """Post the plan's events and log each; an Event refused is logged and the step goes on."""
    # Posted and stored before the step goes on (not queued to kopf's poster, which loses what it
    # has not sent when the operator stops: a replica deleted right after a restart's status write
    # took its GangRestart Event with it).
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    for note in plan.events:
        # The module's logger, not kopf's per-object one: kopf posts the latter's INFO records as
        # Events too, which would post every one of these twice.
        log_at = logging.WARNING if note.type == "Warning" else logging.INFO
        log.log(log_at, "%s/%s %s: %s", namespace, name, note.reason, note.message)
        try:
            await api.post_event(body, note.type, note.reason, note.message)
        except (kubernetes.client.ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            log.warning("%s/%s: the %s Event was not posted: %s", namespace, name, note.reason, exc)


def _record_metrics(metrics: OperatorMetrics, name: str, namespace: str, plan: Plan) -> None:
    """The job's status series, and the restart, fallback, give-up and recovery the plan records."""
    status = plan.status
    metrics.observe_status(name, namespace, status)
    decision = plan.decision
    kind = decision.failure.value if decision is not None and decision.failure is not None else "Unknown"
    if plan.action in (PlanAction.RESTART, PlanAction.RESTART_IN_PLACE):
        failure = status.last_failure
        way = IN_PLACE if plan.action is PlanAction.RESTART_IN_PLACE else BACKENDS[plan.backend].restart_way
        metrics.restarted(name, namespace, kind, failure.time if failure else None, way)
    elif plan.action is PlanAction.FALL_BACK:
        metrics.in_place_fallbacks.labels(name, namespace).inc()
    elif plan.action is PlanAction.FAIL:
        metrics.gave_up(name, namespace, kind)
    if plan.recovered_seconds is not None:
        metrics.time_to_recover.labels(name, namespace).observe(plan.recovered_seconds)


async def _delete_attempt(
    rt: Runtime, api: KubeApi, body: Mapping[str, Any], backend: Backend, old: str, stop_within: int | None
) -> None:
    """Delete the attempt's object ``old``; first stop its pods within ``stop_within`` seconds when set."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    if stop_within is not None:
        # The object's pods as the watch shows them: the restart asks the API server nothing.
        pods = [
            str(pod["metadata"]["name"])
            for pod in rt.watches.pods.of_job(namespace, name)
            if pod["metadata"].get("labels", {}).get(backend.pod_owner_label) == old
        ]
        if stopped := await api.stop_pods(namespace, pods, stop_within):
            log.info(
                "%s/%s: stopping %d pod(s) of %s within %d s", namespace, name, stopped, old, stop_within
            )
    if await api.delete_child(backend, namespace, old):
        log.info("%s/%s: deleted %s %s", namespace, name, backend.kind, old)


async def _create_attempt(
    rt: Runtime, api: KubeApi, body: Mapping[str, Any], backend: Backend, manifest: dict[str, Any]
) -> bool:
    """Create the attempt's object; whether this call created it (False: it existed already)."""
    created = await api.create_child(backend, manifest)
    verb = "created" if created is not None else "found"
    meta = body["metadata"]
    log.info(
        "%s/%s: %s %s %s", meta["namespace"], meta["name"], verb, backend.kind, manifest["metadata"]["name"]
    )
    if created is None:
        return False
    # Into the cache at once: the next step must see the attempt its status now records, even before
    # the watch reports it.
    rt.watches.children[backend.kind].created(created)
    return True


async def _give_orders(rt: Runtime, state: JobState, body: Mapping[str, Any], plan: Plan) -> None:
    """Give every pod of the plan its order, at once; the pods that did not take it are remembered for
    the next step (which falls back to a new PyTorchJob), and wake it."""
    assert plan.order is not None
    meta = body["metadata"]
    key = rt.settings.order_key.get_secret_value()
    child = getattr(plan.status, BACKENDS[plan.backend].status_field)
    signer = order_signer(key, str(meta.get("uid", "")), str(meta["namespace"]), str(child))
    answers = await asyncio.gather(*(rt.poller.order(t.ip, t.pod, signer, plan.order) for t in plan.orders))
    refused = {t.pod: why for t, why in zip(plan.orders, answers, strict=True) if why}
    state.refused_attempt, state.refusals = plan.order.attempt, refused
    log.info(
        "%s/%s: ordered attempt %d in place in %d pod(s)%s",
        meta["namespace"],
        meta["name"],
        plan.order.attempt,
        len(plan.orders) - len(refused),
        f"; refused by {sorted(refused)}" if refused else "",
    )
    if refused:
        state.changed = True
        state.wake.set()


# ---------------------------------------------------------------------------------- handlers ---
@kopf.on.resume(GROUP, VERSION, PLURAL, id="admit-on-resume")
@kopf.on.create(GROUP, VERSION, PLURAL, id="admit-on-create")
async def admit(name: str, namespace: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A new (or, after an operator restart, an existing) job: validate it and make sure its attempt
    exists. An invalid spec gets the SpecInvalid condition and a Warning event, and no PyTorchJob.

    The job's daemon starts at the same moment; when it has already finished a step (it began after this
    process saw the job, as this one would), that step is not repeated."""
    rt = _runtime(memo)
    namespace = namespace or "default"
    state = _state(rt, memo, namespace, name)
    async with state.lock:
        if state.last is None:
            await _step(rt, state, namespace, name, body)
    state.wake.set()  # the daemon takes its timing from this step


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
    namespace = namespace or "default"
    state = _state(rt, memo, namespace, name)
    async with state.lock:
        await _step(rt, state, namespace, name, body)
    state.wake.set()  # the daemon takes its timing from this step


async def _sleep(stopped: kopf.DaemonStopped, wake: asyncio.Event, seconds: float | None) -> None:
    """Until the daemon is stopped, ``wake`` is set, or ``seconds`` pass (None: no time limit)."""
    waiters = {asyncio.ensure_future(stopped.wait()), asyncio.ensure_future(wake.wait())}
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0, backoff=10.0)
async def supervise(
    name: str,
    namespace: str | None,
    body: kopf.Body,
    memo: kopf.Memo,
    stopped: kopf.DaemonStopped,
    **_: Any,
) -> None:
    """Reconcile the job until it succeeds or fails: at once when its PyTorchJob or pods change, and by
    the clock only when the last step asked for it (``Plan.clock``).

    A step another handler took (the create/resume handler's, started by kopf with this daemon, or a spec
    update's) counts as this daemon's: it waits out the rest of that step's requeue instead of repeating
    it."""
    rt = _runtime(memo)
    namespace = namespace or "default"
    state = _state(rt, memo, namespace, name)
    while not stopped:
        async with state.lock:
            state.wake.clear()
            wait = wait_before_step(state.last, state.changed, time.monotonic())
            if wait == 0.0 or state.last is None:
                outcome = await _step(rt, state, namespace, name, body)
                wait = outcome.wait_seconds()
            else:
                outcome = state.last.outcome
        if outcome.done:
            log.info("%s/%s is final; supervision ends", namespace, name)
            return
        if state.written is not None:
            # Kept only until kopf's live copy shows the write (its watch event is milliseconds away):
            # a job at rest takes no further step to drop it, and must not hold two copies of itself.
            await _sleep(
                stopped, state.wake, CATCH_UP_SECONDS if wait is None else min(wait, CATCH_UP_SECONDS)
            )
            state.written = write_still_ahead(body, state.written)
            continue  # the loop's top works out what is left of the wait, or steps when woken
        await _sleep(stopped, state.wake, wait)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
async def deleted(name: str, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    """Forget a deleted job's metric series; its PyTorchJobs go by garbage collection (owner references)."""
    found = memo.get(RUNTIME_KEY)
    if isinstance(found, Runtime):
        found.metrics.forget(name, namespace or "default")
        found.jobs.pop((namespace or "default", name), None)

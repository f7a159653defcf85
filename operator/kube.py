"""The operator's Kubernetes API calls: the official ``kubernetes`` client, run in worker threads.

Everything is plain JSON dicts in and out (the reconcile module reads dicts, not client models). The
credentials come from the pod's service account, or from ``$KUBECONFIG`` (read when the operator starts,
not when the client library was imported), and the same credentials are handed to kopf's login.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import ssl
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import aiohttp
import kopf
import kubernetes
from trainguard_operator.backends import Backend
from trainguard_operator.backends.pytorchjob import PYTORCHJOB
from trainguard_operator.backends.trainjob import TRAINJOB
from trainguard_operator.cache import JobKey, ObjectCache
from trainguard_operator.render import JOB_LABEL

from trainguard.core.spec import GROUP, KIND, PLURAL, VERSION

MERGE_PATCH = "application/merge-patch+json"
#: Seconds an API call may take before it counts as failed (and is retried).
REQUEST_TIMEOUT = 30.0
#: Who posts the operator's Events (``source.component``, ``reportingComponent``).
EVENT_COMPONENT = "trainguard-operator"
#: An Event's message is cut to this many characters (the API server refuses longer ones).
EVENT_MESSAGE_CHARS = 1024
#: Threads of their own for the calls of steps that act on a failure (``KubeApi.urgent``).
URGENT_API_THREADS = 2


def load_configuration() -> Any:
    """A ``kubernetes.client.Configuration``: in-cluster when run in a pod, else from ``$KUBECONFIG``
    (or ``~/.kube/config``). Raises ``kubernetes.config.ConfigException`` when neither works."""
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except kubernetes.config.ConfigException:
        path = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
        kubernetes.config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=path, client_configuration=configuration
        )
    return configuration


def connection_info(configuration: Any) -> kopf.ConnectionInfo:
    """kopf's credentials for the same server and identity as ``configuration``."""
    header = configuration.get_api_key_with_prefix("BearerToken") or configuration.get_api_key_with_prefix(
        "authorization"
    )
    parts = header.split(" ", 1) if header else []
    scheme, token = (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0] if parts else None)
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


def is_not_found(error: BaseException) -> bool:
    """Whether an API error is a 404."""
    return isinstance(error, kubernetes.client.ApiException) and error.status == 404


def is_conflict(error: BaseException) -> bool:
    """Whether an API error is a 409 (a stale resourceVersion, or a name already taken)."""
    return isinstance(error, kubernetes.client.ApiException) and error.status == 409


def is_transient(error: BaseException) -> bool:
    """Whether an API error is worth a quick retry: conflicts, throttling, server errors, no connection."""
    if isinstance(error, kubernetes.client.ApiException):
        return error.status in (0, 409, 429) or error.status >= 500
    return isinstance(error, OSError | TimeoutError | ConnectionError)


@dataclass
class KubeApi:
    """The API calls one reconcile step makes, as coroutines (each runs the client in a thread: the event
    loop's default threads, or with ``urgent`` threads of their own)."""

    client: Any  # kubernetes.client.ApiClient
    #: Where the calls run (None: the event loop's default threads).
    executor: Executor | None = None
    #: The threads ``urgent`` hands out (None: none, ``urgent`` is this API).
    urgent_executor: Executor | None = None

    @classmethod
    def connect(cls) -> KubeApi:
        """An API client with the operator's credentials (see ``load_configuration``)."""
        return cls(
            kubernetes.client.ApiClient(configuration=load_configuration()),
            urgent_executor=ThreadPoolExecutor(URGENT_API_THREADS, thread_name_prefix="trainguard-urgent"),
        )

    def urgent(self) -> KubeApi:
        """The same client, its calls run in threads of their own: for a step that acts on a failure (a
        gang restart, a give-up), which must not wait behind the calls queued in the default threads
        (the admissions of a burst of new jobs: a sweep submitted at once, an operator taking over)."""
        return self if self.urgent_executor is None else replace(self, executor=self.urgent_executor)

    def close(self) -> None:
        """Release the client's connection pool and the urgent threads."""
        self.client.close()
        if self.urgent_executor is not None:
            self.urgent_executor.shutdown(wait=False, cancel_futures=True)

    async def _call(self, function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` in a thread of ``executor``."""
        call = functools.partial(function, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.executor, call)

    @property
    def _custom(self) -> Any:
        return kubernetes.client.CustomObjectsApi(self.client)

    @property
    def _core(self) -> Any:
        return kubernetes.client.CoreV1Api(self.client)

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The GuardedTrainingJob as stored now (not kopf's cached copy), or None when it is gone."""
        try:
            found: dict[str, Any] = await self._call(
                self._custom.get_namespaced_custom_object,
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
                _request_timeout=REQUEST_TIMEOUT,
            )
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return found

    async def create_child(self, backend: Backend, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create an attempt's ``backend`` object and return it as stored (as sent, when the answer has
        no body); None when one of that name already exists (creation is idempotent)."""
        namespace = manifest["metadata"]["namespace"]
        try:
            created: Any = await self._call(
                self._custom.create_namespaced_custom_object,
                backend.group,
                backend.version,
                namespace,
                backend.plural,
                dict(manifest),
                _request_timeout=REQUEST_TIMEOUT,
            )
        except kubernetes.client.ApiException as exc:
            if exc.status == 409:
                return None
            raise
        return created if isinstance(created, dict) and created.get("metadata") else dict(manifest)

    async def post_event(self, body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        """Post an Event about the job ``body`` and wait for the API server to store it. Raises the
        client's ``ApiException`` when it refuses."""
        meta = body["metadata"]
        now = datetime.now(UTC)
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": str(body.get("apiVersion") or f"{GROUP}/{VERSION}"),
                "kind": str(body.get("kind") or KIND),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:EVENT_MESSAGE_CHARS],
            "count": 1,
            "firstTimestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "lastTimestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "action": reason,
            "source": {"component": EVENT_COMPONENT},
            "reportingComponent": EVENT_COMPONENT,
            "reportingInstance": os.environ.get("HOSTNAME", EVENT_COMPONENT),
        }
        await self._call(
            self._core.create_namespaced_event,
            meta["namespace"],
            event,
            _preload_content=False,  # the stored Event: not needed, not parsed
            _request_timeout=REQUEST_TIMEOUT,
        )

    async def stop_pods(self, namespace: str, pods: list[str], grace_seconds: int) -> int:
        """Delete ``pods`` with ``grace_seconds`` between SIGTERM and SIGKILL, shorter than their own (a
        pod already stopping with a shorter grace keeps it); the number of pods asked to stop. A pod gone
        meanwhile is skipped."""
        stopped = 0
        for pod in pods:
            try:
                await self._call(
                    self._core.delete_namespaced_pod,
                    pod,
                    namespace,
                    grace_period_seconds=grace_seconds,
                    _preload_content=False,  # the pod as it now is: not needed, not parsed
                    _request_timeout=REQUEST_TIMEOUT,
                )
            except kubernetes.client.ApiException as exc:
                if exc.status != 404:
                    raise
            else:
                stopped += 1
        return stopped

    async def delete_child(self, backend: Backend, namespace: str, name: str) -> bool:
        """Delete an attempt's ``backend`` object and, in the foreground, its pods; False when it was
        already gone.

        Foreground propagation keeps the object listed until its pods are gone, which is what the next
        attempt waits for.
        """
        try:
            await self._call(
                self._custom.delete_namespaced_custom_object,
                backend.group,
                backend.version,
                namespace,
                backend.plural,
                name,
                propagation_policy="Foreground",
                _request_timeout=REQUEST_TIMEOUT,
            )
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def patch_status(
        self, namespace: str, name: str, patch: Mapping[str, Any], resource_version: str | None
    ) -> dict[str, Any]:
        """Merge-patch the GuardedTrainingJob's status and return the job as stored after the write; with
        ``resource_version`` the write fails with 409 when the object changed since it was read (so no
        decision is written over a newer status)."""
        body: dict[str, Any] = {"status": dict(patch)}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        written: dict[str, Any] = await self._call(
            self._custom.patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            body,
            _content_type=MERGE_PATCH,
            _request_timeout=REQUEST_TIMEOUT,
        )
        return written


# ------------------------------------------------------------------------------------------ watches ---
log = logging.getLogger("trainguard.operator")

#: Seconds the API server keeps a watch open before this end opens the next (from the last version).
WATCH_SECONDS = 300
#: Seconds a watch may stay silent beyond that before it counts as broken (bookmarks keep it talking).
WATCH_SILENCE_SECONDS = 60.0


@dataclass(frozen=True)
class WatchedKind:
    """A kind the operator watches: its API path prefix and plural (``/api/v1`` and ``pods``)."""

    name: str
    prefix: str
    plural: str
    #: The name of the CRD that serves the kind ("" for a built-in kind).
    crd: str = ""

    def path(self, namespace: str | None) -> str:
        """The collection's path in ``namespace`` (None: every namespace)."""
        where = f"/namespaces/{namespace}" if namespace else ""
        return f"{self.prefix}{where}/{self.plural}"


PODS = WatchedKind("pods", "/api/v1", "pods")
CRDS_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def watched_kind(backend: Backend) -> WatchedKind:
    """The collection of ``backend``'s objects."""
    return WatchedKind(
        f"{backend.kind}s",
        f"/apis/{backend.group}/{backend.version}",
        backend.plural,
        crd=f"{backend.plural}.{backend.group}",
    )


#: The backends whose objects are watched.
WATCHED_BACKENDS: tuple[Backend, ...] = (PYTORCHJOB, TRAINJOB)


def _ssl_context(configuration: Any) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, configuration.key_file)
    return context


def _auth_headers(configuration: Any) -> dict[str, str]:
    """The Authorization header for ``configuration`` as of now (a service account's token rotates: the
    client's refresh hook reads it again)."""
    hook = getattr(configuration, "refresh_api_key_hook", None)
    if hook is not None:
        hook(configuration)
    token = configuration.get_api_key_with_prefix("authorization") or configuration.get_api_key_with_prefix(
        "BearerToken"
    )
    if token:
        return {"Authorization": token if " " in token else f"Bearer {token}"}
    if configuration.username:
        return {"Authorization": aiohttp.BasicAuth(configuration.username, configuration.password).encode()}
    return {}


class WatchError(Exception):
    """An answer of the API server that ends a list or a watch (its HTTP status in ``status``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message[:300]}")
        self.status = status


class Watches:
    """The backends' objects (``WATCHED_BACKENDS``) and the pods labelled with a job (``JOB_LABEL``),
    kept in an ``ObjectCache`` per kind by a list, then a watch, per kind and namespace (one cluster-wide
    set when ``namespaces`` is empty).

    A watch that ends or breaks is opened again from the last version seen; when the API server no longer
    has that version (410 Gone, or any other watch error) the kind is listed again, which replaces the
    cache of that scope. A kind the API server does not serve (its CRD missing) is listed again when
    a watch of its CRD sees it come (``_until_crd``). ``on_change`` gets the jobs whose objects
    changed, after each change. At rest this costs the API server open watches and nothing else.
    """

    def __init__(
        self,
        configuration: Any,
        namespaces: list[str],
        on_change: Callable[[set[JobKey]], None],
        *,
        retry_seconds: float,
        absent_retry_seconds: float,
    ) -> None:
        self.configuration = configuration
        self.server = str(configuration.host).rstrip("/")
        self.namespaces: list[str | None] = list(namespaces) or [None]
        self.on_change = on_change
        self.retry_seconds = retry_seconds
        self.absent_retry_seconds = absent_retry_seconds
        self.pods = ObjectCache()
        #: Each backend's objects, by its kind.
        self.children: dict[str, ObjectCache] = {b.kind: ObjectCache() for b in WATCHED_BACKENDS}
        self._listed: dict[tuple[str, str | None], asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        """Start listing and watching (tasks on the running loop)."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=_ssl_context(self.configuration)),
        )
        watched = [(watched_kind(b), self.children[b.kind]) for b in WATCHED_BACKENDS]
        for kind, cache in (*watched, (PODS, self.pods)):
            for namespace in self.namespaces:
                self._listed[kind.name, namespace] = asyncio.Event()
                self._tasks.append(
                    asyncio.create_task(
                        self._run(kind, cache, namespace), name=f"watch {kind.name} {namespace}"
                    )
                )

    async def wait_listed(self, timeout: float) -> bool:
        """Wait until every kind was listed once in every namespace; False after ``timeout`` seconds."""
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self._listed.values())), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Stop the watches and close their connections."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()

    def _changed(self, jobs: set[JobKey]) -> None:
        if jobs:
            self.on_change(jobs)

    async def _run(self, kind: WatchedKind, cache: ObjectCache, namespace: str | None) -> None:
        version: str | None = None
        where = f"in {namespace}" if namespace else "cluster-wide"
        while True:
            try:
                if version is None:
                    version = await self._list(kind, cache, namespace)
                    if version is None:  # the kind is not served: list again once its CRD comes
                        await self._until_crd(kind)
                        continue
                version = await self._watch(kind, cache, namespace, version)
                if version is None:
                    log.info("the watch of %s %s lost its place: listing again", kind.name, where)
            except WatchError as exc:
                hint = ": check the operator's RBAC (list, watch)" if exc.status in (401, 403) else ""
                log.warning("listing or watching %s %s failed (%s)%s; retrying", kind.name, where, exc, hint)
                await asyncio.sleep(self.retry_seconds)
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                # Connection lost (an API server restart, say): watch again from the last version seen.
                log.info("the watch of %s %s broke (%s); watching again", kind.name, where, exc)
                await asyncio.sleep(self.retry_seconds)

    async def _until_crd(self, kind: WatchedKind) -> None:
        """Wait until the CRD of a kind not served is created or changes: one list of it, then a watch
        from there, which costs the API server nothing at rest (a cluster without Trainer, say, is
        never polled for TrainJobs). A CRD that exists already (not yet established), a kind with no
        CRD, or a CRD that cannot be read is looked at again after ``absent_retry_seconds``."""
        assert self._session is not None
        selector = {"fieldSelector": f"metadata.name={kind.crd}"}
        try:
            if not kind.crd:
                raise WatchError(404, "a built-in kind")
            async with self._session.get(
                self.server + CRDS_PATH,
                params=selector,
                headers=_auth_headers(self.configuration),
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT),
            ) as response:
                if response.status != 200:
                    raise WatchError(response.status, await response.text())
                listed = json.loads(await response.read())
        except WatchError:
            await asyncio.sleep(self.absent_retry_seconds)
            return
        if any((i.get("metadata") or {}).get("name") == kind.crd for i in listed.get("items") or []):
            await asyncio.sleep(self.absent_retry_seconds)
            return
        params = {**selector, "watch": "true", "timeoutSeconds": str(WATCH_SECONDS)}
        version = str((listed.get("metadata") or {}).get("resourceVersion") or "")
        if version:
            params["resourceVersion"] = version
        await self._watch_crd(kind.crd, params)

    async def _watch_crd(self, name: str, params: Mapping[str, str]) -> None:
        """Watch the CRDs until one named ``name`` is added or changed, or the watch ends."""
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=REQUEST_TIMEOUT, sock_read=WATCH_SECONDS + WATCH_SILENCE_SECONDS
        )
        async with self._session.get(
            self.server + CRDS_PATH, params=params, headers=_auth_headers(self.configuration), timeout=timeout
        ) as response:
            if response.status != 200:  # 410 Gone among others: list again
                await asyncio.sleep(self.absent_retry_seconds)
                return
            buffer = b""
            async for chunk in response.content.iter_any():
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    event = json.loads(line) if line.strip() else {}
                    obj = event.get("object")
                    if (
                        isinstance(obj, dict)
                        and event.get("type") in ("ADDED", "MODIFIED")
                        and (obj.get("metadata") or {}).get("name") == name
                    ):
                        return

    async def _list(self, kind: WatchedKind, cache: ObjectCache, namespace: str | None) -> str | None:
        """List the kind into the cache; its version, or None when the kind is not served."""
        assert self._session is not None
        async with self._session.get(
            self.server + kind.path(namespace),
            params={"labelSelector": JOB_LABEL},
            headers=_auth_headers(self.configuration),
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT),
        ) as response:
            if response.status == 404:
                self._changed(cache.mark_absent(namespace))
                self._listed[kind.name, namespace].set()
                return None
            if response.status != 200:
                raise WatchError(response.status, await response.text())
            listed = json.loads(await response.read())
        items = [i for i in listed.get("items") or [] if isinstance(i, dict)]
        self._changed(cache.replace(items, namespace))
        self._listed[kind.name, namespace].set()
        return str((listed.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(
        self, kind: WatchedKind, cache: ObjectCache, namespace: str | None, version: str
    ) -> str | None:
        """Watch from ``version`` until the stream ends; the last version seen, or None to list again."""
        assert self._session is not None
        params = {
            "watch": "true",
            "labelSelector": JOB_LABEL,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_SECONDS),
        }
        if version:
            params["resourceVersion"] = version
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=REQUEST_TIMEOUT, sock_read=WATCH_SECONDS + WATCH_SILENCE_SECONDS
        )
        async with self._session.get(
            self.server + kind.path(namespace),
            params=params,
            headers=_auth_headers(self.configuration),
            timeout=timeout,
        ) as response:
            if response.status == 410:
                return None
            if response.status != 200:
                raise WatchError(response.status, await response.text())
            buffer = b""
            async for chunk in response.content.iter_any():
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    kind_of_event, obj = event.get("type"), event.get("object")
                    if not isinstance(obj, dict):
                        continue
                    if kind_of_event == "ERROR":
                        if obj.get("code") != 410:
                            log.warning(
                                "the watch of %s answered an error: %s", kind.name, obj.get("message")
                            )
                        return None
                    version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                    if kind_of_event in ("ADDED", "MODIFIED", "DELETED"):
                        self._changed(cache.apply(kind_of_event, obj))
        return version

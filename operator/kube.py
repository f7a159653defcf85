"""The operator's Kubernetes API calls: the official ``kubernetes`` client, run in worker threads.

Everything is plain JSON dicts in and out (the reconcile module reads dicts, not client models). The
credentials come from the pod's service account, or from ``$KUBECONFIG`` (read when the operator starts,
not when the client library was imported), and the same credentials are handed to kopf's login.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf
import kubernetes
from trainguard_operator.render import (
    JOB_LABEL,
    PYTORCHJOB_GROUP,
    PYTORCHJOB_NAME_LABEL,
    PYTORCHJOB_PLURAL,
    PYTORCHJOB_VERSION,
)

from trainguard.core.spec import GROUP, PLURAL, VERSION

MERGE_PATCH = "application/merge-patch+json"
#: Seconds an API call may take before it counts as failed (and is retried).
REQUEST_TIMEOUT = 30.0


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
    """The API calls one reconcile step makes, as coroutines (each runs the client in a thread)."""

    client: Any  # kubernetes.client.ApiClient

    @classmethod
    def connect(cls) -> KubeApi:
        """An API client with the operator's credentials (see ``load_configuration``)."""
        return cls(kubernetes.client.ApiClient(configuration=load_configuration()))

    def close(self) -> None:
        """Release the client's connection pool."""
        self.client.close()

    @property
    def _custom(self) -> Any:
        return kubernetes.client.CustomObjectsApi(self.client)

    @property
    def _core(self) -> Any:
        return kubernetes.client.CoreV1Api(self.client)

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The GuardedTrainingJob as stored now (not kopf's cached copy), or None when it is gone."""
        try:
            found: dict[str, Any] = await asyncio.to_thread(
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

    async def list_pytorchjobs(self, namespace: str, job: str) -> list[dict[str, Any]] | None:
        """The PyTorchJobs labelled with ``job``; None when the PyTorchJob resource does not exist."""
        try:
            found = await asyncio.to_thread(
                self._custom.list_namespaced_custom_object,
                PYTORCHJOB_GROUP,
                PYTORCHJOB_VERSION,
                namespace,
                PYTORCHJOB_PLURAL,
                label_selector=f"{JOB_LABEL}={job}",
                _request_timeout=REQUEST_TIMEOUT,
            )
        except kubernetes.client.ApiException as exc:
            # A list never 404s for an existing resource: the CRD is not installed.
            if exc.status == 404:
                return None
            raise
        return list(found.get("items") or [])

    async def list_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        """The pods labelled with ``job`` (every attempt), as JSON dicts."""
        return await self._pods_labelled(namespace, f"{JOB_LABEL}={job}")

    async def _pods_labelled(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        response = await asyncio.to_thread(
            self._core.list_namespaced_pod,
            namespace,
            label_selector=selector,
            _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT,
        )
        return list(json.loads(response.data).get("items") or [])

    async def create_pytorchjob(self, manifest: Mapping[str, Any]) -> bool:
        """Create a PyTorchJob; False when one of that name already exists (creation is idempotent)."""
        namespace = manifest["metadata"]["namespace"]
        try:
            await asyncio.to_thread(
                self._custom.create_namespaced_custom_object,
                PYTORCHJOB_GROUP,
                PYTORCHJOB_VERSION,
                namespace,
                PYTORCHJOB_PLURAL,
                dict(manifest),
                _request_timeout=REQUEST_TIMEOUT,
            )
        except kubernetes.client.ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def stop_pods(self, namespace: str, pytorchjob: str, grace_seconds: int) -> int:
        """Delete the pods of a PyTorchJob with ``grace_seconds`` between SIGTERM and SIGKILL, shorter than
        their own (a pod already stopping with a shorter grace keeps it); the number of pods asked to
        stop. A pod gone meanwhile is skipped."""
        stopped = 0
        for pod in await self._pods_labelled(namespace, f"{PYTORCHJOB_NAME_LABEL}={pytorchjob}"):
            try:
                await asyncio.to_thread(
                    self._core.delete_namespaced_pod,
                    pod["metadata"]["name"],
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

    async def delete_pytorchjob(self, namespace: str, name: str) -> bool:
        """Delete a PyTorchJob and, in the foreground, its pods; False when it was already gone.

        Foreground propagation keeps the PyTorchJob listed until its pods are gone, which is what the
        next attempt waits for.
        """
        try:
            await asyncio.to_thread(
                self._custom.delete_namespaced_custom_object,
                PYTORCHJOB_GROUP,
                PYTORCHJOB_VERSION,
                namespace,
                PYTORCHJOB_PLURAL,
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
    ) -> None:
        """Merge-patch the GuardedTrainingJob's status; with ``resource_version`` the write fails with 409
        when the object changed since it was read (so no decision is written over a newer status)."""
        body: dict[str, Any] = {"status": dict(patch)}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        await asyncio.to_thread(
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

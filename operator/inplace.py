"""Restarting a gang in place on a cluster: the launcher in the worker's command, the token that lets the
operator order a pod's next attempt, and whether a restart may keep the gang's pods. Pure.

A gang restarted in place keeps its PyTorchJob, its pods, their network, volumes and sidecars: each
pod's launcher (``trainer_sidecar.launcher``, rendered as the worker container's entrypoint) stops its
worker at once and starts the next attempt's after the backoff, in a warm spare where it keeps one. The
operator tells it so through the pod's sidecar (``POST /restart``, ``contract.inplace``) with an order
signed for that pod, and a token; both the signing key and the token are derived from a key only the
operator holds, for one PyTorchJob (``OrderSigner``). The pod's spec holds the signing key and the token's
digest, never the token; the wire carries the token and signed orders, never the key: neither alone
makes an order, and a captured order is good for its own pod, once, for a minute.

Nothing here needs a feature of Kubernetes or Kubeflow beyond what a new PyTorchJob already uses: a pod,
an emptyDir, a native sidecar, HTTP on the pod network. Whatever a restart in place cannot do (a pod or
node gone, a container ended, the world size changed, a launcher that does not answer) falls back to
a new PyTorchJob, as every restart did before. Which pods can take an order is read in ``pods``
(``read_hosts``); when to restart in place is decided in ``inplace_step``, for ``reconcile``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field

from trainer_sidecar.contract.inplace import (
    LAUNCHER_MODULE,
    LAUNCHER_SCRIPT,
    RestartOrder,
    pod_identity,
    sign_order,
)
from trainguard.core.torchrun import is_python

#: What a failed worker's launcher waits for an order on top of three of the operator's polls: its
#: decision, the status write before the order, and the order's round trip.
ORDER_WAIT_MARGIN_SECONDS = 15


def order_token(key: str, uid: str, pytorchjob: str) -> str:
    """The token that orders the pods of ``pytorchjob`` of the job with ``uid``: an HMAC of both under the
    operator's ``key``, so a token is good for one PyTorchJob only and an operator restarted with the same
    key derives it again."""
    return hmac.new(key.encode(), f"{uid}/{pytorchjob}".encode(), hashlib.sha256).hexdigest()


def order_signing_key(key: str, uid: str, pytorchjob: str) -> str:
    """The key orders to the pods of ``pytorchjob`` of the job with ``uid`` are signed with (64 hex
    digits): an HMAC under the operator's ``key`` as ``order_token``'s, of another message, so that
    neither of the two tells the other."""
    message = f"trainguard order signing key\0{uid}/{pytorchjob}".encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class OrderSigner:
    """What orders the pods of one PyTorchJob in ``namespace``: its ``token`` (sent, as a bearer token)
    and its ``signing_key`` (never sent). Neither is in its repr (a log line)."""

    namespace: str
    token: str = field(repr=False)
    signing_key: str = field(repr=False)

    def body(self, pod: str, order: RestartOrder, now: float) -> bytes:
        """``order`` for the pod named ``pod``, signed at ``now`` (unix seconds) with a fresh nonce."""
        return sign_order(self.signing_key, pod_identity(self.namespace, pod), order, now)


def order_signer(key: str, uid: str, namespace: str, pytorchjob: str) -> OrderSigner:
    """The signer of orders to the pods of ``pytorchjob`` (in ``namespace``) of the job with ``uid``,
    under the operator's ``key``."""
    return OrderSigner(namespace, order_token(key, uid, pytorchjob), order_signing_key(key, uid, pytorchjob))


def order_wait_seconds(probe_period_seconds: int) -> int:
    """How long a failed worker's launcher waits for an order before its container ends as the worker
    did (the restart then makes a new PyTorchJob): the operator sees the exit at its next poll."""
    return 3 * probe_period_seconds + ORDER_WAIT_MARGIN_SECONDS


def launcher_command(command: Sequence[str], *, order_wait_seconds: int, warm: bool) -> list[str]:
    """``command`` run under the launcher: by the command's own interpreter when it starts Python (that
    interpreter has trainguard installed, and a warm spare needs the same one), else by the launcher's
    console script."""
    program = command[0] if command else ""
    launcher = [program, "-m", LAUNCHER_MODULE] if is_python(program) else [LAUNCHER_SCRIPT]
    flags = ["--order-wait-seconds", str(order_wait_seconds), *([] if warm else ["--no-spare"])]
    return [*launcher, *flags, "--", *command]


@dataclass(frozen=True)
class OrderTarget:
    """A pod to order, and its IP (where its sidecar listens)."""

    pod: str
    ip: str

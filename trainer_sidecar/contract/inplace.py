"""Restarting a gang in place: the order that starts a pod's next attempt, and the launcher's state.

A pod that restarts in place keeps its container: its entrypoint is the launcher
(``trainer_sidecar.launcher``), a torch-free process that runs the worker command as its child, and
restarts that child (in a warm spare where the command allows one) when it is ordered to. The order and
the launcher's answer are two small files in the pod's status directory, the emptyDir the worker and
the sidecar already share:

- ``restart-order.json`` (``RestartOrder``): the attempt to start, the trainguard variables that change
  with it, and how to stop the worker that runs now. The runner that decides the restart (the operator,
  through the sidecar) writes it; the launcher acts on an order once, when its attempt is newer than the
  one it runs.
- ``launcher.json`` (``LauncherState``): which attempt the launcher runs, whether its worker is running
  or has exited (with the exit code a container would have shown), and whether a warm spare is ready.
  The launcher writes it at every change; the sidecar reports it.

The runner that decides a restart reaches a pod through its sidecar: ``POST /restart`` (``ORDER_PATH``)
with a signed order as its body (``SignedOrder``, made by ``sign_order``) and ``Authorization: Bearer
TOKEN``. The signature (HMAC-SHA256 under the PyTorchJob's signing key) covers the whole order, the pod it
is for (``namespace/name``), when it was issued, when it expires (``ORDER_LIFETIME_SECONDS`` later) and a
nonce; the sidecar checks it (``check_order``), takes an order only for an attempt newer than any its pod
runs or was ordered (``order_verdict``), and never one nonce twice. It knows the token's SHA-256 only
(``order_token_digest``): the token goes over the wire, the signing key never does, so forging an order
takes both what the pod network shows and what the pod's spec shows. It writes the order file for the
launcher.

Both are written atomically and read bounded (``contract.files``): each side trusts nothing of the other.
An order may set only the worker variables an attempt changes (``ORDERABLE_VARIABLES``): the rest of
the worker's environment is the pod's, fixed for the pod's life.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import signal
import tempfile
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainer_sidecar.contract.env import ATTEMPT_ENV, REMEDIATION_ENV, RESTARTS_ENV, RUN_SECONDS_ENV
from trainer_sidecar.contract.files import FileRefused, read_small_file
from trainer_sidecar.contract.settings import SETTINGS_ENV

__all__ = [
    "LAUNCHER_FILE",
    "LAUNCHER_MODULE",
    "LAUNCHER_SCRIPT",
    "MAX_OUTPUT_TAIL_CHARS",
    "MAX_START_DELAY_SECONDS",
    "ORDERABLE_VARIABLES",
    "ORDER_CLOCK_SKEW_SECONDS",
    "ORDER_FILE",
    "ORDER_LIFETIME_SECONDS",
    "ORDER_PATH",
    "SIGNING_KEY_PATTERN",
    "LauncherPhase",
    "LauncherState",
    "OrderCheck",
    "OrderClaims",
    "OrderRead",
    "Refusal",
    "RestartOrder",
    "SignedOrder",
    "StateRead",
    "StopMode",
    "Verdict",
    "check_order",
    "container_exit_code",
    "order_token_digest",
    "order_verdict",
    "pod_identity",
    "read_launcher_state",
    "read_order",
    "sign_order",
    "write_launcher_state",
    "write_order",
]

ORDER_FILE = "restart-order.json"
#: The launcher, as a module of the worker's interpreter and as the console script the package installs.
LAUNCHER_MODULE = "trainer_sidecar.launcher.launcher"
LAUNCHER_SCRIPT = "trainguard-launch"
#: The sidecar's endpoint that takes an order.
ORDER_PATH = "/restart"
LAUNCHER_FILE = "launcher.json"
#: Either file is a few variables and numbers: far below this, unless something is wrong.
MAX_FILE_BYTES = 256 * 1024
#: The worker variables that differ from one attempt to the next (``WorkerEnvironment``): the attempt, the
#: remediation it carries out, the failure history ``everySteps: auto`` reads, and the guardian settings
#: (a spec change of ``guard`` or ``health`` takes effect at the next attempt).
ORDERABLE_VARIABLES = frozenset({ATTEMPT_ENV, REMEDIATION_ENV, RESTARTS_ENV, RUN_SECONDS_ENV, SETTINGS_ENV})
MAX_ATTEMPT = 2**31 - 1
MAX_GRACE_SECONDS = 3600.0
#: The longest wait an order may ask between stopping the worker and starting its attempt: a day, the
#: longest backoff a spec may set.
MAX_START_DELAY_SECONDS = 86400.0
MAX_MESSAGE_CHARS = 1024
MAX_OUTPUT_TAIL_CHARS = 2048

Attempt = Annotated[int, Field(ge=1, le=MAX_ATTEMPT)]


class StopMode(StrEnum):
    """How the launcher stops the worker that runs when an order arrives."""

    #: SIGKILL at once: the gang is broken (a rank hung or died), nothing left can reach a checkpoint.
    KILL = "kill"
    #: SIGTERM (the guardian stops at a step boundary, with a checkpoint), SIGKILL after the grace.
    GRACEFUL = "graceful"


class RestartOrder(BaseModel):
    """Start ``attempt`` in this pod: stop the worker that runs now as ``stop`` says (``grace_seconds``
    for a graceful stop), then, ``start_delay_seconds`` after the order arrived (the gang's backoff: the
    broken gang stops at once, the next attempt starts when the backoff is over), run the worker command
    again with ``environment`` over the pod's own. The delay is relative, so no two clocks are compared."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempt: Attempt
    environment: dict[str, str]
    stop: StopMode
    grace_seconds: float = Field(default=0.0, ge=0.0, le=MAX_GRACE_SECONDS, allow_inf_nan=False)
    start_delay_seconds: float = Field(default=0.0, ge=0.0, le=MAX_START_DELAY_SECONDS, allow_inf_nan=False)

    @field_validator("environment")
    @classmethod
    def _orderable(cls, environment: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(environment) - ORDERABLE_VARIABLES)
        if unknown:
            allowed = ", ".join(sorted(ORDERABLE_VARIABLES))
            raise ValueError(f"{', '.join(unknown)} cannot be set by an order (only {allowed})")
        if any("\0" in value for value in environment.values()):
            raise ValueError("a value holds a NUL byte")
        return environment


class LauncherPhase(StrEnum):
    """Where the launcher's worker is."""

    #: The worker process of ``attempt`` runs.
    RUNNING = "running"
    #: The worker of ``attempt`` exited (``exit_code``); the launcher waits for an order before it exits.
    EXITED = "exited"
    #: An order arrived: the old worker is being stopped, or is stopped and ``attempt`` starts at
    #: ``starts_at`` (the order's delay).
    STOPPING = "stopping"


class LauncherState(BaseModel):
    """What the launcher of a pod runs: ``attempt`` in ``phase`` since ``since`` (wall-clock seconds:
    when the attempt's worker started, when it exited, or when the order to stop it arrived); the
    worker's ``pid`` while
    it runs, its ``exit_code`` once it exited (as a container shows it: 128 + the signal for a killed
    process); ``warm``: whether the attempt started in a warm spare; ``spare_ready``: whether one waits for
    the next; ``updated_at``: wall-clock seconds of the write; ``starts_at``: while stopping, when the
    ordered attempt is due to start (None: as soon as the old worker is gone). Unknown fields are ignored
    (a newer launcher's additions)."""

    model_config = ConfigDict(extra="ignore")

    attempt: Attempt
    phase: LauncherPhase
    since: float = Field(ge=0.0, allow_inf_nan=False)
    pid: int | None = Field(default=None, ge=1, le=2**31 - 1)
    exit_code: int | None = Field(default=None, ge=0, le=255)
    warm: bool = False
    spare_ready: bool = False
    updated_at: float = Field(ge=0.0, allow_inf_nan=False)
    message: str = Field(default="", max_length=MAX_MESSAGE_CHARS)
    starts_at: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    #: When the attempt's worker started (None: not started yet): a worker status older than this is
    #: an earlier attempt's.
    started_at: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    #: Once the worker exited: the end of what it wrote to its standard error (a warm worker: its output),
    #: what a container's log fallback would have shown of a crash (the exception's last lines).
    output_tail: str = Field(default="", max_length=MAX_OUTPUT_TAIL_CHARS)
    #: Once the worker exited: whether the kernel's OOM killer killed a process of the container while it
    #: ran (the container's memory cgroup counted a kill), as a container would show ``OOMKilled``.
    oom_killed: bool = False


def order_token_digest(token: str) -> str:
    """The SHA-256 of ``token``, in hex: what a sidecar is told instead of the token itself (a pod's spec
    is readable by more than the runner that orders restarts)."""
    return hashlib.sha256(token.encode()).hexdigest()


#: How long a signed order is good for after it was issued (the operator sends it at once), and how far
#: apart a sidecar allows its wall clock and the operator's to be, either way (NTP keeps nodes well within).
ORDER_LIFETIME_SECONDS = 60.0
ORDER_CLOCK_SKEW_SECONDS = 30.0
#: A signing key: 32 bytes, in hex.
SIGNING_KEY_PATTERN = r"^[0-9a-f]{64}$"
#: The longest pod identity: a namespace (63), "/", a pod name (253).
MAX_POD_IDENTITY_CHARS = 317


def pod_identity(namespace: str, name: str) -> str:
    """The pod an order is for, as its claims name it: ``namespace/name``."""
    return f"{namespace}/{name}"


class OrderClaims(BaseModel):
    """What a signed order says: start ``order`` in the pod ``pod`` (``pod_identity``); issued at
    ``issued_at`` and good until ``expires_at`` (the issuer's wall clock, unix seconds; at most
    ``ORDER_LIFETIME_SECONDS`` apart); ``nonce``: 16 random bytes in hex, so that no two orders are alike
    and a sidecar takes each one once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pod: str = Field(min_length=3, max_length=MAX_POD_IDENTITY_CHARS)
    issued_at: float = Field(ge=0.0, allow_inf_nan=False)
    expires_at: float = Field(ge=0.0, allow_inf_nan=False)
    nonce: str = Field(pattern=r"^[0-9a-f]{32}$")
    order: RestartOrder

    @model_validator(mode="after")
    def _lifetime(self) -> OrderClaims:
        if not 0.0 < self.expires_at - self.issued_at <= ORDER_LIFETIME_SECONDS:
            raise ValueError(f"expires_at is not within {ORDER_LIFETIME_SECONDS:g} s after issued_at")
        return self


class SignedOrder(BaseModel):
    """The body of ``POST /restart``: ``claims``, an ``OrderClaims`` as JSON text, and ``signature``, the
    HMAC-SHA256 of exactly the UTF-8 bytes of ``claims`` under the PyTorchJob's signing key (hex). What is
    signed is the text sent, so no canonical form has to be agreed on: the signature is checked first,
    then the text parsed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    claims: str = Field(max_length=MAX_FILE_BYTES)
    signature: str = Field(pattern=r"^[0-9a-f]{64}$")


def _signature(key: str, claims: str) -> str:
    return hmac.new(bytes.fromhex(key), claims.encode(), hashlib.sha256).hexdigest()


def sign_order(key: str, pod: str, order: RestartOrder, now: float, nonce: str | None = None) -> bytes:
    """The body of an order for ``pod`` (``pod_identity``), issued at ``now`` (unix seconds), good for
    ``ORDER_LIFETIME_SECONDS``, signed with ``key`` (``SIGNING_KEY_PATTERN``); a fresh random nonce unless
    ``nonce`` is given."""
    claims = OrderClaims(
        pod=pod,
        issued_at=now,
        expires_at=now + ORDER_LIFETIME_SECONDS,
        nonce=secrets.token_hex(16) if nonce is None else nonce,
        order=order,
    ).model_dump_json()
    return SignedOrder(claims=claims, signature=_signature(key, claims)).model_dump_json().encode()


class Refusal(StrEnum):
    """Why ``check_order`` refuses an order."""

    #: Not a signed order: garbage, an unsigned order of an older operator, or claims that do not parse.
    MALFORMED = "malformed"
    #: The signature does not verify under the pod's key: altered, or not the operator's.
    FORGED = "forged"
    #: Signed, but for another pod.
    MISDIRECTED = "misdirected"
    #: Signed for this pod, but expired, or issued further ahead than the clocks' skew allows.
    EXPIRED = "expired"


class OrderCheck(NamedTuple):
    """``(claims, None, "")`` for an order that verifies, else ``(None, refusal, why)``."""

    claims: OrderClaims | None
    refusal: Refusal | None
    reason: str


def _first_error(exc: ValidationError) -> str:
    first = exc.errors(include_url=False, include_input=False)[0]
    return f"{'.'.join(str(p) for p in first['loc']) or '(body)'}: {first['msg']}"


def _unsigned(body: bytes) -> bool:
    """Whether ``body`` looks like an order of the old, unsigned format (a bare ``RestartOrder``)."""
    try:
        document = json.loads(body)
    except ValueError:
        return False
    return isinstance(document, dict) and "attempt" in document


def check_order(
    key: str, body: bytes, pod: str, now: float, skew_seconds: float = ORDER_CLOCK_SKEW_SECONDS
) -> OrderCheck:
    """Verify the order ``body`` for the pod ``pod`` at ``now`` (this side's wall clock): the signature
    under ``key`` (compared in constant time) before anything of the claims is read, then the pod, then
    the time (``skew_seconds`` allowed either way). Says nothing of the attempt or the nonce: whether a
    verified order is new is the taker's to judge (``order_verdict``). Never raises."""
    try:
        envelope = SignedOrder.model_validate_json(body)
    except ValidationError as exc:
        if _unsigned(body):
            return OrderCheck(
                None, Refusal.MALFORMED, "an unsigned restart order (an older operator's) is refused"
            )
        return OrderCheck(None, Refusal.MALFORMED, f"not a signed restart order ({_first_error(exc)})")
    if not hmac.compare_digest(_signature(key, envelope.claims), envelope.signature):
        return OrderCheck(None, Refusal.FORGED, "the order's signature does not verify")
    try:
        claims = OrderClaims.model_validate_json(envelope.claims)
    except ValidationError as exc:
        return OrderCheck(None, Refusal.MALFORMED, f"not a restart order ({_first_error(exc)})")
    if claims.pod != pod:
        return OrderCheck(None, Refusal.MISDIRECTED, f"the order is for pod {claims.pod}, this is {pod}")
    if now > claims.expires_at + skew_seconds:
        return OrderCheck(None, Refusal.EXPIRED, f"the order expired {now - claims.expires_at:.0f} s ago")
    if claims.issued_at > now + skew_seconds:
        ahead = claims.issued_at - now
        return OrderCheck(None, Refusal.EXPIRED, f"the order was issued {ahead:.0f} s ahead of this clock")
    return OrderCheck(claims, None, "")


class Verdict(StrEnum):
    """What a pod does with a verified order (``order_verdict``)."""

    #: Write it for the launcher.
    TAKE = "take"
    #: Its attempt is the one the pod runs, or was ordered already: nothing to do, and nothing done.
    TAKEN = "taken"
    #: Its attempt is older than the pod's, or another attempt's order waits for the launcher.
    REFUSE = "refuse"


def order_verdict(attempt: int, running: LauncherState, pending: RestartOrder | None) -> tuple[Verdict, str]:
    """What a pod whose launcher runs ``running`` and whose order file holds ``pending`` (None: none, or
    unreadable) does with a verified order for ``attempt``, and why. An order waits (``pending``) from
    its write until the launcher acts on it; while one waits, no other attempt is taken, so that of two
    orders at once exactly one is, and an answer "taken" stays true."""
    waiting = pending.attempt if pending is not None and pending.attempt > running.attempt else None
    current = running.attempt if waiting is None else waiting
    if attempt == current:
        how = "already runs" if waiting is None else "was already ordered"
        return Verdict.TAKEN, f"attempt {attempt} {how} in this pod"
    if attempt < current:
        how = "runs" if waiting is None else "was ordered"
        return Verdict.REFUSE, f"attempt {attempt} is older than attempt {current}, which {how} in this pod"
    if waiting is not None:
        return Verdict.REFUSE, f"attempt {attempt} not taken: attempt {waiting} was ordered, not started yet"
    return Verdict.TAKE, f"attempt {attempt} ordered"


def container_exit_code(returncode: int) -> int:
    """``returncode`` as a container running the process as its entrypoint would have exited: a process
    killed by signal N shows 128 + N, as a shell and the kubelet show it."""
    if returncode < 0:
        return min(255, 128 - returncode)
    return returncode & 0xFF


#: A written order or state: read by the other container's user (the worker's, the sidecar's).
FILE_MODE = 0o644


def _write_atomic(path: Path, payload: dict[str, Any]) -> None:
    # A temporary file of its own for every write (not one per process): threads of one process, the
    # sidecar's request handlers, write the same file at once.
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "w") as handle:
            os.fchmod(handle.fileno(), FILE_MODE)
            handle.write(json.dumps(payload, separators=(",", ":")))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_order(directory: Path, order: RestartOrder) -> Path:
    """Write ``order`` to ``directory``'s order file, atomically; returns its path (OSError if it cannot)."""
    path = Path(directory) / ORDER_FILE
    _write_atomic(path, order.model_dump(mode="json"))
    return path


def write_launcher_state(directory: Path, state: LauncherState) -> Path:
    """Write ``state`` to ``directory``'s launcher file, atomically; returns its path."""
    path = Path(directory) / LAUNCHER_FILE
    _write_atomic(path, state.model_dump(mode="json"))
    return path


class OrderRead(NamedTuple):
    """``(order, "")``, ``(None, "")`` when there is no order, or ``(None, why it is refused)``."""

    order: RestartOrder | None
    reason: str


class StateRead(NamedTuple):
    """``(state, "")``, ``(None, "")`` when there is no launcher file, or ``(None, why it is refused)``."""

    state: LauncherState | None
    reason: str


def _read(path: Path, model: type[BaseModel]) -> tuple[Any, str]:
    source = f"{model.__name__} file {path}"
    try:
        data = read_small_file(path, MAX_FILE_BYTES, source)
    except FileNotFoundError:
        return None, ""
    except FileRefused as exc:
        return None, str(exc)
    try:
        return model.model_validate_json(data), ""
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "(document)"
        return None, f"{source} is not valid ({where}: {first['msg']})"
    except Exception as exc:  # never trust the parser's error paths with hostile input either
        return None, f"{source} cannot be parsed: {type(exc).__name__}"


def read_order(directory: Path) -> OrderRead:
    """The order in ``directory`` (see ``OrderRead``). Never raises, never blocks on a special file."""
    return OrderRead(*_read(Path(directory) / ORDER_FILE, RestartOrder))


def read_launcher_state(directory: Path) -> StateRead:
    """The launcher's state in ``directory`` (see ``StateRead``). Never raises."""
    return StateRead(*_read(Path(directory) / LAUNCHER_FILE, LauncherState))


#: The signal each stop mode sends first.
FIRST_SIGNAL = {StopMode.KILL: signal.SIGKILL, StopMode.GRACEFUL: signal.SIGTERM}

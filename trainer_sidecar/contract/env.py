"""The environment trainguard's processes hand each other: every ``TRAINGUARD_*`` name, in one place.

Who sets what, and who reads it:

* a worker's variables (``WorkerEnvironment``) are set by both runners, the operator's renderer
  (``trainguard_operator.render``) and ``trainguard run`` (``trainguard.local.runner``), from one builder,
  and read once by the guardian (``trainer_sidecar.guardian.config.GuardianConfig.from_env``);
* a sidecar's variables (``SidecarEnvironment``) are set by both runners from one builder and read by the
  sidecar (``trainer_sidecar.sidecar.server.load_settings``, where each also has a flag);
* ``GANG_ENV`` and ``RUN_ENV`` mark the processes of a ``trainguard run`` so that it can find what a run
  of the same checkpoint directory left behind (a kubelet has the pod's cgroup for that), and
  ``LAUNCH_TREE_ENV`` the processes of a ``trainguard-launch``, so that its watchdog can end them if the
  launcher is killed;
* ``FAULTS_ENV`` is the user's own: fault injection for tests and drills (``guardian.faults``).

A runner's variables replace any of the same name in the user's environment: the status path and the
settings must agree with the sidecar and the spec.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer_sidecar.contract.settings import SETTINGS_ENV, GuardianSettings, RemediationOrder

PREFIX = "TRAINGUARD_"

# Read by the guardian in the worker.
CHECKPOINT_DIR_ENV = "TRAINGUARD_CHECKPOINT_DIR"
STATUS_FILE_ENV = "TRAINGUARD_STATUS_FILE"
TERMINATION_MESSAGE_ENV = "TRAINGUARD_TERMINATION_MESSAGE_PATH"
JOB_NAME_ENV = "TRAINGUARD_JOB_NAME"
NAMESPACE_ENV = "TRAINGUARD_NAMESPACE"
ATTEMPT_ENV = "TRAINGUARD_ATTEMPT"
REMEDIATION_ENV = "TRAINGUARD_REMEDIATION"
FAULTS_ENV = "TRAINGUARD_FAULTS"
#: The job's failure history before this attempt, for ``everySteps: auto``: its gang restarts so far and
#: the seconds since it first started (set on every attempt: 0 and 0 on the first).
RESTARTS_ENV = "TRAINGUARD_RESTARTS"
RUN_SECONDS_ENV = "TRAINGUARD_RUN_SECONDS"

# Read by the sidecar (besides STATUS_FILE_ENV, JOB_NAME_ENV and NAMESPACE_ENV).
SIDECAR_HOST_ENV = "TRAINGUARD_SIDECAR_HOST"
SIDECAR_PORT_ENV = "TRAINGUARD_SIDECAR_PORT"
HANG_TIMEOUT_ENV = "TRAINGUARD_HANG_TIMEOUT_SECONDS"
HANG_TIMEOUT_FLOOR_ENV = "TRAINGUARD_HANG_TIMEOUT_FLOOR_SECONDS"
STARTUP_GRACE_ENV = "TRAINGUARD_STARTUP_GRACE_SECONDS"
#: How many workers share the pod (``nprocPerNode``); each writes its own status file.
LOCAL_RANKS_ENV = "TRAINGUARD_LOCAL_RANKS"
#: The SHA-256 (hex) of the token a restart order to the sidecar must carry (unset: no orders taken).
ORDER_TOKEN_DIGEST_ENV = "TRAINGUARD_ORDER_TOKEN_SHA256"
#: The key (hex) a restart order's signature is checked with (``contract.inplace``: the PyTorchJob's).
ORDER_SIGNING_KEY_ENV = "TRAINGUARD_ORDER_SIGNING_KEY"
#: The pod's own name (the downward API's ``metadata.name``): an order names the pod it is for.
POD_NAME_ENV = "TRAINGUARD_POD_NAME"

# Set by ``trainguard run`` on every process it starts.
GANG_ENV = "TRAINGUARD_GANG_ID"
RUN_ENV = "TRAINGUARD_RUN_OF"
# Set by ``trainguard-launch`` on every process it starts (random per launcher): what its watchdog ends.
LAUNCH_TREE_ENV = "TRAINGUARD_LAUNCH_TREE"

__all__ = [
    "ATTEMPT_ENV",
    "CHECKPOINT_DIR_ENV",
    "FAULTS_ENV",
    "GANG_ENV",
    "HANG_TIMEOUT_ENV",
    "HANG_TIMEOUT_FLOOR_ENV",
    "JOB_NAME_ENV",
    "LAUNCH_TREE_ENV",
    "LOCAL_RANKS_ENV",
    "NAMESPACE_ENV",
    "ORDER_SIGNING_KEY_ENV",
    "ORDER_TOKEN_DIGEST_ENV",
    "POD_NAME_ENV",
    "PREFIX",
    "REMEDIATION_ENV",
    "RESTARTS_ENV",
    "RUN_ENV",
    "RUN_SECONDS_ENV",
    "SETTINGS_ENV",
    "SIDECAR_HOST_ENV",
    "SIDECAR_PORT_ENV",
    "STARTUP_GRACE_ENV",
    "STATUS_FILE_ENV",
    "TERMINATION_MESSAGE_ENV",
    "SidecarEnvironment",
    "WorkerEnvironment",
]


@dataclass(frozen=True)
class WorkerEnvironment:
    """What a runner tells a worker's guardian: its settings, its files and which attempt of which job it is.

    ``variables()`` is the whole of it as environment variables; the paths are as the worker sees them (a
    pod's mount paths, or this machine's paths under ``trainguard run``).
    """

    settings: GuardianSettings
    checkpoint_dir: str
    status_file: str
    termination_message_path: str
    job_name: str
    namespace: str
    attempt: int
    remediation: RemediationOrder | None = None
    #: The job's gang restarts before this attempt and its run time until this attempt (seconds).
    restarts: int = 0
    run_seconds: float = 0.0

    def variables(self) -> dict[str, str]:
        """The worker's ``TRAINGUARD_*`` variables, ``TRAINGUARD_REMEDIATION`` only when there is one. The
        failure history (``TRAINGUARD_RESTARTS``, ``TRAINGUARD_RUN_SECONDS``) is set on every attempt, so
        that no value of the job's own environment stands in for it; before any restart it is 0 restarts
        in 0 s (a run time without a failure rates nothing, and both runners then agree exactly)."""
        variables = {
            SETTINGS_ENV: self.settings.model_dump_json(by_alias=True),
            CHECKPOINT_DIR_ENV: self.checkpoint_dir,
            STATUS_FILE_ENV: self.status_file,
            # On a cluster the guardian's final status outlives the sidecar in the pod's
            # state.terminated.message; locally the runner reads the same file.
            TERMINATION_MESSAGE_ENV: self.termination_message_path,
            JOB_NAME_ENV: self.job_name,
            NAMESPACE_ENV: self.namespace,
            ATTEMPT_ENV: str(self.attempt),
        }
        if self.remediation is not None:
            variables[REMEDIATION_ENV] = self.remediation.to_json()
        restarts = max(0, self.restarts)
        variables[RESTARTS_ENV] = str(restarts)
        variables[RUN_SECONDS_ENV] = str(max(0, round(self.run_seconds)) if restarts else 0)
        return variables


@dataclass(frozen=True)
class SidecarEnvironment:
    """What a runner tells a sidecar: whose status to read, where to listen, and the job's health timing."""

    status_file: str
    host: str | None
    port: int
    hang_timeout_seconds: float
    startup_grace_seconds: float
    job_name: str
    namespace: str
    local_ranks: int
    hang_timeout_floor_seconds: float | None = None

    def variables(self) -> dict[str, str]:
        """The sidecar's ``TRAINGUARD_*`` variables (``TRAINGUARD_SIDECAR_HOST`` only when one is given)."""
        variables = {
            STATUS_FILE_ENV: self.status_file,
            SIDECAR_PORT_ENV: str(self.port),
            HANG_TIMEOUT_ENV: _number(self.hang_timeout_seconds),
            STARTUP_GRACE_ENV: _number(self.startup_grace_seconds),
            JOB_NAME_ENV: self.job_name,
            NAMESPACE_ENV: self.namespace,
            LOCAL_RANKS_ENV: str(self.local_ranks),
        }
        if self.host is not None:
            variables[SIDECAR_HOST_ENV] = self.host
        if self.hang_timeout_floor_seconds is not None:
            variables[HANG_TIMEOUT_FLOOR_ENV] = _number(self.hang_timeout_floor_seconds)
        return variables


def _number(value: float) -> str:
    """``300`` for 300.0, as the spec's integers were always written; ``0.5`` stays ``0.5``."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))

"""What a guardian is configured with, resolved once from its arguments and the orchestrator's environment.

The orchestrator (``trainguard run`` or the operator's pod template) hands a worker its configuration as
``TRAINGUARD_*`` environment variables. ``GuardianConfig.from_env`` reads them in one place; the
``Guardian`` constructor given a ``GuardianConfig`` reads nothing from the environment. An argument the
training script passes explicitly and the orchestrator also sets must agree with it: a script that
names its own checkpoint directory must not silently write somewhere other than where the operator
mounted the volume and looks for checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from trainer_sidecar.contract.env import (
    ATTEMPT_ENV,
    CHECKPOINT_DIR_ENV,
    FAULTS_ENV,
    JOB_NAME_ENV,
    NAMESPACE_ENV,
    REMEDIATION_ENV,
    RESTARTS_ENV,
    RUN_SECONDS_ENV,
    STATUS_FILE_ENV,
    TERMINATION_MESSAGE_ENV,
)
from trainer_sidecar.contract.exitcodes import ExitCode
from trainer_sidecar.contract.settings import (
    SETTINGS_ENV,
    GuardianSettings,
    RemediationOrder,
    SettingsError,
    describe_validation_error,
    load_settings,
)
from trainer_sidecar.contract.status import (
    MAX_LOCAL_RANKS,
    Phase,
    WorkerStatus,
    local_status_file,
    write_status,
    write_termination_message,
)
from trainer_sidecar.guardian.faults import FaultSchedule, FaultSpecError, parse_faults
from trainer_sidecar.guardian.gang import Gang

log = logging.getLogger("trainguard")


class ConfigError(SystemExit):
    """A setting, file or directory makes the job unable to start; exits with ExitCode.CONFIG_ERROR.

    It is a SystemExit so that an unhandled one ends the worker with the documented permanent code. The
    message names the setting (argument or environment variable) and the reason; it is printed to stderr
    when raised, and the guardian also writes it as the worker's final status, so the orchestrator shows
    it (``trainguard run``'s output, the operator's condition).
    """

    def __init__(self, message: str) -> None:
        super().__init__(ExitCode.CONFIG_ERROR)
        self.message = message
        print(f"trainguard: {message}", file=sys.stderr, flush=True)

    def __str__(self) -> str:
        return self.message


class GuardianConfig(BaseModel):
    """Everything a guardian is configured with besides the model and the optimizer.

    ``faults`` is the fault-injection schedule (empty: none); ``job``, ``namespace`` and ``attempt`` name
    the writer in the checkpoint directory's fencing records.
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    settings: GuardianSettings = GuardianSettings()
    checkpoint_dir: Path | None = None
    status_file: Path | None = None
    #: This process's rank among its pod's worker processes, and how many there are (torchrun's
    #: LOCAL_RANK and LOCAL_WORLD_SIZE; 0 and 1 for a pod of one): the status carries them.
    local_rank: int = 0
    local_world_size: int = 1
    termination_message_path: Path | None = None
    faults: FaultSchedule = FaultSchedule()
    remediation: RemediationOrder | None = None
    job: str = ""
    namespace: str = ""
    attempt: int = 0
    #: The job's gang restarts before this attempt and its run time until then (``everySteps: auto``).
    restarts: int = 0
    run_seconds: float = 0.0

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        settings: GuardianSettings | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        status_file: str | os.PathLike[str] | None = None,
    ) -> GuardianConfig:
        """Resolve the configuration from ``environ`` (default: ``os.environ``) and explicit arguments.

        Raises ConfigError naming the variable or argument when anything is invalid, or when an explicit
        argument contradicts what the orchestrator set.
        """
        env = os.environ if environ is None else environ
        pod_status_file = _agreed_path(env, STATUS_FILE_ENV, status_file, "status_file")
        local = (0, 1) if pod_status_file is None else _local(env)  # only a status file needs them
        return cls(
            settings=_settings(env, settings),
            checkpoint_dir=_agreed_path(env, CHECKPOINT_DIR_ENV, checkpoint_dir, "checkpoint_dir"),
            status_file=None if pod_status_file is None else local_status_file(pod_status_file, *local),
            local_rank=local[0],
            local_world_size=local[1],
            termination_message_path=_path(env.get(TERMINATION_MESSAGE_ENV)),
            faults=_faults(env),
            remediation=_remediation(env),
            job=env.get(JOB_NAME_ENV, ""),
            namespace=env.get(NAMESPACE_ENV, ""),
            attempt=_attempt(env),
            restarts=_count(env, RESTARTS_ENV),
            run_seconds=float(_count(env, RUN_SECONDS_ENV)),
        )


def failure_paths(environ: Mapping[str, str] | None = None) -> tuple[Path | None, Path | None]:
    """(status file, termination message file) as the environment names them: where a configuration
    error is reported when the configuration itself cannot be resolved."""
    env = os.environ if environ is None else environ
    return _path(env.get(STATUS_FILE_ENV)), _path(env.get(TERMINATION_MESSAGE_ENV))


def _local(env: Mapping[str, str]) -> tuple[int, int]:
    """(local rank, local world size) of this process when several share a pod (torchrun sets
    LOCAL_WORLD_SIZE and LOCAL_RANK), else (0, 1): a launcher that sets LOCAL_RANK alone runs one
    process per pod. With several, each writes the status file with its local rank in its name
    (``local_status_file``), as the pod's sidecar reads it."""
    text = env.get("LOCAL_WORLD_SIZE", "").strip()
    if not text or text == "1":
        return 0, 1
    try:
        local_rank, local_ranks = int(env.get("LOCAL_RANK", "0")), int(text)
    except ValueError:
        raise ConfigError("LOCAL_RANK and LOCAL_WORLD_SIZE must be integers, as torchrun sets them") from None
    if not 0 <= local_rank < local_ranks <= MAX_LOCAL_RANKS:
        raise ConfigError(f"LOCAL_RANK {local_rank} of LOCAL_WORLD_SIZE {local_ranks} is out of range")
    return local_rank, local_ranks


def _path(value: str | os.PathLike[str] | None) -> Path | None:
    text = os.fspath(value).strip() if value is not None else ""
    return Path(text) if text else None


def _agreed_path(
    env: Mapping[str, str], variable: str, explicit: str | os.PathLike[str] | None, argument: str
) -> Path | None:
    from_env, given = _path(env.get(variable)), _path(explicit)
    if given is not None and from_env is not None and given.resolve() != from_env.resolve():
        raise ConfigError(
            f"Guardian({argument}={os.fspath(given)!r}) contradicts {variable}={os.fspath(from_env)!r}, "
            "set by the orchestrator (trainguard run or the operator): remove the argument, or make them "
            "equal"
        )
    return given if given is not None else from_env


def _settings(env: Mapping[str, str], explicit: GuardianSettings | None) -> GuardianSettings:
    try:
        from_env = load_settings(env) if env.get(SETTINGS_ENV, "").strip() else None
    except SettingsError as exc:
        raise ConfigError(str(exc)) from exc
    if explicit is not None and from_env is not None and explicit != from_env:
        raise ConfigError(
            "Guardian(settings=...) contradicts TRAINGUARD_SETTINGS set by the orchestrator (the job's "
            "spec): remove the argument, or make them equal"
        )
    return explicit or from_env or GuardianSettings()


def _faults(env: Mapping[str, str]) -> FaultSchedule:
    try:
        return parse_faults(env.get(FAULTS_ENV, ""))
    except FaultSpecError as exc:
        raise ConfigError(str(exc)) from exc


def _remediation(env: Mapping[str, str]) -> RemediationOrder | None:
    text = env.get(REMEDIATION_ENV, "").strip()
    if not text:
        return None
    try:
        raw: Any = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{REMEDIATION_ENV}: not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{REMEDIATION_ENV}: must be a JSON object, got {type(raw).__name__}")
    raw.setdefault("id", text)
    try:
        return RemediationOrder.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, REMEDIATION_ENV)) from exc


def _attempt(env: Mapping[str, str]) -> int:
    return _count(env, ATTEMPT_ENV)


def _count(env: Mapping[str, str], name: str) -> int:
    """A non-negative integer variable (0 when unset); ConfigError naming it otherwise."""
    text = env.get(name, "").strip()
    if not text:
        return 0
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name}: {text!r} is not an integer") from None
    if not 0 <= value < 1 << 62:
        raise ConfigError(f"{name}: {value} is out of range")
    return value


def report_config_error(config: GuardianConfig | None, error: ConfigError) -> None:
    """Publish a configuration error as the worker's final status (phase failed, the message naming the
    setting), to the status file and the termination message, so that the orchestrator can show it."""
    if config is not None:
        status_path, message_path = config.status_file, config.termination_message_path
    else:
        status_path, message_path = failure_paths()
    now = time.time()
    gang = Gang.current()
    status = WorkerStatus(
        rank=gang.rank,
        world_size=gang.world_size,
        pid=os.getpid(),
        phase=Phase.FAILED,
        started_at=now,
        updated_at=now,
        message=f"configuration error: {error.message}",
        exit_code=ExitCode.CONFIG_ERROR,
    )
    for path, write in ((status_path, write_status), (message_path, write_termination_message)):
        if path is None:
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write(Path(path), status)
        except OSError as exc:
            log.warning("could not report the configuration error to %s: %s", path, exc)

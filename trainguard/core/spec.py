"""The GuardedTrainingJob resource as pydantic models: the one source of truth for its shape.

The CRD in ``crds/`` is generated from these models (``python -m trainguard.core.crd``), the operator
and ``trainguard run`` validate with them, and the guardian's settings are the same section models
(``trainer_sidecar.contract.settings``). Every cross-field rule is written twice on purpose: as a pydantic
validator here (for ``trainguard run`` and the operator) and as a CEL rule in the schema extras
(for the API server), and a test checks both refuse the same objects.

Every model is strict: a value of the wrong type is refused rather than coerced (``replicas: true`` is
not 1, ``"5"`` is not 5); only an integer where a float is expected is accepted. Every count and
duration has an upper bound that the runtime can honour, stated in its description and in the CRD.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

from trainer_sidecar.contract.compute import MAX_WINDOW_STEPS
from trainer_sidecar.contract.files import FileRefused, read_small_file
from trainer_sidecar.contract.settings import (
    CheckpointPolicy as GuardianCheckpointPolicy,
)
from trainer_sidecar.contract.settings import (
    GuardianSettings,
    GuardThresholds,
    Remediation,
    describe_validation_error,
)

GROUP = "trainguard.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "GuardedTrainingJob"
PLURAL = "guardedtrainingjobs"
SINGULAR = "guardedtrainingjob"
SHORT_NAMES = ["gtj"]
WORKER_CONTAINER = "pytorch"

#: A DNS-1123 label (namespaces, metadata.name): lower-case alphanumerics and '-', at most 63.
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: A DNS-1123 subdomain (PersistentVolumeClaim names): labels joined by '.', at most 253.
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
#: The longest hang timeout and startup grace: a week. Longer is no hang detection at all.
MAX_WAIT_SECONDS = 7 * 24 * 3600
#: The longest probe period: an hour (the kubelet's periodSeconds is an int32; hourly already means a
#: hang is noticed an hour late).
MAX_PROBE_PERIOD_SECONDS = 3600
#: The longest backoff before a restart: a day.
MAX_BACKOFF_SECONDS = 24 * 3600
#: Entries and entry length of a container's command, args and env, as the CRD bounds them.
MAX_LIST_ITEMS = 256
MAX_ARGUMENT_LENGTH = 4096


def cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    """One ``x-kubernetes-validations`` entry."""
    entry: JsonDict = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True, strict=True
    )


class CheckpointSpec(GuardianCheckpointPolicy):
    """Where checkpoints live (a ReadWriteMany claim shared by all workers) and how often they are written."""

    model_config = ConfigDict(
        strict=True,
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.autoMinSteps <= self.autoMaxSteps",
                    "autoMinSteps must not exceed autoMaxSteps",
                    ".autoMinSteps",
                )
            ]
        },
    )

    claim_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS1123_SUBDOMAIN,
        description="PersistentVolumeClaim for checkpoints: a DNS-1123 subdomain, as Kubernetes names "
        "claims (trainguard run maps it to a folder under --checkpoint-root).",
    )
    mount_path: str = Field(
        "/ckpt",
        max_length=1024,
        pattern=r"^/",
        description="Where the claim is mounted in the worker (an absolute path).",
    )

    def policy(self) -> GuardianCheckpointPolicy:
        """The part the in-process guardian needs."""
        return GuardianCheckpointPolicy.model_validate(self.model_dump(exclude={"claim_name", "mount_path"}))


class StragglerSpec(_Model):
    """When a rank counts as a straggler (its own compute per step against the gang's), and what is done."""

    action: Literal["report", "restart"] = Field(
        "report",
        description="report: name the rank in the status, a metric, an Event; restart: also restart the "
        "gang, its next attempt's pods kept off the straggler's node.",
    )
    threshold: float = Field(
        1.5,
        gt=1,
        le=100,
        description="A rank whose compute per step (the median over windowSteps) is more than this "
        "multiple of the median of the other ranks' is a straggler (above 1, at most 100).",
    )
    window_steps: int = Field(
        8,
        ge=1,
        le=MAX_WINDOW_STEPS,
        description="Steps each rank's compute median covers: a rank is flagged once it stays slow for "
        "about half of them (1 to 1000).",
    )


class HealthSpec(_Model):
    """When a worker counts as hung, and how often the kubelet (or local runner) asks."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.hangTimeoutSeconds > self.probePeriodSeconds",
                    "hangTimeoutSeconds must be longer than probePeriodSeconds",
                    ".hangTimeoutSeconds",
                )
            ]
        }
    )

    hang_timeout_seconds: int = Field(
        300,
        ge=1,
        le=MAX_WAIT_SECONDS,
        description="No step for this long means hung: the ceiling of the hang timeout learned from the "
        "job's pace (see hangTimeoutFloorSeconds; at most a week: longer is no hang detection).",
    )
    hang_timeout_floor_seconds: int = Field(
        10,
        ge=1,
        le=MAX_WAIT_SECONDS,
        description="After a warm-up the hang timeout is learned from the job's own pace (4x its "
        "longest gap between steps, 2x its last checkpoint write), at least this and at most "
        "hangTimeoutSeconds. At or above hangTimeoutSeconds: not learned, the fixed rule (at most a "
        "week).",
    )
    startup_grace_seconds: int = Field(
        600,
        ge=0,
        le=MAX_WAIT_SECONDS,
        description="Time allowed before the first step, and for a rollback (restore and held-out "
        "validation), instead of the hang timeout (at most a week).",
    )
    probe_period_seconds: int = Field(
        10,
        ge=1,
        le=MAX_PROBE_PERIOD_SECONDS,
        description="How often health is checked (at most an hour; the kubelet's probe period).",
    )
    straggler: StragglerSpec = Field(
        default_factory=StragglerSpec, description="Straggler detection: a rank slower than the gang."
    )

    @model_validator(mode="after")
    def _timeout_longer_than_period(self) -> HealthSpec:
        if self.hang_timeout_seconds <= self.probe_period_seconds:
            raise ValueError("hangTimeoutSeconds must be longer than probePeriodSeconds")
        return self


class RemediationSpec(Remediation):
    """What a restart after divergence changes (the guardian's remediation, strictly typed)."""

    model_config = ConfigDict(strict=True)


class RecoverySpec(_Model):
    """How the whole gang is restarted: how often, after how long, with what remediation on divergence."""

    max_restarts: int = Field(
        5, ge=0, le=10_000, description="Gang restarts allowed before the job fails (at most 10,000)."
    )
    backoff_seconds: list[Annotated[int, Field(ge=1, le=MAX_BACKOFF_SECONDS)]] = Field(
        default=[10, 30, 90],
        min_length=1,
        max_length=20,
        description="Wait before restart N is the N-th entry; the last entry repeats (the cap). Each "
        "from 1 second to a day.",
        json_schema_extra={
            "x-kubernetes-validations": [cel("self.isSorted()", "backoffSeconds must be non-decreasing")],
        },
    )
    on_divergence: RemediationSpec = Field(
        default_factory=RemediationSpec, description="Applied after a diverged exit."
    )
    deterministic_failure_limit: int = Field(
        2,
        ge=0,
        le=100,
        description="After this many attempts in a row crashed alike (the same exit code and reason at "
        "the same step) the job fails as a deterministic failure instead of using up maxRestarts; 0: "
        "never (every crash gets maxRestarts). 0, or from 2 to 100.",
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self == 0 || self >= 2", "deterministicFailureLimit must be 0 (off) or at least 2")
            ],
        },
    )

    @field_validator("deterministic_failure_limit")
    @classmethod
    def _off_or_a_repeat(cls, value: int) -> int:
        if value == 1:
            raise ValueError("deterministicFailureLimit must be 0 (off) or at least 2")
        return value

    @field_validator("backoff_seconds")
    @classmethod
    def _non_decreasing(cls, value: list[int]) -> list[int]:
        if any(b < a for a, b in itertools.pairwise(value)):
            raise ValueError("backoffSeconds must be non-decreasing")
        return value


class DataQualitySpec(_Model):
    """What share of dropped samples is tolerated (alerting threshold)."""

    max_drop_rate: float = Field(0.001, ge=0, le=1, description="Alert above this dropped-sample ratio.")


class GuardSpec(GuardThresholds):
    """The step guard's thresholds (see the guardian)."""

    model_config = ConfigDict(
        strict=True,
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.spikeMinHistory) || self.spikeMinHistory <= self.lossSpikeWindow",
                    "spikeMinHistory must not exceed lossSpikeWindow",
                    ".spikeMinHistory",
                )
            ]
        },
    )


class ContainerSpec(BaseModel):
    """A container of the worker pod; only the fields trainguard reads are typed, the rest pass through."""

    model_config = ConfigDict(
        extra="allow", strict=True, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )

    name: str = Field(min_length=1, max_length=63)
    command: list[Annotated[str, Field(max_length=MAX_ARGUMENT_LENGTH)]] | None = Field(
        None, max_length=MAX_LIST_ITEMS
    )
    args: list[Annotated[str, Field(max_length=MAX_ARGUMENT_LENGTH)]] | None = Field(
        None, max_length=MAX_LIST_ITEMS
    )
    env: list[dict[str, Any]] | None = Field(None, max_length=MAX_LIST_ITEMS)
    working_dir: str | None = Field(
        None,
        alias="workingDir",
        max_length=MAX_ARGUMENT_LENGTH,
        description="The container's working directory (trainguard run starts the worker there).",
    )


class PodSpec(BaseModel):
    """The worker pod's spec; the container named pytorch is the training container."""

    model_config = ConfigDict(
        extra="allow",
        strict=True,
        json_schema_extra={
            "x-kubernetes-preserve-unknown-fields": True,
            "x-kubernetes-validations": [
                cel(
                    f"self.containers.exists(c, c.name == '{WORKER_CONTAINER}')",
                    f"the worker template needs a container named {WORKER_CONTAINER}",
                    ".containers",
                )
            ],
        },
    )

    containers: list[ContainerSpec] = Field(min_length=1, max_length=64)

    @field_validator("containers")
    @classmethod
    def _has_worker(cls, value: list[ContainerSpec]) -> list[ContainerSpec]:
        if not any(c.name == WORKER_CONTAINER for c in value):
            raise ValueError(f"the worker template needs a container named {WORKER_CONTAINER}")
        return value

    def worker(self) -> ContainerSpec:
        """The training container."""
        return next(c for c in self.containers if c.name == WORKER_CONTAINER)


class PodTemplate(BaseModel):
    """The worker pod template, as in a Deployment or a PyTorchJob replica."""

    model_config = ConfigDict(extra="forbid", strict=True)

    metadata: dict[str, Any] | None = Field(
        None, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )
    spec: PodSpec


#: What a job's attempts may run as (``GuardedTrainingJobSpec.backend``).
Backend = Literal["Auto", "PyTorchJob", "TrainJob"]


class GuardedTrainingJobSpec(_Model):
    """What the user asks for: a guarded distributed PyTorch job."""

    replicas: int = Field(
        1,
        ge=1,
        le=4096,
        description=(
            "Worker pods, one per node rank; rank 0 hosts the rendezvous (at most 4096: pod names stay "
            "DNS-1035 labels)."
        ),
    )
    nproc_per_node: int = Field(
        1,
        ge=1,
        le=256,
        description="Worker processes per pod (one per GPU): above 1, each pod runs the command under "
        "torchrun with this many processes, and the job has replicas x nprocPerNode ranks (at most 256, "
        "the sidecar's limit).",
    )
    backend: Backend = Field(
        "Auto",
        description="What each attempt runs as: a Kubeflow training operator PyTorchJob (kubeflow.org/v1), "
        "a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1) on trainguard's runtime, or Auto: "
        "the one whose CRD the cluster serves when the job starts (PyTorchJob when both are). Chosen once, "
        "for the job's life.",
    )
    template: PodTemplate
    checkpoint: CheckpointSpec
    guard: GuardSpec = Field(default_factory=GuardSpec)
    health: HealthSpec = Field(default_factory=HealthSpec)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    data_quality: DataQualitySpec = Field(default_factory=DataQualitySpec)

    def guardian_settings(self) -> GuardianSettings:
        """The settings handed to every worker's guardian (``TRAINGUARD_SETTINGS``)."""
        return GuardianSettings(
            guard=GuardThresholds.model_validate(self.guard.model_dump()),
            checkpoint=self.checkpoint.policy(),
            remediation=Remediation.model_validate(self.recovery.on_divergence.model_dump()),
            compute_window_steps=self.health.straggler.window_steps,
        )


class ObjectMeta(BaseModel):
    """The metadata trainguard reads; everything else is kept."""

    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(min_length=1, max_length=63, pattern=DNS1123_LABEL)
    namespace: str = Field("default", min_length=1, max_length=63, pattern=DNS1123_LABEL)


class GuardedTrainingJob(BaseModel):
    """A whole GuardedTrainingJob manifest (``kubectl apply`` form)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    api_version: str = Field(alias="apiVersion")
    kind: str
    metadata: ObjectMeta
    spec: GuardedTrainingJobSpec

    @field_validator("api_version")
    @classmethod
    def _api_version(cls, value: str) -> str:
        if value != API_VERSION:
            raise ValueError(f"must be {API_VERSION}")
        return value

    @field_validator("kind")
    @classmethod
    def _kind(cls, value: str) -> str:
        if value != KIND:
            raise ValueError(f"must be {KIND}")
        return value


MAX_JOB_FILE_BYTES = 4 << 20  # the API server itself refuses objects above about 1.5 MiB
MAX_JOB_VALUES = 200_000  # keys, items and scalars after alias expansion; real jobs hold a few hundred


class SpecError(ValueError):
    """A manifest is invalid; the message names the file and each bad field's path."""


def parse_job(document: Any, source: str) -> GuardedTrainingJob:
    """Validate one manifest (already parsed YAML) or raise SpecError naming ``source`` and fields."""
    if not isinstance(document, dict):
        raise SpecError(f"{source}: expected a GuardedTrainingJob mapping, got {type(document).__name__}")
    try:
        return GuardedTrainingJob.model_validate(document)
    except ValidationError as exc:
        raise SpecError(describe_validation_error(exc, source)) from exc


def load_job(path: Path) -> GuardedTrainingJob:
    """Read and validate a GuardedTrainingJob YAML file (the first document of kind GuardedTrainingJob)."""
    try:
        text = read_small_file(path, MAX_JOB_FILE_BYTES, str(path)).decode()
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except FileRefused as exc:
        raise SpecError(str(exc)) from exc
    except OSError as exc:
        raise SpecError(f"{path}: cannot be read: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not UTF-8 text: {exc}") from exc
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from exc
    jobs = [d for d in documents if isinstance(d, dict) and d.get("kind") == KIND]
    if not jobs:
        raise SpecError(f"{path}: no document of kind {KIND}")
    if _exceeds(jobs[0], MAX_JOB_VALUES):
        raise SpecError(
            f"{path}: more than {MAX_JOB_VALUES} values once YAML aliases are expanded (an alias bomb?)"
        )
    return parse_job(jobs[0], str(path))


def _exceeds(document: Any, limit: int) -> bool:
    """Whether the expanded document holds more than ``limit`` values (stops counting at the limit)."""
    pending = [document]
    count = 0
    while pending:
        value = pending.pop()
        count += 1
        if count > limit:
            return True
        if isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return False


class Condition(BaseModel):
    """A status condition in the Kubernetes API conventions shape."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)

    type: str
    status: str = Field(pattern="^(True|False|Unknown)$")
    reason: str = ""
    message: str = ""
    last_transition_time: str = ""
    observed_generation: int | None = None


class LastFailure(BaseModel):
    """The failure that caused the latest gang restart (or the job's failure), with what the next
    failure is compared with to tell a deterministic one (``trainguard.core.policy.FailureSignature``)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)

    reason: str
    message: str = ""
    rank: int | None = None
    exit_code: int | None = None
    time: str = ""
    attempt: int | None = Field(None, description="The attempt that failed.")
    step: int | None = Field(None, description="The step the failure's message names (unset: not known).")
    kind: str | None = Field(
        None, description="How the failing rank failed (Crashed, Hung, ...), when reason is a verdict."
    )
    cause: str | None = Field(None, description="The failing rank's own reason (its exit, and why).")
    repeats: int | None = Field(
        None, description="How many attempts in a row, up to this one, failed alike (1: the first)."
    )


class CheckpointStatus(BaseModel):
    """The newest clean checkpoint known."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)

    step: int
    path: str = ""
    sha256: str = ""
    time: str = ""


class StragglerStatus(BaseModel):
    """The rank the gang view names a straggler now (``health.straggler``), and where it runs."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)

    rank: int
    score: float = Field(description="Its compute per step over the median of the other ranks'.")
    own_score: float | None = Field(None, description="Its compute per step over its own best.")
    pod: str = ""
    node: str = ""
    step: int | None = Field(None, description="The gang's last step when it was last scored.")
    message: str = Field("", max_length=1024)


class GuardedTrainingJobStatus(BaseModel):
    """What the operator (or the local runner) reports about a job."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="allow",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )

    phase: str | None = Field(None, description="Pending, Running, Restarting, Succeeded or Failed.")
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = None
    attempt: int | None = Field(None, description="Current gang attempt, starting at 1.")
    restarts: int | None = Field(None, description="Gang restarts so far.")
    last_failure: LastFailure | None = None
    step: int | None = None
    last_clean_checkpoint: CheckpointStatus | None = None
    rollbacks: int | None = None
    skipped_steps: int | None = None
    samples_dropped: int | None = None
    drop_rate: float | None = None
    goodput: float | None = None
    checkpoint_seconds: float | None = Field(
        None, description="The longest checkpoint write seen (seconds): it sizes the pods' stop grace."
    )
    max_steps: int | None = Field(None, description="The last step the training loop declared (max_steps).")
    steps_per_second: float | None = Field(
        None, description="Steps per second of the current attempt's progress (unset: not stepping yet)."
    )
    eta_seconds: int | None = Field(
        None, description="Seconds to maxSteps at stepsPerSecond (unset: no end declared, or no rate yet)."
    )
    lost_seconds: float | None = Field(
        None,
        description="Wall time not spent on steps the final model kept: recoveries (detection, backoff, "
        "restart, redone steps), rollbacks and the start (seconds; the complement of goodput).",
    )
    eta: str | None = Field(None, description="etaSeconds for a person: 42s, 7m05s, 3h02m.")
    lost: str | None = Field(None, description="lostSeconds for a person: 42s, 7m05s, 3h02m.")
    checkpoint_every_steps: int | None = Field(
        None, description="The checkpoint interval in steps now in force (everySteps, or what auto chose)."
    )
    checkpoint_cadence: str | None = Field(
        None,
        max_length=300,
        description="Why that interval: for everySteps auto the save stall, MTBF (and its source) and step "
        "time it came from.",
    )
    hang_timeout_seconds: float | None = Field(
        None,
        description="The hang timeout the gang is judged by now (the strictest rank's, seconds): learned "
        "from its pace, between hangTimeoutFloorSeconds and hangTimeoutSeconds.",
    )
    straggler: StragglerStatus | None = Field(
        None, description="The rank slower than the gang now (health.straggler; unset: none)."
    )
    straggler_scores: list[float | None] | None = Field(
        None,
        description="Each rank's compute per step over the median of the other ranks', by rank (null: "
        "not scored).",
    )
    avoid_node: str | None = Field(
        None, description="The node the current attempt's pods keep off: the straggler's, after a restart."
    )

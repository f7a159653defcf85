"""The GuardedTrainingJob's status as the operator keeps it: the reported fields, the conditions, and the
bookkeeping every decision is made from. Pure.

Everything the operator needs to carry on after a restart lives here (``attempt``, ``restarts``,
``handledAttempt``, ``nextAttemptAt``, ``attemptCreated``, ``remediation``, ``pinned``...), so no decision
depends on memory: the status read back from the API server is the whole state.

Conditions follow the Kubernetes API conventions: ``type``, ``status`` (True/False/Unknown), a CamelCase
``reason``, a human ``message``, ``lastTransitionTime`` (changed only when ``status`` changes) and
``observedGeneration``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from trainer_sidecar.contract.fields import Value, status_updates, surfaced
from trainer_sidecar.contract.settings import RemediationOrder
from trainguard.core.policy import FailureKind, FailureSignature
from trainguard.core.spec import CheckpointStatus, Condition, GuardedTrainingJobStatus, LastFailure


class Phase(StrEnum):
    """The job's phase (``status.phase``, the State column of ``kubectl get gtj``)."""

    PENDING = "Pending"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})


class ConditionType(StrEnum):
    """The condition types the operator maintains."""

    READY = "Ready"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SPEC_INVALID = "SpecInvalid"
    SPEC_CHANGE_REFUSED = "SpecChangeRefused"
    CRD_MISSING = "BackendCRDMissing"
    DROP_RATE_HIGH = "DropRateHigh"


#: Longest message kept: the CRD's status schema caps condition and lastFailure messages at 1024
#: characters (a spec with many invalid fields makes a longer one).
MAX_MESSAGE = 1024

#: The order conditions are listed in (stable output for ``kubectl describe``).
CONDITION_ORDER = list(ConditionType)


class StepRecord(BaseModel):
    """A stretch of forward progress the operator saw: normally one per attempt, and a new one within an
    attempt when the step went backwards (an in-process rollback). Times are the operator's clock when it
    first saw the step (RFC 3339). See ``goodput``."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True)

    attempt: int = Field(ge=1, lt=10**12)
    started_at: str | None = Field(None, description="When the attempt's PyTorchJob was created.")
    resumed_step: int | None = Field(
        None, ge=0, description="The checkpoint step the attempt resumed from (unset after a rollback)."
    )
    first_step: int = Field(ge=0)
    first_step_at: str
    last_step: int = Field(ge=0)
    last_step_at: str

    @field_validator("started_at", "first_step_at", "last_step_at")
    @classmethod
    def _a_time(cls, value: str | None) -> str | None:
        if value is not None and parse_time(value) is None:
            raise ValueError(f"not an RFC 3339 time: {value!r}")
        return value

    @model_validator(mode="after")
    def _forward(self) -> StepRecord:
        if self.last_step < self.first_step:
            raise ValueError("lastStep is below firstStep")
        return self


class FoldedHistory(BaseModel):
    """The step records that fell off ``stepHistory``, folded into one: the kept history from
    ``fromStep`` to ``toStep`` took ``keptSeconds`` of wall time. See ``goodput``."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True)

    from_step: int = Field(ge=0)
    to_step: int = Field(ge=0)
    kept_seconds: float = Field(ge=0, allow_inf_nan=False)


class JobStatus(GuardedTrainingJobStatus):
    """``GuardedTrainingJobStatus`` plus the operator's bookkeeping (all camelCase on the wire)."""

    # Narrower than the reported model: a value out of range reads as unset (see from_body).
    attempt: int | None = Field(None, ge=1, lt=10**12, description="Current gang attempt, starting at 1.")
    restarts: int | None = Field(None, ge=0, description="Gang restarts so far.")
    handled_attempt: int = Field(0, ge=0, description="The last attempt whose failure was acted on.")
    attempt_created: int = Field(0, ge=0, description="The last attempt whose PyTorchJob was created.")
    attempt_started_at: str | None = Field(None, description="When the current attempt was created.")
    next_attempt_at: str | None = Field(None, description="When the pending attempt may be created.")
    backend: str | None = Field(
        None,
        description="What the job's attempts run as (PyTorchJob or TrainJob), chosen when its first attempt "
        "was created (unset with an attempt: PyTorchJob, the only backend before there were two).",
    )
    pytorch_job: str | None = Field(None, description="The current attempt's PyTorchJob.")
    train_job: str | None = Field(None, description="The current attempt's TrainJob.")
    host_attempt: int | None = Field(
        None,
        ge=1,
        lt=10**12,
        description="The earlier attempt whose PyTorchJob (and pods) the current attempt runs in, when it "
        "was restarted in place (unset: the attempt has its own PyTorchJob).",
    )
    in_place_restarts: int = Field(
        0, ge=0, description="Restarts in place the current attempt's PyTorchJob has hosted."
    )
    remediation: RemediationOrder | None = Field(None, description="Handed to the current attempt.")
    pinned: dict[str, Any] | None = Field(
        None,
        description="replicas, nprocPerNode, template, checkpoint and backend as the job started: changes "
        "are refused.",
    )
    recovering_since: str | None = Field(None, description="Failure time of the recovery in progress.")
    samples_seen: int | None = None
    goodput: float | None = Field(
        None, ge=0, le=1, description="Share of wall time spent on steps the final model kept (see goodput)."
    )
    job_started_at: str | None = Field(None, description="When attempt 1 was created: goodput's wall time.")
    step_history: list[StepRecord] | None = Field(
        None, description="The latest stretches of progress seen (bounded), for goodput."
    )
    step_history_folded: FoldedHistory | None = Field(
        None, description="The older step records, folded into one (see goodput)."
    )

    @field_validator("phase")
    @classmethod
    def _known_phase(cls, value: str | None) -> str | None:
        if value is not None and value not in {p.value for p in Phase}:
            raise ValueError(f"unknown phase {value!r}")
        return value

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> JobStatus:
        """The status of an object as read from the API; an unreadable status starts from scratch."""
        raw = body.get("status")
        if not isinstance(raw, Mapping):
            return cls()
        try:
            return cls.model_validate(dict(raw))
        except ValidationError:
            # Someone wrote garbage into the status: keep what parses field by field rather than crash.
            kept: dict[str, Any] = {}
            for key, value in raw.items():
                try:
                    cls.model_validate({key: value})
                except ValidationError:
                    continue
                kept[key] = value
            return cls.model_validate(kept)

    def reported_value(self, name: str) -> Any:
        """A status value by its snake_case attribute name (a reported field's ``ReportedField.status``):
        a declared field's, or one the model does not declare, kept as an extra under its camelCase wire
        name (None: unset)."""
        if name in type(self).model_fields:
            return getattr(self, name)
        return (self.__pydantic_extra__ or {}).get(to_camel(name))

    def set_reported(self, name: str, value: Any) -> None:
        """Set a reported field's status value (see ``reported_value``)."""
        setattr(self, name if name in type(self).model_fields else to_camel(name), value)

    def take_reported(self, folded: Mapping[str, Value]) -> None:
        """Take the gang's folded reported values (``GangView.reported``) as their fields say
        (``trainer_sidecar.contract.fields.status_updates``)."""
        current = {f.status: self.reported_value(f.status) for f in surfaced("status") if f.status}
        for name, value in status_updates(folded, current).items():
            self.set_reported(name, value)

    def to_wire(self) -> dict[str, Any]:
        """The camelCase JSON form, without unset fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

    def condition(self, type_: str) -> Condition | None:
        """The condition of that type, if present."""
        return next((c for c in self.conditions if c.type == type_), None)

    def is_true(self, type_: str) -> bool:
        """Whether the condition of that type is present with status True."""
        found = self.condition(type_)
        return found is not None and found.status == "True"


def clip(message: str) -> str:
    """``message`` cut to ``MAX_MESSAGE`` characters (with an ellipsis when cut)."""
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 1] + "…"


def iso(moment: datetime) -> str:
    """RFC 3339 in UTC with a Z, whole seconds (what Kubernetes timestamps look like)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def iso_precise(moment: datetime) -> str:
    """RFC 3339 in UTC with microseconds, for times decisions are scheduled on (sub-second backoffs)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str | None) -> datetime | None:
    """An RFC 3339 timestamp as an aware datetime; None for None or an unparsable text."""
    if not text:
        return None
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    now: datetime,
    generation: int | None,
) -> list[Condition]:
    """``conditions`` with the one of ``type_`` set; ``lastTransitionTime`` moves only when status changes.

    ``status`` None means Unknown. The result is ordered by ``CONDITION_ORDER`` (then by type).
    """
    text = "Unknown" if status is None else ("True" if status else "False")
    message = clip(message)
    previous = next((c for c in conditions if c.type == type_), None)
    changed = previous is None or previous.status != text
    updated = Condition(
        type=type_,
        status=text,
        reason=reason,
        message=message,
        last_transition_time=iso(now) if changed or previous is None else previous.last_transition_time,
        observed_generation=generation,
    )
    others = [c for c in conditions if c.type != type_]
    return sorted([*others, updated], key=_condition_key)


def _condition_key(condition: Condition) -> tuple[int, str]:
    try:
        return CONDITION_ORDER.index(ConditionType(condition.type)), condition.type
    except ValueError:
        return len(CONDITION_ORDER), condition.type


def phase_conditions(
    conditions: Sequence[Condition],
    phase: Phase,
    reason: str,
    message: str,
    now: datetime,
    generation: int | None,
) -> list[Condition]:
    """Running, Restarting, Succeeded, Failed and the Ready summary, all consistent with ``phase``.

    Ready is True while the job runs without a pending recovery or has succeeded, and never while a
    SpecInvalid, BackendCRDMissing or SpecChangeRefused condition is True.
    """
    result = list(conditions)
    for type_, own in (
        (ConditionType.RUNNING, Phase.RUNNING),
        (ConditionType.RESTARTING, Phase.RESTARTING),
        (ConditionType.SUCCEEDED, Phase.SUCCEEDED),
        (ConditionType.FAILED, Phase.FAILED),
    ):
        active = phase is own
        result = set_condition(
            result,
            type_,
            active,
            reason if active else f"Not{own.value}",
            message if active else "",
            now,
            generation,
        )
    blocking = [c for c in result if c.status == "True" and c.type in _BLOCKING_CONDITIONS]
    if blocking:
        first = blocking[0]
        return set_condition(result, ConditionType.READY, False, first.type, first.message, now, generation)
    ready = phase in (Phase.RUNNING, Phase.SUCCEEDED)
    return set_condition(result, ConditionType.READY, ready, phase.value, message, now, generation)


_BLOCKING_CONDITIONS = frozenset(
    {ConditionType.SPEC_INVALID, ConditionType.CRD_MISSING, ConditionType.SPEC_CHANGE_REFUSED}
)


def last_failure(
    reason: str,
    message: str,
    rank: int | None,
    exit_code: int | None,
    now: datetime,
    signature: FailureSignature | None = None,
) -> LastFailure:
    """The ``lastFailure`` record of a failure acted on at ``now``, with its signature (what the next
    failure is compared with) when the policy gave one."""
    record = LastFailure(reason=reason, message=clip(message), rank=rank, exit_code=exit_code, time=iso(now))
    if signature is None:
        return record
    return record.model_copy(
        update={
            "attempt": signature.attempt,
            "step": signature.step,
            "kind": signature.kind.value,
            "cause": clip(signature.cause),
            "repeats": signature.repeats,
        }
    )


def failure_signature(record: LastFailure | None) -> FailureSignature | None:
    """The signature a ``lastFailure`` record holds (None: none, or one recorded before signatures were,
    or not readable: the next failure then counts as a first)."""
    if record is None or record.attempt is None or record.kind is None or record.cause is None:
        return None
    try:
        kind = FailureKind(record.kind)
    except ValueError:
        return None
    return FailureSignature(
        kind=kind,
        step=record.step,
        exit_code=record.exit_code,
        cause=record.cause,
        attempt=record.attempt,
        repeats=max(1, record.repeats or 1),
    )


def checkpoint_status(raw: Mapping[str, Any]) -> CheckpointStatus | None:
    """A worker's ``last_clean_checkpoint`` (step, path, sha256, unix time) as the status records it."""
    try:
        step = int(raw["step"])
    except (KeyError, TypeError, ValueError):
        return None
    when = raw.get("time")
    stamp = ""
    if isinstance(when, int | float) and when > 0:
        try:
            stamp = iso(datetime.fromtimestamp(float(when), UTC))
        except (OverflowError, ValueError, OSError):
            stamp = ""  # beyond the calendar: a worker's clock is not trusted
    # Clipped to the CRD's limits: a status the API server refuses would stop every later write.
    path, sha256 = clip(str(raw.get("path", ""))), clip(str(raw.get("sha256", "")))
    return CheckpointStatus(step=step, path=path, sha256=sha256, time=stamp)


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new``: removed keys become null, nested
    objects are patched key by key, anything else (lists included) is replaced when it differs."""
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            nested = merge_patch(before, value)
            if nested:
                patch[key] = nested
        elif key not in old or before != value:
            patch[key] = value
    return patch

"""Every number a worker reports that reaches the user, described once. Pure, torch-free.

A ``ReportedField`` says what one ``WorkerStatus`` field is, how the ranks' values fold into the gang's
(``Fold``), and where the gang's value surfaces: the job's status (and how a new value is taken there),
a Prometheus gauge, the run summary, a ``kubectl get`` column. ``REPORTED`` lists them all, and every
reader folds and surfaces them from it: the gang view (``trainguard.core.observation``), the operator's
status and metrics (``trainguard_operator``), the run summary (``trainguard.core.summary``) and the CRD's
status schema and printer columns (``trainguard.core.crd``).

Adding a field: declare it on ``WorkerStatus`` (``contract.status``), have the guardian write it, and add
its ``ReportedField`` here (see ``docs/architecture.md``, "Adding a status field").

Readers take the registry through these helpers (or ``fields.REPORTED`` at call time), never by a copy
bound at import, so the registry is the one place a field is listed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from trainer_sidecar.contract.status import WorkerStatus

#: A reported value: a count, a measure or a word; None: not known.
Value = int | float | str | None


class Fold(StrEnum):
    """How the ranks' values of a field make the gang's (None values are not reported ones)."""

    #: The smallest: what every rank did (the gang's step is its slowest rank's).
    SLOWEST = "slowest"
    #: The largest: a collective decision, equal on every rank (the newest report wins), or the worst.
    MAX = "max"
    #: Summed over the ranks: a counter of sharded work (samples).
    SUM = "sum"
    #: Rank 0's own: a choice rank 0 makes for the gang (None until rank 0 reported).
    LEAD = "lead"
    #: Not reported by a rank: one folded field over another (``ReportedField.ratio_of``; 0 over 0 is 0).
    RATIO = "ratio"


class Keep(StrEnum):
    """How the job's status takes the gang's new value of a field."""

    #: The newest known value replaces the old one.
    LATEST = "latest"
    #: The highest ever seen stays (a worst case that sizes something, such as the stop grace).
    HIGHEST = "highest"


@dataclass(frozen=True)
class PrinterColumn:
    """A ``kubectl get`` column showing a field's status value: its header, what it says, and the
    column it comes right after (None: before Age, the last)."""

    name: str
    description: str
    after: str | None = None


@dataclass(frozen=True)
class ReportedField:
    """One field a worker reports and where it goes.

    ``name``: the ``WorkerStatus`` attribute (for a ``RATIO``, the name of the derived value) and the
    key of the folded mapping. ``type``: int, float or str. ``empty_is_unknown``: a rank's 0 or "" reads
    as not reported. ``counted_by``: for a ``SUM``, the field every rank that stepped must have counted
    above 0, else the sum is unknown (a loop that feeds itself counts no samples: 0 would read as
    measured). ``ratio_of``: a ``RATIO``'s numerator and denominator fields (listed before it).

    Surfaces (None: not there): ``status``, the job status attribute (snake_case; camelCase on the
    wire), taken as ``keep`` says, rounded to ``digits``; ``written_with``, another field whose status
    update writes this one too, even unset (and only then); ``metric`` (help text: ``description``),
    which needs ``status``; ``summary``, the run summary's key; ``column``, a printer column of ``status``.
    """

    name: str
    type: type[int] | type[float] | type[str]
    fold: Fold
    description: str
    status: str | None = None
    keep: Keep = Keep.LATEST
    digits: int | None = None
    written_with: str | None = None
    empty_is_unknown: bool = False
    counted_by: str | None = None
    ratio_of: tuple[str, str] | None = None
    metric: str | None = None
    summary: str | None = None
    column: PrinterColumn | None = None

    def __post_init__(self) -> None:
        if (self.fold is Fold.RATIO) != (self.ratio_of is not None):
            raise ValueError(f"{self.name}: ratio_of is for a RATIO field, and a RATIO needs it")
        if self.status is None and (self.metric or self.column or self.written_with):
            raise ValueError(f"{self.name}: a metric, a column or written_with needs a status field")

    @property
    def reported_by_ranks(self) -> bool:
        """Whether each rank's status carries it (a ``RATIO`` is derived from other fields)."""
        return self.fold is not Fold.RATIO


REPORTED: tuple[ReportedField, ...] = (
    ReportedField(
        "step",
        int,
        Fold.SLOWEST,
        "The gang's training step: the slowest rank's (every rank did it).",
        status="step",
        metric="trainguard_job_step",
        column=PrinterColumn("Step", "Newest step kept.", after="State"),
    ),
    ReportedField(
        "rollbacks",
        int,
        Fold.MAX,
        "In-process rollbacks reported by the guardian.",
        status="rollbacks",
        metric="trainguard_job_rollbacks",
        summary="rollbacks",
        column=PrinterColumn("Rollbacks", "In-process rollbacks.", after="Restarts"),
    ),
    ReportedField(
        "skipped_steps",
        int,
        Fold.MAX,
        "Steps the guardian skipped.",
        status="skipped_steps",
        metric="trainguard_job_skipped_steps",
        summary="skipped_steps",
    ),
    ReportedField(
        "samples_seen",
        int,
        Fold.SUM,
        "Samples the data guard saw, over all ranks.",
        status="samples_seen",
        counted_by="samples_seen",
        summary="samples_seen",
    ),
    ReportedField(
        "samples_dropped",
        int,
        Fold.SUM,
        "Samples the data guard dropped, over all ranks.",
        status="samples_dropped",
        counted_by="samples_seen",
        metric="trainguard_job_dropped_samples",
        summary="samples_dropped",
    ),
    ReportedField(
        "drop_rate",
        float,
        Fold.RATIO,
        "Dropped over seen samples, over all ranks.",
        status="drop_rate",
        ratio_of=("samples_dropped", "samples_seen"),
        metric="trainguard_job_drop_ratio",
        summary="drop_rate",
    ),
    ReportedField(
        "checkpoint_seconds",
        float,
        Fold.MAX,
        "The longest checkpoint write seen (seconds): it sizes the pods' stop grace.",
        status="checkpoint_seconds",
        keep=Keep.HIGHEST,
        digits=3,
        empty_is_unknown=True,
    ),
    ReportedField(
        "max_steps",
        int,
        Fold.MAX,
        "The last step the training loop declared (max_steps).",
        status="max_steps",
    ),
    ReportedField(
        "checkpoint_every_steps",
        int,
        Fold.LEAD,
        "The checkpoint interval in steps now in force (everySteps, or what auto chose).",
        status="checkpoint_every_steps",
        written_with="checkpoint_cadence",
    ),
    ReportedField(
        "checkpoint_cadence",
        str,
        Fold.LEAD,
        "Why that interval: for everySteps auto the save stall, MTBF (and its source) and step time it "
        "came from.",
        status="checkpoint_cadence",
        empty_is_unknown=True,
    ),
)


def registry() -> tuple[ReportedField, ...]:
    """The fields as listed now (``REPORTED``, read at call time)."""
    return REPORTED


def reported_field(name: str) -> ReportedField:
    """The field called ``name`` (KeyError: none is)."""
    for candidate in REPORTED:
        if candidate.name == name:
            return candidate
    raise KeyError(name)


def rank_values(status: WorkerStatus) -> dict[str, Value]:
    """One rank's value of every field its status carries, by name; a field it lacks (a registry entry
    newer than the model), or an empty one that reads as unknown, is None."""
    values: dict[str, Value] = {}
    for spec in REPORTED:
        if not spec.reported_by_ranks:
            continue
        value = getattr(status, spec.name, None)
        values[spec.name] = None if spec.empty_is_unknown and not value else value
    return values


def fold_ranks(ranks: Mapping[int, Mapping[str, Value]]) -> dict[str, Value]:
    """The gang's value of every field from its reporting ranks' values (``rank_values``) by rank."""
    folded: dict[str, Value] = {}
    for spec in REPORTED:
        folded[spec.name] = _fold(spec, ranks, folded)
    return folded


def _fold(
    spec: ReportedField, ranks: Mapping[int, Mapping[str, Value]], folded: Mapping[str, Value]
) -> Value:
    if spec.ratio_of is not None:
        top, bottom = folded.get(spec.ratio_of[0]), folded.get(spec.ratio_of[1])
        if not isinstance(top, int | float) or not isinstance(bottom, int | float):
            return None
        return top / bottom if bottom else 0.0
    if spec.fold is Fold.LEAD:
        return ranks[0].get(spec.name) if 0 in ranks else None
    found = [v for r in ranks.values() if (v := r.get(spec.name)) is not None]
    if not found:
        return None
    if spec.fold is Fold.SLOWEST:
        return min(found)
    if spec.fold is Fold.MAX:
        return max(found)
    if spec.counted_by is not None and not all(_counted(r, spec.counted_by) for r in ranks.values()):
        return None
    return sum(found)  # type: ignore[arg-type]


def _counted(values: Mapping[str, Value], counted_by: str) -> bool:
    """Whether a rank counted: its ``counted_by`` is above 0, or it has not completed a step yet."""
    count, step = values.get(counted_by), values.get("step")
    return (isinstance(count, int | float) and count > 0) or step == 0


def status_updates(folded: Mapping[str, Value], current: Mapping[str, Value]) -> dict[str, Value]:
    """What the job's status takes from the gang's folded values, by status attribute: every known value
    (a ``HIGHEST`` one only above ``current``'s, by status attribute), rounded as its field says, and a
    ``written_with`` field whenever the field it goes with is written."""
    updates: dict[str, Value] = {}
    for spec in REPORTED:
        if spec.status is None:
            continue
        value = folded.get(spec.name)
        if spec.written_with is not None:
            if folded.get(spec.written_with) is None:
                continue
        elif value is None:
            continue
        if spec.keep is Keep.HIGHEST and isinstance(value, int | float):
            old = current.get(spec.status)
            value = max(value, old if isinstance(old, int | float) else 0)
        if spec.digits is not None and isinstance(value, float):
            value = round(value, spec.digits)
        updates[spec.status] = value
    return updates


def summary_values(folded: Mapping[str, Value] | None) -> dict[str, Value]:
    """The run summary's figures from the gang's folded values (None: no report; each figure None), by
    summary key, in the registry's order."""
    return {
        spec.summary: None if folded is None else folded.get(spec.name)
        for spec in REPORTED
        if spec.summary is not None
    }


def surfaced(where: str) -> Iterable[ReportedField]:
    """The fields with a ``where`` surface ("status", "metric", "summary" or "column"), in order."""
    return (spec for spec in REPORTED if getattr(spec, where) is not None)

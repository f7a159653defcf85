"""Every number a worker reports that reaches the user, listed once. Pure, torch-free.

``REPORTED`` is read off ``WorkerStatus`` (``trainer_sidecar.contract.status``): each of its fields
annotated with a ``Reported`` (``trainer_sidecar.contract.reported``: how the ranks' values fold into the
gang's, ``Fold``, and where the gang's value surfaces: the job's status and how a new value is taken
there, a Prometheus gauge, the run summary, a ``kubectl get`` column, the sidecar's counter), and its
``DERIVED`` ratios. Every reader folds and surfaces the fields from it: the gang view
(``trainguard.core.observation``), the operator's status and metrics (``trainguard_operator``), the run
summary (``trainguard.core.summary``), the CRD's status schema and printer columns
(``trainguard.core.crd``) and each sidecar's counters (``trainer_sidecar.sidecar.server``).

Adding a field: declare it on ``WorkerStatus`` annotated with its ``Reported``, and have the guardian
write it (see ``docs/architecture.md``, "Adding a status field"). Nothing here changes.

Readers take the registry through these helpers (or ``fields.REPORTED`` at call time), never by a copy
bound at import, so the model is the one place a field is described.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from trainer_sidecar.contract.reported import (
    Fold,
    Keep,
    PrinterColumn,
    Reported,
    ReportedField,
    Value,
    reported_fields,
)
from trainer_sidecar.contract.status import WorkerStatus

__all__ = [
    "REPORTED",
    "Fold",
    "Keep",
    "PrinterColumn",
    "Reported",
    "ReportedField",
    "Value",
    "fold_ranks",
    "rank_values",
    "registry",
    "reported_field",
    "status_updates",
    "summary_values",
    "surfaced",
]

#: The reported fields, in ``WorkerStatus``'s order (the run summary's figures come in this order).
REPORTED: tuple[ReportedField, ...] = reported_fields(WorkerStatus)


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
    """The fields with a ``where`` surface ("status", "metric", "summary", "column" or "counter"), in
    order."""
    return (spec for spec in REPORTED if getattr(spec, where) is not None)

"""What a reported field is: how the ranks' values of a status field fold into the gang's, and where the
gang's value surfaces. Pure, torch-free, imports nothing of the product.

A field is reported by annotating its declaration on ``WorkerStatus`` with a ``Reported``
(``trainer_sidecar.contract.status``), so its type, its bounds and where it goes are written in one place;
``reported_fields`` reads them back off the model as ``ReportedField``s, and
``trainer_sidecar.contract.fields`` keeps the list every reader folds and surfaces them from.
"""

from __future__ import annotations

import types
from dataclasses import KW_ONLY, dataclass, fields
from enum import StrEnum
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel

#: A reported value: a count, a measure or a word; None: not known.
Value = int | float | str | None

#: The value types a reported field may have.
ValueType = type[int] | type[float] | type[str]


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
    #: Not reported by a rank: one folded field over another (``Reported.ratio_of``; 0 over 0 is 0).
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
class WorkerCounter:
    """A Prometheus counter each sidecar exports of its worker's own value of a field: its name (``_total``)
    and help text. The worker's value is cumulative over the job; the sidecar keeps the counter monotonic
    across resumes, and combines its pod's local ranks by the field's fold (a ``SUM``: summed; a
    ``MAX``: the largest)."""

    name: str
    help: str


@dataclass(frozen=True)
class Reported:
    """How a field folds across ranks and where it surfaces: the annotation that makes a status field a
    reported one (``Annotated[Count, Reported(Fold.MAX, "...", status="...")]``).

    ``empty_is_unknown``: a rank's 0 or "" reads as not reported. ``counted_by``: for a ``SUM``, the field
    every rank that stepped must have counted above 0, else the sum is unknown (a loop that feeds itself
    counts no samples: 0 would read as measured). ``ratio_of``: a ``RATIO``'s numerator and denominator
    fields.

    Surfaces (None: not there): ``status``, the job status attribute (snake_case; camelCase on the
    wire), taken as ``keep`` says, rounded to ``digits``; ``written_with``, another field whose status
    update writes this one too, even unset (and only then); ``metric`` (help text: ``description``),
    which needs ``status``; ``summary``, the run summary's key; ``column``, a printer column of ``status``;
    ``counter``, each sidecar's counter of its worker's value (a ``SUM`` or ``MAX`` of an int).

    Raises ValueError when the surfaces contradict each other.
    """

    fold: Fold
    description: str
    _: KW_ONLY
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
    counter: WorkerCounter | None = None

    def __post_init__(self) -> None:
        if (self.fold is Fold.RATIO) != (self.ratio_of is not None):
            raise ValueError(f"{self._what}: ratio_of is for a RATIO field, and a RATIO needs it")
        if self.status is None and (self.metric or self.column or self.written_with):
            raise ValueError(f"{self._what}: a metric, a column or written_with needs a status field")
        if self.counter is not None and self.fold not in (Fold.SUM, Fold.MAX):
            raise ValueError(f"{self._what}: a sidecar counter is of a SUM or a MAX")

    @property
    def _what(self) -> str:
        return getattr(self, "name", None) or f"a reported field ({self.description!r})"

    def named(self, name: str, value_type: ValueType) -> ReportedField:
        """This description as the field ``name`` of type ``value_type``."""
        own = {f.name: getattr(self, f.name) for f in fields(Reported)}
        return ReportedField(**own, name=name, type=value_type)


@dataclass(frozen=True, kw_only=True)
class ReportedField(Reported):
    """One field a worker reports and where it goes: its ``Reported`` description, with ``name`` (the
    ``WorkerStatus`` attribute; for a ``RATIO``, the name of the derived value) also the key of the folded
    mapping, and its value ``type``."""

    name: str
    type: ValueType

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.counter is not None and self.type is not int:
            raise ValueError(f"{self.name}: a sidecar counter counts an int")

    @property
    def reported_by_ranks(self) -> bool:
        """Whether each rank's status carries it (a ``RATIO`` is derived from other fields)."""
        return self.fold is not Fold.RATIO


def reported_fields(model: type[BaseModel]) -> tuple[ReportedField, ...]:
    """The reported fields ``model`` declares (each field annotated with a ``Reported``), in the model's
    order, each of its ``DERIVED`` ones (a class attribute: the ``RATIO``s no rank carries) right after
    the later of the fields it is made of.

    Raises ValueError naming the field when a reported field's type is not an int, a float or a string
    (with or without None), or when a derived one is made of fields the model does not report.
    """
    found: list[ReportedField] = []
    for name, info in model.model_fields.items():
        marks = [m for m in info.metadata if isinstance(m, Reported)]
        if marks:
            found.append(marks[0].named(name, _value_type(model, name, info.annotation)))
    for derived in getattr(model, "DERIVED", ()):
        names = [f.name for f in found]
        parts = derived.ratio_of or ()
        if not parts or any(part not in names for part in parts):
            raise ValueError(f"{model.__name__}.{derived.name}: derived from fields it does not report")
        found.insert(max(names.index(part) for part in parts) + 1, derived)
    return tuple(found)


def _value_type(model: type[BaseModel], name: str, annotation: Any) -> ValueType:
    """The int, float or str a field's annotation holds (under ``Annotated`` and ``| None``)."""
    bare = annotation
    while True:
        if get_origin(bare) is Annotated:
            bare = get_args(bare)[0]
        elif get_origin(bare) in (Union, types.UnionType):
            options = [a for a in get_args(bare) if a is not type(None)]
            if len(options) != 1:
                break
            bare = options[0]
        else:
            break
    if bare in (int, float, str):
        return bare  # type: ignore[no-any-return]
    raise ValueError(
        f"{model.__name__}.{name}: a reported field is an int, a float or a str, not {annotation}"
    )

"""The registry of reported fields (``trainer_sidecar.contract.fields``): read off ``WorkerStatus``, its
folds, its status updates, every reported field read strictly and boundedly, and that a field added in
two product places (declared on the status model with its ``Reported``; written by the guardian) reaches
the gang view, the operator's status, the CRD, the metrics and the run summary."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, ClassVar

import jsonschema  # type: ignore[import-untyped]
import pytest
from pydantic import BaseModel
from trainguard_operator.metrics import OperatorMetrics
from trainguard_operator.reconcile import PlanAction, World, reconcile
from trainguard_operator.render import (
    ATTEMPT_LABEL,
    JOB_LABEL,
    RANK_LAYOUT_LABEL,
    RANKS_BY_WORKER_INDEX,
    REPLICA_INDEX_LABEL,
    REPLICA_TYPE_LABEL,
    pytorchjob_name,
)
from trainguard_operator.settings import OperatorSettings
from trainguard_operator.status import JobStatus

from tests.support.manifests import gtj_manifest
from trainer_sidecar.contract import fields
from trainer_sidecar.contract.fields import REPORTED, Fold, Keep, PrinterColumn, Reported, ReportedField
from trainer_sidecar.contract.reported import WorkerCounter, reported_fields
from trainer_sidecar.contract.status import MAX_STATUS_BYTES, Count, WorkerStatus, parse_status
from trainer_sidecar.sidecar.server import counter_fields, fold_counters
from trainguard.core import crd
from trainguard.core.observation import SidecarReport, observe_gang
from trainguard.core.summary import RunRecord

T0 = datetime(2030, 1, 1, tzinfo=UTC)


class NewerStatus(WorkerStatus):
    """``WorkerStatus`` with one field more, as a contributor adds it: product place 1 of 2 is this
    declaration, on ``WorkerStatus`` itself in ``contract/status.py`` (its type and bounds, how it folds,
    where it surfaces); place 2 is the guardian writing it into the status it publishes (here: the
    statuses ``worker`` makes). Nothing else of the product changes."""

    retried_batches: Annotated[
        Count,
        Reported(
            Fold.MAX,
            "Batches the loader fetched again after an error, at the worst rank.",
            status="retried_batches",
            metric="trainguard_job_retried_batches",
            summary="retried_batches",
            column=PrinterColumn("Retried", "Batches fetched again.", after="Rollbacks"),
            counter=WorkerCounter("trainguard_worker_retried_batches_total", "Batches fetched again."),
        ),
    ] = 0


def worker(rank: int, **values: Any) -> NewerStatus:
    """A running rank of a two-rank gang that has stepped (the newer model: it reads as a WorkerStatus)."""
    fields_ = {"phase": "running", "step": 100, "started_at": 1.0, "last_step_time": 2.0, **values}
    return NewerStatus.model_validate({"rank": rank, "world_size": 2, **fields_})


# ------------------------------------------------------------------------------- the registry ---
def test_the_registry_is_read_off_the_status_model_in_its_order() -> None:
    assert reported_fields(WorkerStatus) == fields.REPORTED
    declared = WorkerStatus.model_fields.items()
    marked = [name for name, info in declared if any(isinstance(m, Reported) for m in info.metadata)]
    assert [f.name for f in REPORTED if f.reported_by_ranks] == marked
    # A derived field comes right after the later of its parts.
    names = [f.name for f in REPORTED]
    assert names.index("drop_rate") == names.index("samples_dropped") + 1
    assert fields.reported_field("drop_rate").type is float
    assert fields.reported_field("checkpoint_cadence").type is str
    assert fields.reported_field("max_steps").type is int  # Count | None: an int


def test_a_reported_field_that_is_no_number_or_word_is_refused() -> None:
    class Listing(BaseModel):
        ranks: Annotated[list[int], Reported(Fold.MAX, "Ranks.")] = []

    with pytest.raises(ValueError, match=r"Listing\.ranks: a reported field is an int, a float or a str"):
        reported_fields(Listing)

    class Derived(BaseModel):
        seen: Annotated[int, Reported(Fold.SUM, "Seen.")] = 0
        DERIVED: ClassVar[tuple[ReportedField, ...]] = (
            Reported(Fold.RATIO, "Lost over seen.", ratio_of=("lost", "seen")).named("loss_rate", float),
        )

    with pytest.raises(ValueError, match=r"Derived\.loss_rate: derived from fields it does not report"):
        reported_fields(Derived)


def document(**values: Any) -> dict[str, Any]:
    """A valid status document, as JSON decodes it, with ``values`` over it."""
    return {**worker(0).to_document(), **values}


def hostile(spec: ReportedField) -> list[Any]:
    """Values a reader must refuse for ``spec``: of another type, and beyond any bound (a number past
    the largest exact count or not finite; a string as long as the file allows)."""
    if spec.type is str:
        return [7, ["x"], {"x": 1}, "x" * (MAX_STATUS_BYTES // 2)]
    if spec.type is int:
        return [True, "7", 7.0, [7], 2**53 + 1, 2**64, -1]
    return [True, "7", [7.0], float("inf"), float("nan")]


@pytest.mark.parametrize("spec", [f for f in REPORTED if f.reported_by_ranks], ids=lambda f: f.name)
def test_every_reported_field_is_read_strictly_and_boundedly(spec: ReportedField) -> None:
    for value in hostile(spec):
        text = json.dumps(document(**{spec.name: value}), allow_nan=True)
        assert len(text.encode()) <= MAX_STATUS_BYTES  # refused by the field, not by the file's cap
        status, reason = parse_status(text, "status file s.json")
        assert status is None, (spec.name, value)
        assert reason.startswith("status file s.json is not a valid worker status"), reason
        assert f"({spec.name}:" in reason, reason


def test_the_registry_names_fields_the_models_have_once_each() -> None:
    names = [f.name for f in REPORTED]
    assert len(names) == len(set(names))
    metrics = [f.metric for f in REPORTED if f.metric]
    assert len(metrics) == len(set(metrics))
    for spec in REPORTED:
        if spec.reported_by_ranks:
            assert spec.name in WorkerStatus.model_fields, spec.name
        if spec.status is not None:
            assert spec.status in JobStatus.model_fields, spec.status
        if spec.ratio_of is not None:
            assert all(names.index(part) < names.index(spec.name) for part in spec.ratio_of)
        if spec.written_with is not None:
            assert spec.written_with in names


def test_a_field_with_a_surface_but_no_status_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a status field"):
        Reported(Fold.MAX, "Spikes.", metric="trainguard_job_spikes")
    with pytest.raises(ValueError, match="spike_rate: ratio_of"):
        ReportedField(Fold.RATIO, "Spikes per step.", name="spike_rate", type=float)
    counter = WorkerCounter("trainguard_worker_cadence_total", "Cadences.")
    with pytest.raises(ValueError, match="a sidecar counter is of a SUM or a MAX"):
        Reported(Fold.LEAD, "Cadence.", counter=counter)
    with pytest.raises(ValueError, match="cadence: a sidecar counter counts an int"):
        Reported(Fold.MAX, "Cadence.", counter=counter).named("cadence", str)


def test_each_fold_takes_the_ranks_values_as_its_rule_says() -> None:
    ranks = {
        0: fields.rank_values(worker(0, step=90, rollbacks=1, samples_seen=10, checkpoint_cadence="")),
        1: fields.rank_values(
            worker(1, step=95, rollbacks=2, samples_seen=30, samples_dropped=3, checkpoint_every_steps=50)
        ),
    }
    folded = fields.fold_ranks(ranks)
    assert folded["step"] == 90  # the slowest
    assert folded["rollbacks"] == 2  # the largest
    assert (folded["samples_seen"], folded["samples_dropped"]) == (40, 3)  # summed
    assert folded["drop_rate"] == pytest.approx(3 / 40)
    assert folded["checkpoint_every_steps"] is None  # rank 0's own, and rank 0 said none
    assert folded["checkpoint_cadence"] is None  # "" reads as unknown
    assert folded["checkpoint_seconds"] is None  # no rank measured one
    # A rank that stepped without counting a sample makes the sums unknown, not 0.
    uncounted = fields.fold_ranks({**ranks, 1: fields.rank_values(worker(1, step=95))})
    assert (uncounted["samples_seen"], uncounted["drop_rate"]) == (None, None)
    assert fields.fold_ranks({})["step"] is None


def test_the_status_takes_known_values_keeps_the_highest_and_writes_fields_together() -> None:
    folded: dict[str, fields.Value] = {
        "step": 7,
        "checkpoint_seconds": 1.23456,
        "checkpoint_cadence": "auto",
        "max_steps": None,
    }
    updates = fields.status_updates(folded, {"checkpoint_seconds": 2.0})
    assert updates["step"] == 7
    assert updates["checkpoint_seconds"] == 2.0  # the highest seen stays
    assert updates["checkpoint_cadence"] == "auto"
    assert "checkpoint_every_steps" in updates  # written with the cadence, even unset
    assert updates["checkpoint_every_steps"] is None
    assert "max_steps" not in updates  # unknown: left as it was
    assert fields.status_updates({"checkpoint_seconds": 3.00049}, {})["checkpoint_seconds"] == 3.0
    assert fields.reported_field("checkpoint_seconds").keep is Keep.HIGHEST


def test_the_summary_figures_follow_the_registry_in_order() -> None:
    assert list(fields.summary_values(None)) == [
        "rollbacks",
        "skipped_steps",
        "samples_seen",
        "samples_dropped",
        "drop_rate",
    ]
    assert set(fields.summary_values(None).values()) == {None}


# --------------------------------------------------------------------------- adding a field ---
def pod(attempt: int, rank: int) -> dict[str, Any]:
    """A running pod of ``attempt`` as the training operator labels it."""
    return {
        "metadata": {
            "name": f"{pytorchjob_name('tiny-lm', attempt)}-worker-{rank}",
            "namespace": "research",
            "labels": {
                JOB_LABEL: "tiny-lm",
                ATTEMPT_LABEL: str(attempt),
                REPLICA_TYPE_LABEL: "worker",
                REPLICA_INDEX_LABEL: str(rank),
                RANK_LAYOUT_LABEL: RANKS_BY_WORKER_INDEX,
            },
        },
        "status": {
            "phase": "Running",
            "podIP": f"10.0.0.{rank + 1}",
            "containerStatuses": [
                {
                    "name": "pytorch",
                    "restartCount": 0,
                    "state": {"running": {"startedAt": "2030-01-01T00:00:00Z"}},
                }
            ],
        },
    }


class OneJob:
    """The API server's state of one GuardedTrainingJob, its PyTorchJob and its pods: each step is a
    fresh reconcile of what is stored, and its status patch is written back."""

    def __init__(self) -> None:
        self.body = copy.deepcopy(gtj_manifest())
        self.body["metadata"] |= {"uid": "6f1c2d3e-0000-4000-8000-000000000002", "generation": 1}
        self.jobs: list[dict[str, Any]] = []
        self.pods: list[dict[str, Any]] = []

    def step(self, now: datetime, sidecars: dict[str, SidecarReport] | None = None) -> PlanAction:
        world = World(
            copy.deepcopy(self.body), copy.deepcopy(self.jobs), copy.deepcopy(self.pods), sidecars or {}, now
        )
        plan = reconcile(world, OperatorSettings(stale_attempt_grace_seconds=60, crd_retry_seconds=60))
        status = {**(self.body.get("status") or {}), **plan.patch}
        self.body["status"] = {k: v for k, v in status.items() if v is not None}
        if plan.create is not None:
            self.jobs.append(copy.deepcopy(plan.create))
        return plan.action


def reports(*values: int) -> dict[str, SidecarReport]:
    """Both ranks' sidecars, each rank reporting its own count of retried batches."""
    return {
        f"tiny-lm-1-worker-{rank}": SidecarReport(
            reachable=True, alive=True, reason="running", status=worker(rank, retried_batches=count)
        )
        for rank, count in enumerate(values)
    }


@pytest.fixture
def newer_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry read off ``NewerStatus``, as ``fields.REPORTED`` is read off ``WorkerStatus`` once the
    field is declared there: the only thing the test stands in for."""
    monkeypatch.setattr(fields, "REPORTED", reported_fields(NewerStatus))


def test_an_added_field_is_in_the_registry_and_on_the_wire_old_and_new_read_each_other(
    newer_model: None,
) -> None:
    added = fields.reported_field("retried_batches")
    assert (added.type, added.fold, added.status) == (int, Fold.MAX, "retried_batches")
    assert [f.name for f in fields.REPORTED][: len(REPORTED)] == [f.name for f in REPORTED]
    # The guardian's file carries it; a reader of today ignores it, and a newer reader of an older
    # file sees the default (0).
    written = json.dumps(worker(1, retried_batches=3).to_document())
    assert json.loads(written)["retried_batches"] == 3
    old, reason = parse_status(written)
    assert reason == ""
    assert old is not None
    assert "retried_batches" not in old.model_dump()
    assert NewerStatus.model_validate_json(old.model_dump_json()).retried_batches == 0
    # Bounded and strict like every reported field.
    for value in hostile(added):
        with pytest.raises(ValueError, match="retried_batches"):
            NewerStatus.model_validate_json(json.dumps(document(retried_batches=value)))
    # The gang view folds it (the largest of the ranks').
    view = observe_gang({0: worker(0, retried_batches=2), 1: worker(1, retried_batches=5)}, 2)
    assert view.reported["retried_batches"] == 5
    # The sidecar counts it, monotonic across a resume that lowers it.
    assert "retried_batches" in counter_fields()
    seen, totals = dict.fromkeys(counter_fields(), 0), dict.fromkeys(counter_fields(), 0.0)
    for count in (4, 1, 3):
        seen, totals = fold_counters(seen, totals, worker(0, retried_batches=count))
    assert totals["retried_batches"] == 6


def test_an_added_field_reaches_the_status_the_crd_the_metrics_and_the_summary(newer_model: None) -> None:
    # The operator's status takes it, under its camelCase name, and reads it back after a restart.
    job = OneJob()
    assert job.step(T0) is PlanAction.CREATE
    job.pods = [pod(1, 0), pod(1, 1)]
    job.step(T0 + timedelta(seconds=5))
    job.step(T0 + timedelta(seconds=10), reports(2, 5))
    assert job.body["status"]["retriedBatches"] == 5
    assert job.body["status"]["step"] == 100
    status = JobStatus.from_body(job.body)
    assert status.reported_value("retried_batches") == 5
    job.step(T0 + timedelta(seconds=20), reports(0, 1))  # the newest value replaces the old one
    assert JobStatus.from_body(job.body).reported_value("retried_batches") == 1

    # The CRD lists it in the status schema (which accepts the status written) and as a column.
    document = crd.build_crd()
    version = document["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert schema["properties"]["retriedBatches"]["type"] == "integer"
    assert list(jsonschema.Draft7Validator(schema).iter_errors(job.body["status"])) == []
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[columns.index("Rollbacks") + 1] == "Retried"
    assert {"name": "Retried", "type": "integer", "jsonPath": ".status.retriedBatches"}.items() <= next(
        c for c in version["additionalPrinterColumns"] if c["name"] == "Retried"
    ).items()

    # The metrics have its gauge, set from the status, and drop it with the job.
    metrics = OperatorMetrics()
    metrics.observe_status("tiny-lm", "research", JobStatus.from_body(job.body))
    labels = {"job": "tiny-lm", "namespace": "research"}
    assert metrics.registry.get_sample_value("trainguard_job_retried_batches", labels) == 1
    assert metrics.registry.get_sample_value("trainguard_job_step", labels) == 100
    metrics.forget("tiny-lm", "research")
    assert metrics.registry.get_sample_value("trainguard_job_retried_batches", labels) is None

    # The run summary has its figure, after the registry's others.
    view = observe_gang({0: worker(0, retried_batches=2), 1: worker(1, retried_batches=5)}, 2)
    record = RunRecord(started=0.0)
    record.see(1, 0.0, view, now=10.0)
    figures = record.figures(wall_seconds=10.0, backoff_seconds=0.0)
    assert figures.as_dict()["retried_batches"] == 5
    keys = list(figures.as_dict())
    assert keys.index("retried_batches") == keys.index("drop_rate") + 1


def test_without_the_added_field_nothing_of_it_surfaces() -> None:
    view = observe_gang({0: worker(0, retried_batches=2)}, 2)
    assert "retried_batches" not in view.reported
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert "retriedBatches" not in schema["properties"]
    assert OperatorMetrics().registry.get_sample_value("trainguard_job_retried_batches", {}) is None

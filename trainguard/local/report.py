"""Draws a run's timeline as a PNG: loss and grad norm over steps, with every incident marked."""

from __future__ import annotations

import io
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer_sidecar.contract.settings import describe_validation_error

_MARKS = {
    "skip": ("tab:orange", ":", "skipped step"),
    "rollback": ("tab:purple", "--", "rollback"),
    "failure": ("tab:red", "-", "gang failure"),
    "checkpoint": ("tab:cyan", ":", "clean checkpoint"),
    "recovered": ("tab:green", "-.", "recovered"),
}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SeriesPoint(_Lenient):
    """One sample of the gang's progress."""

    t: float
    attempt: int
    step: int
    loss: float | None = None
    grad_norm: float | None = None


class TimelineEntry(_Lenient):
    """One incident or milestone on the timeline."""

    t: float
    kind: str = ""
    step: int | None = None


class JobName(_Lenient):
    """Which job the summary is of."""

    name: str = ""
    namespace: str = ""


class SummaryView(_Lenient):
    """The part of ``trainguard run``'s summary that the report draws (other keys are ignored); null
    is a figure that was not known, drawn as "?"."""

    job: JobName = JobName()
    result: str = "?"
    final_step: int | None = None
    restarts: list[Any] = Field(default_factory=list)
    rollbacks: int | None = None
    goodput: float | None = None
    series: list[SeriesPoint] = Field(default_factory=list)
    timeline: list[TimelineEntry] = Field(default_factory=list)


def load_summary(data: bytes, source: str) -> SummaryView:
    """Parse a summary file's bytes; ValueError naming ``source`` and each bad field otherwise."""
    try:
        return SummaryView.model_validate_json(data)
    except ValidationError as exc:
        raise ValueError(describe_validation_error(exc, source)) from exc


def render_png(summary: SummaryView) -> bytes:
    """The timeline of ``summary`` (as written by ``trainguard run``) drawn as a PNG."""
    figure, (loss_axis, norm_axis) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    by_attempt: dict[int, list[SeriesPoint]] = {}
    for point in summary.series:
        by_attempt.setdefault(point.attempt, []).append(point)
    for attempt, points in sorted(by_attempt.items()):
        losses = [(p.step, p.loss) for p in points if p.loss is not None]
        loss_axis.plot([s for s, _ in losses], [v for _, v in losses], label=f"attempt {attempt}")
        norms = [(p.step, p.grad_norm) for p in points if p.grad_norm is not None]
        norm_axis.plot([s for s, _ in norms], [n for _, n in norms], label=f"attempt {attempt}")
    labelled: set[str] = set()
    for entry in summary.timeline:
        mark = _MARKS.get(entry.kind)
        step = entry.step if entry.step is not None else _step_at(summary.series, entry.t)
        if mark is None or step is None:
            continue
        color, style, label = mark
        for axis in (loss_axis, norm_axis):
            axis.axvline(
                step, color=color, linestyle=style, alpha=0.7, label=label if label not in labelled else None
            )
            labelled.add(label)
    loss_axis.set_ylabel("loss")
    norm_axis.set_ylabel("grad norm (before clipping)")
    norm_axis.set_yscale("log")
    norm_axis.set_xlabel("step")
    final = summary.final_step if summary.final_step is not None else "?"
    rollbacks = summary.rollbacks if summary.rollbacks is not None else "?"
    kept = f"{summary.goodput:.1%}" if summary.goodput is not None else "?"
    loss_axis.set_title(
        f"{summary.job.namespace}/{summary.job.name}: {summary.result} at step {final}, "
        f"{len(summary.restarts)} restart(s), {rollbacks} rollback(s), goodput {kept}"
    )
    if labelled or by_attempt:
        loss_axis.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=100)
    plt.close(figure)
    return image.getvalue()


def _step_at(series: list[SeriesPoint], t: float) -> int | None:
    before = [p for p in series if p.t <= t]
    return before[-1].step if before else None

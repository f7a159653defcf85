"""Draws a run's timeline as a PNG: loss and grad norm over steps, with every incident marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

_MARKS = {
    "skip": ("tab:orange", ":", "skipped step"),
    "rollback": ("tab:purple", "--", "rollback"),
    "failure": ("tab:red", "-", "gang failure"),
    "checkpoint": ("tab:cyan", ":", "clean checkpoint"),
    "recovered": ("tab:green", "-.", "recovered"),
}


def plot(summary: dict[str, Any], output: Path) -> None:
    """Write the timeline of ``summary`` (as written by ``trainguard run --summary``) to ``output``."""
    series = summary.get("series", [])
    figure, (loss_axis, norm_axis) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for point in series:
        by_attempt.setdefault(int(point["attempt"]), []).append(point)
    for attempt, points in sorted(by_attempt.items()):
        steps = [p["step"] for p in points if p.get("loss") is not None]
        loss_axis.plot(
            steps, [p["loss"] for p in points if p.get("loss") is not None], label=f"attempt {attempt}"
        )
        norms = [(p["step"], p["grad_norm"]) for p in points if p.get("grad_norm") is not None]
        norm_axis.plot([s for s, _ in norms], [n for _, n in norms], label=f"attempt {attempt}")
    labelled: set[str] = set()
    for entry in summary.get("timeline", []):
        mark = _MARKS.get(entry.get("kind", ""))
        step = entry.get("step")
        if mark is None:
            continue
        if step is None:
            step = _step_at(series, entry["t"])
        if step is None:
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
    job = summary.get("job", {})
    loss_axis.set_title(
        f"{job.get('namespace', '')}/{job.get('name', '')}: {summary.get('result', '?')} at step "
        f"{summary.get('final_step', '?')}, {len(summary.get('restarts', []))} restart(s), "
        f"{summary.get('rollbacks', 0)} rollback(s), goodput {summary.get('goodput', 0):.1%}"
    )
    loss_axis.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=100)
    plt.close(figure)


def _step_at(series: list[dict[str, Any]], t: float) -> int | None:
    before = [p for p in series if p["t"] <= t]
    return int(before[-1]["step"]) if before else None

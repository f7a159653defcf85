"""Straggler detection with real ranks: two gloo workers, one made slower by the ``slow`` fault."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.local_jobs import job, run
from tests.support.procs import run_gang, successful_reports
from trainer_sidecar.contract.status import parse_status
from trainguard.core.observation import observe_gang

pytestmark = pytest.mark.slow

SLOW_FROM = 20
STEPS = 50
SETTINGS = {"checkpoint": {"everySteps": 1000, "everySeconds": None}, "computeWindowSteps": 8}


def _statuses(folder: Path, rank: int) -> list[Any]:
    documents = json.loads((folder / f"rank{rank}.json").read_text())
    parsed = [parse_status(d) for d in documents]
    assert all(p.status is not None for p in parsed), [p.reason for p in parsed if p.status is None]
    return [p.status for p in parsed]


def test_a_rank_made_twice_slower_is_flagged_within_20_steps_and_its_peer_never(tmp_path: Path) -> None:
    """Each rank's own compute is read from its statuses after every step; the gang view of both ranks at
    the same step names rank 1 within 20 steps of its slowdown, and never rank 0 (which spends the
    difference waiting in the step's collective) nor anyone before the slowdown."""
    folder = tmp_path / "statuses"
    folder.mkdir()
    args = ["--steps", str(STEPS), "--step-sleep", "0.02", "--statuses", str(folder)]
    successful_reports(
        run_gang(tmp_path / "ckpt", 2, args, faults=f"slow*2@{SLOW_FROM}:1", settings=SETTINGS)
    )
    ranks = [_statuses(folder, 0), _statuses(folder, 1)]
    assert [len(r) for r in ranks] == [STEPS, STEPS]
    flagged: dict[int, list[int]] = {0: [], 1: []}
    for first, second in zip(*ranks, strict=True):
        assert first.step == second.step
        found = observe_gang({0: first, 1: second}, 2).straggler(1.5)
        if found is not None:
            flagged[found.rank].append(first.step)
    assert flagged[0] == [], flagged
    assert flagged[1], "rank 1 was never flagged"
    assert SLOW_FROM < flagged[1][0] <= SLOW_FROM + 20, flagged[1]
    # Once flagged it stays flagged: the window's median holds while the rank stays slow.
    assert flagged[1] == list(range(flagged[1][0], STEPS + 1)), flagged[1]
    last = ranks[1][-1]
    assert last.compute_seconds is not None
    assert last.best_compute_seconds is not None
    assert last.compute_seconds / last.best_compute_seconds > 1.5


def test_trainguard_run_reports_the_straggler_and_restarts_the_gang_under_action_restart(
    tmp_path: Path,
) -> None:
    """Under ``trainguard run`` the same gang view names rank 1 in the timeline, and ``action: restart``
    restarts the gang once (one machine: the slow rank stays slow), then, restarts exhausted, reports."""
    job_file = job(
        tmp_path,
        steps=60,
        faults="slow*3@10:1",
        step_sleep=0.03,
        hang_timeout=30,
        health={"straggler": {"action": "restart", "windowSteps": 6}},
        recovery={"maxRestarts": 1, "backoffSeconds": [1]},
    )
    code, summary, output = run(tmp_path, job_file)
    assert code == 0, output
    assert summary["result"] == "succeeded", summary["reason"]
    stragglers = [e for e in summary["timeline"] if e["kind"] == "straggler"]
    assert any("rank 1 is a straggler" in e["message"] for e in stragglers), stragglers
    assert not any("rank 0 is a straggler" in e["message"] for e in stragglers), stragglers
    assert len(summary["restarts"]) == 1, summary["restarts"]
    assert "rank 1 is a straggler" in summary["restarts"][0]["reason"], summary["restarts"][0]
    assert summary["final_step"] == 60

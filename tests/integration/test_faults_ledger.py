"""Per-rank fault ledgers written by real processes at once: no rank clobbers another's, and a restarted
job fires nothing again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO_ROOT


def ledger(directory: Path, rank: int) -> list[str]:
    keys: list[str] = json.loads((directory / f"faults-fired-rank{rank}.json").read_text())
    return keys


# Each rank is a real process: all fire their faults at the same time into one ledger directory,
# then "restart" (a new process) and must fire nothing.
_RANK_PROCESS = r"""
import json
import sys
from pathlib import Path

from trainer_sidecar.guardian.faults import FaultInjector, FaultKind, parse_faults

rank, ledger_dir, steps = int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
injector = FaultInjector(parse_faults(f"nan_loss@0x{steps},hang@0x{steps}:{rank}"), rank, ledger_dir)
fired = []
for step in range(steps):
    for kind in (FaultKind.NAN_LOSS, FaultKind.HANG):
        if injector.fires(kind, step):
            fired.append(f"{kind.value}@{step}")
print(json.dumps(fired))
"""


def _run_ranks(script: Path, ledger_dir: Path, ranks: int, steps: int) -> list[list[str]]:
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(ledger_dir), str(steps)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO_ROOT,
            text=True,
        )
        for rank in range(ranks)
    ]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        results.append(json.loads(out))
    return results


def test_per_rank_ledgers_do_not_clobber_each_other_across_processes(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_RANK_PROCESS)
    ledger_dir = tmp_path / "ckpt"
    ledger_dir.mkdir()
    ranks, steps = 4, 40

    first = _run_ranks(script, ledger_dir, ranks, steps)
    everything = [f"{kind}@{step}" for step in range(steps) for kind in ("nan_loss", "hang")]
    assert first == [everything] * ranks
    for rank in range(ranks):
        assert ledger(ledger_dir, rank) == [f"hang@0x{steps}:{rank}", f"nan_loss@0x{steps}:*"]
    assert sorted(p.name for p in ledger_dir.iterdir()) == [
        f"faults-fired-rank{r}.json" for r in range(ranks)
    ]

    again = _run_ranks(script, ledger_dir, ranks, steps)
    assert again == [[]] * ranks

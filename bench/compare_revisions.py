"""Run one benchmark of two revisions side by side, alternating, and print their figures in one table.

A refactoring's promise ("within noise of before") is a comparison of two commits on the same machine
at the same time. This checks out ``--base`` (default ``HEAD~1``) into a temporary git worktree with
its own thin virtualenv (``scripts/bootstrap.sh``: the shared dependencies, that revision's code), then
runs the chosen benchmark ``--rounds`` times in each tree, alternating base and head and starting each
round with the other one, so that a load that comes and goes falls on both. Each run's last JSON line is
kept; for every numeric key both trees print (nested ones joined by dots), the medians of base and
head and head/base are printed.

    python -m bench.compare_revisions --base 80f4cb8 --bench guard_overhead -- --repetitions 20
    python -m bench.compare_revisions --base 80f4cb8 --bench recovery_local -- --runs 1

The last line printed is one JSON object: ``{"base": ..., "head": ..., "keys": {key: {"base", "head",
"head_over_base"}}, "runs": {...}}``. The ratio of two same-run ratios (``guarded_over_plain``, say) is
the steadiest figure: each is already normalised against the plain step of its own run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHES = ("guard_overhead", "recovery_local", "checkpoint", "hang_detection")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line: ``--base REV --bench NAME --rounds N -- [the benchmark's own arguments]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--base", default="HEAD~1", help="the revision to compare against (default HEAD~1)")
    parser.add_argument("--bench", choices=BENCHES, default="guard_overhead", help="the benchmark module")
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of each revision, alternating (default 3)"
    )
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: the benchmark's arguments")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.bench_args[:1] == ["--"]:
        args.bench_args = args.bench_args[1:]
    return args


def resolve(revision: str) -> str:
    """The full commit hash of ``revision``; ``SystemExit`` naming it when git does not know it."""
    out = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"--base: {revision!r} is not a commit of {REPO}")
    return out.stdout.strip()


def last_json(stdout: str, where: str) -> dict[str, object]:
    """The benchmark's last line as a JSON object; ``RuntimeError`` naming the tree when it is not one."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        figures = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        figures = None
    if not isinstance(figures, dict):
        raise RuntimeError(f"the benchmark in {where} did not end with a JSON object; its output:\n{stdout}")
    return figures


def run_bench(tree: Path, bench: str, bench_args: Sequence[str]) -> dict[str, object]:
    """Run ``python -m bench.<bench>`` in ``tree`` with that tree's virtualenv; its last JSON line."""
    command = [str(tree / ".venv" / "bin" / "python"), "-m", f"bench.{bench}", *bench_args]
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} in {tree} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return last_json(done.stdout, str(tree))


def flatten(figures: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    """Nested objects' keys joined by dots (``median.crash.warm.recover_s``), except a benchmark's raw
    ``runs``, whose lists are not figures."""
    flat: dict[str, object] = {}
    for key, value in figures.items():
        if key == "runs" and not prefix:
            continue
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def numeric_keys(runs: Sequence[Mapping[str, object]]) -> dict[str, list[float]]:
    """Every key (nested ones joined by dots) whose value is a number (not a bool) in every run, with
    its values."""
    flat = [flatten(run) for run in runs]
    keys: dict[str, list[float]] = {}
    for key in flat[0]:
        values = [run.get(key) for run in flat]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            keys[key] = [float(v) for v in values]  # type: ignore[arg-type]
    return keys


def compare(
    base_runs: Sequence[Mapping[str, object]], head_runs: Sequence[Mapping[str, object]]
) -> dict[str, dict[str, float | None]]:
    """Per key both sides report: the medians and head/base (``None`` when base's median is 0)."""
    base, head = numeric_keys(base_runs), numeric_keys(head_runs)
    table: dict[str, dict[str, float | None]] = {}
    for key in base.keys() & head.keys():
        b, h = statistics.median(base[key]), statistics.median(head[key])
        table[key] = {"base": b, "head": h, "head_over_base": round(h / b, 4) if b else None}
    return dict(sorted(table.items()))


def checkout(commit: str, where: Path) -> Path:
    """A detached worktree of ``commit`` under ``where``, bootstrapped; its path."""
    tree = where / "base"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(tree), commit], check=True
    )
    subprocess.run(["bash", str(tree / "scripts" / "bootstrap.sh")], check=True, capture_output=True)
    return tree


def main(argv: Sequence[str] | None = None) -> None:
    """Alternate the two revisions' runs, print the table and the JSON line."""
    args = parse_args(argv)
    commit = resolve(args.base)
    with tempfile.TemporaryDirectory(prefix="trainguard-compare-") as scratch:
        tree = checkout(commit, Path(scratch))
        try:
            runs: dict[str, list[dict[str, object]]] = {"base": [], "head": []}
            for round_index in range(args.rounds):
                order = [("base", tree), ("head", REPO)]
                for side, where in order if round_index % 2 == 0 else order[::-1]:
                    print(f"round {round_index + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
                    runs[side].append(run_bench(where, args.bench, args.bench_args))
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    table = compare(runs["base"], runs["head"])
    print(f"bench.{args.bench}: base {commit[:10]} against head, {args.rounds} alternating rounds (medians)")
    for key, row in table.items():
        ratio = "-" if row["head_over_base"] is None else f"x{row['head_over_base']:.4f}"
        print(f"  {key:56s} base {row['base']:<14.6g} head {row['head']:<14.6g} head/base {ratio}")
    print(json.dumps({"base": commit, "head": "working tree", "keys": table, "runs": runs}))


if __name__ == "__main__":
    main()

"""The ``trainguard`` command: ``run`` a GuardedTrainingJob locally, ``report`` a run's summary as a PNG."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard.spec import GuardedTrainingJob, SpecError, load_job

if TYPE_CHECKING:
    from trainguard.launch import StopSignals
    from trainguard.local import LocalRunner


def _run(args: argparse.Namespace) -> int:
    from trainguard.launch import RunRefused, Stopped, StopSignals

    try:
        job = load_job(args.job)
    except SpecError as exc:
        print(f"trainguard: invalid job: {exc}", file=sys.stderr)
        return 2
    # namespace and name are DNS-1123 labels (the spec checks), so this is one plain folder name.
    run_root = args.run_dir or Path("runs") / f"{job.metadata.namespace}-{job.metadata.name}"
    checkpoint_root = args.checkpoint_root or run_root / "volumes"
    with StopSignals() as signals:
        try:
            code, runner = _run_job(job, args, run_root, checkpoint_root, signals)
        except (SpecError, RunRefused) as exc:
            print(f"trainguard: cannot run {args.job}: {exc}", file=sys.stderr)
            return 2
        except Stopped as stop:  # before the run began: nothing was started
            return stop.exit_code
        signals.disarm()  # the gang is stopped; a late signal must not cost the summary
        return _report_run(args, runner, code)


def _run_job(
    job: GuardedTrainingJob,
    args: argparse.Namespace,
    run_root: Path,
    checkpoint_root: Path,
    signals: StopSignals,
) -> tuple[int, LocalRunner]:
    from trainguard.local import LocalRunner
    from trainguard.view import LiveView, PlainView

    interactive = sys.stdout.isatty() and not args.plain
    view = LiveView() if interactive else PlainView()
    try:
        runner = LocalRunner(
            job, checkpoint_root=checkpoint_root, run_dir=run_root, view=view, signals=signals
        )
        return runner.run(), runner
    finally:
        view.close()


def _report_run(args: argparse.Namespace, runner: LocalRunner, code: int) -> int:
    if runner.run_folder is None:  # stopped before the run had its folder: nothing ran
        return code
    summary = runner.summary()
    summary_path = args.summary or runner.run_folder / "summary.json"
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(summary, indent=1))
    if args.plot:
        from trainguard.report import plot

        plot(summary, args.plot)
    brief = {
        k: summary[k] for k in ("result", "reason", "final_step", "goodput", "goodput_excluding_backoff")
    }
    print(f"trainguard: {json.dumps(brief)}; summary in {summary_path}", file=sys.stderr)
    if code == 1:
        print(f"trainguard: job failed: {summary['reason']}", file=sys.stderr)
    return code


def _report(args: argparse.Namespace) -> int:
    from trainguard.report import plot

    try:
        summary = json.loads(args.summary.read_text())
    except (OSError, ValueError) as exc:
        print(f"trainguard: {args.summary}: cannot read the summary: {exc}", file=sys.stderr)
        return 2
    plot(summary, args.output)
    print(f"wrote {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``trainguard`` console script."""
    parser = argparse.ArgumentParser(prog="trainguard", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a GuardedTrainingJob YAML on this machine")
    run.add_argument("job", type=Path, help="the GuardedTrainingJob YAML (kubectl apply form)")
    run.add_argument(
        "--checkpoint-root",
        type=Path,
        help="local directory standing in for the claims (default RUN_DIR/volumes)",
    )
    run.add_argument(
        "--run-dir",
        type=Path,
        help="the job's run root (default runs/NS-NAME): each run writes its logs, status files and "
        "summary into a new folder there, with a 'latest' link to it",
    )
    run.add_argument("--summary", type=Path, help="where to write the JSON summary")
    run.add_argument("--plot", type=Path, help="also draw the timeline PNG here")
    run.add_argument("--plain", action="store_true", help="event lines only, even on a terminal")
    run.set_defaults(handler=_run)
    report = commands.add_parser("report", help="draw a summary's timeline as a PNG")
    report.add_argument("summary", type=Path)
    report.add_argument("-o", "--output", type=Path, default=Path("timeline.png"))
    report.set_defaults(handler=_report)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())

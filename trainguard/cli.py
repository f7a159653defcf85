"""The ``trainguard`` command: ``run`` a GuardedTrainingJob locally, ``report`` a run's summary as a PNG,
``checkpoint export-dcp`` / ``import-dcp`` to move a checkpoint to or from torch.distributed.checkpoint,
``simulate`` a job's settings against a failure model at scale."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from trainer_sidecar.contract.files import read_small_file
from trainguard.core.spec import GuardedTrainingJob, SpecError, load_job

MAX_SUMMARY_BYTES = 64 << 20

if TYPE_CHECKING:
    from trainguard.local.launch import StopSignals
    from trainguard.local.runner import LocalRunner


def _run(args: argparse.Namespace) -> int:
    from trainguard.local.launch import RunRefused, Stopped, StopSignals

    try:
        job = load_job(args.job)
    except SpecError as exc:
        print(f"trainguard: invalid job: {exc}", file=sys.stderr)
        return 2
    outputs = [("--summary", args.summary, False), ("--plot", args.plot, True)]
    for problem in (output_problem(flag, path, png=png) for flag, path, png in outputs if path is not None):
        if problem:
            print(f"trainguard: {problem}", file=sys.stderr)
            return 2
    run_root = args.run_dir or default_run_root(job)
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


def default_run_root(job: GuardedTrainingJob) -> Path:
    """``runs/<namespace>/<name>``: one folder per job identity. Both are Kubernetes names (the spec checks),
    so neither holds a ``/`` and two jobs never share it ("a"/"b-c" and "a-b"/"c" shared ``runs/a-b-c``
    when the two were joined by a dash)."""
    return Path("runs") / job.metadata.namespace / job.metadata.name


def _run_job(
    job: GuardedTrainingJob,
    args: argparse.Namespace,
    run_root: Path,
    checkpoint_root: Path,
    signals: StopSignals,
) -> tuple[int, LocalRunner]:
    from trainguard.local.runner import LocalRunner
    from trainguard.local.view import LiveView, PlainView

    interactive = sys.stdout.isatty() and not args.plain
    view = LiveView() if interactive else PlainView()
    try:
        runner = LocalRunner(
            job,
            checkpoint_root=checkpoint_root,
            run_dir=run_root,
            view=view,
            signals=signals,
            warm_spares=not args.no_warm_spares,
        )
        return runner.run(), runner
    finally:
        view.close()


def _report_run(args: argparse.Namespace, runner: LocalRunner, code: int) -> int:
    if runner.run_folder is None:  # stopped before the run had its folder: nothing ran
        return code
    summary = runner.summary().as_dict()
    text = json.dumps(summary, indent=1).encode()
    summary_path = runner.run_folder / "summary.json"
    write_output(summary_path, text)  # always kept in the run folder, whatever else fails
    if args.summary:
        _write_or_say(args.summary, lambda: text, summary_path)
    if args.plot:
        from trainguard.local.report import SummaryView, render_png

        _write_or_say(args.plot, lambda: render_png(SummaryView.model_validate(summary)), summary_path)
    brief = {
        k: summary[k] for k in ("result", "reason", "final_step", "goodput", "goodput_excluding_backoff")
    }
    print(f"trainguard: {json.dumps(brief)}; summary in {args.summary or summary_path}", file=sys.stderr)
    if summary["result"] == "failed":
        print(f"trainguard: job failed: {summary['reason']}", file=sys.stderr)
    return code


def _write_or_say(path: Path, content: Callable[[], bytes], kept: Path) -> None:
    try:
        write_output(path, content())
    except OSError as exc:
        print(f"trainguard: {path} not written ({exc}); the summary is in {kept}", file=sys.stderr)


def write_output(path: Path, data: bytes) -> None:
    """Replace the file ``path`` with ``data`` whole (a temp file beside it, then a rename), or OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.unlink(missing_ok=True)
    try:
        with open(temp, "xb") as handle:
            handle.write(data)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def output_problem(flag: str, path: Path, *, png: bool) -> str | None:
    """Why ``flag``'s file cannot be written, checked before any work is done (None when it can)."""
    if png and path.suffix.lower() != ".png":
        return f"{flag} {path}: the timeline is a PNG; name the file *.png"
    if path.exists() and not path.is_file():
        return f"{flag} {path}: exists and is not a regular file"
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"{flag} {path}: cannot be created ({parent} is not a writable directory)"
    return None


def _report(args: argparse.Namespace) -> int:
    from trainguard.local.report import load_summary, render_png

    problem = output_problem("--output", args.output, png=True)
    if problem:
        print(f"trainguard: {problem}", file=sys.stderr)
        return 2
    try:
        data = read_small_file(args.summary, MAX_SUMMARY_BYTES, str(args.summary))
        summary = load_summary(data, str(args.summary))
    except (OSError, ValueError) as exc:
        print(f"trainguard: cannot read the summary: {exc}", file=sys.stderr)
        return 2
    try:
        write_output(args.output, render_png(summary))
    except OSError as exc:
        print(f"trainguard: --output {args.output}: not written: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    from trainer_sidecar.checkpoint import CheckpointError, CheckpointStore
    from trainer_sidecar.checkpoint.layout import EPOCH_LIMIT
    from trainer_sidecar.guardian.dcp import export_dcp, read_dcp, write_imported

    # A checkpoint's id packs its step with an epoch below EPOCH_LIMIT into one int64 (CheckpointId).
    most = ((1 << 63) - 1) // EPOCH_LIMIT
    if args.step is not None and not 0 <= args.step <= most:
        print(
            f"trainguard: --step {args.step}: must be from 0 to {most:,} (a checkpoint's step)",
            file=sys.stderr,
        )
        return 2
    source = args.checkpoint_dir if args.action == "export-dcp" else args.dcp_dir
    if not source.is_dir():  # a read must not create the folder it reads
        print(f"trainguard: {source}: no such directory", file=sys.stderr)
        return 2
    try:
        if args.action == "export-dcp":
            step = export_dcp(CheckpointStore(args.checkpoint_dir), args.step, args.dcp_dir)
            print(f"exported checkpoint {step} of {args.checkpoint_dir} to {args.dcp_dir}")
        else:  # every refusal before the target folder is created
            step, state = read_dcp(args.dcp_dir, args.step, i_trust_this_pickle=args.i_trust_this_pickle)
            write_imported(CheckpointStore(args.checkpoint_dir), step, state)
            print(f"imported {args.dcp_dir} as checkpoint {step} of {args.checkpoint_dir}")
    except CheckpointError as exc:
        print(f"trainguard: {exc}", file=sys.stderr)
        return 2
    return 0


def _add_checkpoint_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    checkpoint = commands.add_parser("checkpoint", help="move checkpoints to or from DCP")
    actions = checkpoint.add_subparsers(dest="action", required=True)
    export = actions.add_parser("export-dcp", help="write a trainguard checkpoint as a DCP checkpoint")
    export.add_argument("checkpoint_dir", type=Path, help="the job's checkpoint directory")
    export.add_argument("dcp_dir", type=Path, help="the DCP checkpoint folder to write")
    export.add_argument("--step", type=int, help="the checkpoint's step (default: the newest valid)")
    imported = actions.add_parser(
        "import-dcp", help="write a DCP checkpoint as a trainguard checkpoint (DCP metadata is a pickle)"
    )
    imported.add_argument("dcp_dir", type=Path, help="the DCP checkpoint folder to read")
    imported.add_argument("checkpoint_dir", type=Path, help="the job's checkpoint directory to write")
    imported.add_argument(
        "--step", type=int, help="the step the job resumes at (default: the checkpoint's train_state.step)"
    )
    imported.add_argument(
        "--i-trust-this-pickle",
        action="store_true",
        help="required: reading DCP metadata unpickles it, which can run code of whoever wrote it",
    )
    checkpoint.set_defaults(handler=_checkpoint)


def _simulate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from trainguard.core.failure_models import MODELS, REFERENCES
    from trainguard.core.simulate import (
        COST_FLAGS,
        SWEEP_STEPS,
        Costs,
        Scenario,
        ScenarioTooLarge,
        report,
        simulate,
        sweep,
    )
    from trainguard.core.simulate_inputs import InputRefused, check_failure_rate, with_max_restarts

    try:
        job = load_job(args.job)
    except SpecError as exc:
        print(f"trainguard: invalid job: {exc}", file=sys.stderr)
        return 2
    model = MODELS[args.failure_model]
    given = {name for name in COST_FLAGS if getattr(args, name) is not None}
    costs = replace(Costs(), **{name: getattr(args, name) for name in given})
    given |= {name for name in ("gpus", "days") if getattr(args, name) is not None}
    gpus = args.gpus if args.gpus is not None else model.gpus
    days = args.days if args.days is not None else model.seconds / 86_400
    try:
        spec = job.spec if args.max_restarts is None else with_max_restarts(job.spec, args.max_restarts)
        check_failure_rate(model, gpus, days, args.failure_scale)
        scenario = Scenario(spec, model, gpus, days, costs, args.failure_scale, args.seed)
        outcome = simulate(scenario)
    except (InputRefused, ScenarioTooLarge) as exc:
        print(f"trainguard simulate: {exc}", file=sys.stderr)
        return 2
    points = sweep(scenario, SWEEP_STEPS)
    references = [(r.name, r.ratio, r.what) for r in REFERENCES]
    print("\n".join(report(scenario, outcome, points, given, references=references)))
    return 0


def _bounded(flag: str, kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` within ``flag``'s range (``core.simulate_inputs.RANGES``);
    argparse exits 2 naming the flag otherwise."""
    from trainguard.core.simulate_inputs import flag_problem

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'a whole number' if kind is int else 'a number'}"
            ) from None
        problem = flag_problem(flag, value)
        if problem:
            raise argparse.ArgumentTypeError(f"{text!r} {problem}")
        return value

    return parse


def _whole(text: str) -> int:
    """An argparse type: a whole number (its range is the spec field's, checked with the job)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _add_simulate_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from trainguard.core.failure_models import MODELS

    simulate = commands.add_parser(
        "simulate",
        help="goodput and ETTR of a job's settings at scale, against a published failure model",
        description="Play the job's checkpoint cadence and recovery policy against a failure model "
        "(default: Llama 3's 419 interruptions in 54 days on 16,384 GPUs) and print goodput, ETTR, the "
        "inputs and where each came from, and a plot. Deterministic for a --seed. Durations are from "
        "0.001 s to a day; at most 10 years are simulated.",
    )
    simulate.add_argument("job", type=Path, help="the GuardedTrainingJob YAML whose settings are simulated")
    simulate.add_argument(
        "--gpus", type=_bounded("--gpus", int), help="GPUs of the job (default: the model's run)"
    )
    simulate.add_argument(
        "--days", type=_bounded("--days", float), help="days simulated (default: the model's run)"
    )
    simulate.add_argument("--failure-model", choices=sorted(MODELS), default="llama3")
    simulate.add_argument(
        "--failure-scale",
        type=_bounded("--failure-scale", float),
        default=1.0,
        help="multiply the failure rate (what-if; the failures expected must stay playable)",
    )
    costs = {
        "--step-seconds": "one training step (default 10 s)",
        "--save-stall-seconds": "a checkpoint's stall of training (default 5 s)",
        "--restart-seconds": "restart to first step, after the backoff (default 300 s)",
        "--crash-detection-seconds": "until a crash is seen (default 10 s)",
        "--lost-detection-seconds": "until a lost node is seen (default 60 s)",
    }
    for flag, text in costs.items():
        simulate.add_argument(flag, type=_bounded(flag, float), help=text)
    simulate.add_argument(
        "--max-restarts", type=_whole, help="override the job's recovery.maxRestarts (checked as that field)"
    )
    simulate.add_argument(
        "--seed", type=_bounded("--seed", int), default=0, help="the failure draws' seed (default 0)"
    )
    simulate.set_defaults(handler=_simulate)


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
    run.add_argument(
        "--no-warm-spares",
        action="store_true",
        help="start every attempt's workers cold: no spare interpreter with torch imported waits per rank "
        "(each costs ~300-400 MB while the job runs)",
    )
    run.set_defaults(handler=_run)
    report = commands.add_parser("report", help="draw a summary's timeline as a PNG")
    report.add_argument("summary", type=Path)
    report.add_argument("-o", "--output", type=Path, default=Path("timeline.png"))
    report.set_defaults(handler=_report)
    _add_checkpoint_commands(commands)
    _add_simulate_command(commands)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())

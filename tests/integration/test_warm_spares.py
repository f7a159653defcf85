"""Warm spares: a restart of ``trainguard run`` in interpreters that imported torch while the attempt ran.

A spare must be indistinguishable from a cold ``python script.py`` to the script and to the runner (exit
codes, output, environment, working directory, ``__main__``), a crash recovered through spares must
resume bit-identically, and no spare may outlive the run, used or not, even when the runner is killed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import procs
from trainer_sidecar.checkpoint import CheckpointStore
from trainer_sidecar.contract.handoff import Handoff, RunMode, WarmStart, send_handoff

pytestmark = pytest.mark.slow

PROBE = """\
import json, os, sys
print(json.dumps({"file": __file__, "argv": sys.argv, "path0": sys.path[0], "name": __name__,
                  "cwd": os.getcwd(), "marker": os.environ.get("PROBE_MARKER"),
                  "main": sys.modules["__main__"].__dict__ is globals()}), flush=True)
mode = sys.argv[1]

def deep():
    raise ValueError("boom")

if mode == "raise":
    deep()
if mode == "exit3":
    sys.exit(3)
if mode == "message":
    sys.exit("a message for stderr")
"""
MODES = ("ok", "raise", "exit3", "message")


def start_spare(cwd: Path, env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """A spare as the runner starts one (its own output in ``log`` until the handoff)."""
    ours, theirs = socket.socketpair()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer_sidecar.guardian.spare", "--channel", str(theirs.fileno())],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            pass_fds=(theirs.fileno(),),
        )
    theirs.close()
    return proc, ours


def test_a_script_in_a_spare_sees_and_exits_exactly_as_a_cold_interpreter(tmp_path: Path) -> None:
    """Output (the traceback included, without the spare's frames), exit code, __file__, argv,
    sys.path[0], __main__, working directory and environment: all as ``python probe.py MODE``. The
    handoff is sent at once, while the spare is still importing torch (it must wait, not drop it)."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    (work / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    (work / "sub" / "probe.py").write_text(PROBE)
    base = {k: v for k, v in os.environ.items() if k != "PROBE_MARKER"}
    env = {**base, "PROBE_MARKER": "handed over", "PYTHONUNBUFFERED": "1"}
    # Spares start elsewhere and without the marker: what the script sees must come from the handoff.
    spares = {mode: start_spare(elsewhere, base, tmp_path / f"{mode}.spare.log") for mode in MODES}
    plan = WarmStart(RunMode.PATH, "sub/probe.py", ())
    for mode, (_, channel) in spares.items():
        given = Handoff.for_command(plan, environment=env, cwd=work)
        handoff = Handoff(given.environment, given.cwd, given.mode, given.target, (*given.argv, mode))
        with open(tmp_path / f"{mode}.warm.log", "wb") as out:
            send_handoff(channel, handoff, out.fileno(), out.fileno())
        channel.close()
    for mode in MODES:
        with open(tmp_path / f"{mode}.cold.log", "wb") as out:
            command = [sys.executable, "sub/probe.py", mode]
            cold = subprocess.run(command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
        warm_code = spares[mode][0].wait(timeout=120)
        cold_out = (tmp_path / f"{mode}.cold.log").read_text()
        warm_out = (tmp_path / f"{mode}.warm.log").read_text()
        spare_log = (tmp_path / f"{mode}.spare.log").read_text()
        assert (mode, warm_code) == (mode, cold.returncode), warm_out + spare_log
        assert warm_out == cold_out, spare_log
    seen = json.loads((tmp_path / "ok.warm.log").read_text().splitlines()[0])
    assert seen["marker"] == "handed over"
    assert seen["cwd"] == str(work)
    assert seen["main"] is True
    assert [spares[mode][0].returncode for mode in MODES] == [0, 1, 3, 1]
    assert "Traceback" in (tmp_path / "raise.warm.log").read_text()
    assert "trainer_sidecar" not in (tmp_path / "raise.warm.log").read_text()  # none of the spare's frames


HEAP_PROBE = """\
import gc, json
import torch
print(json.dumps({"tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count()}), flush=True)
"""


def test_a_spare_hands_over_with_the_import_graph_out_of_the_collectors_way(tmp_path: Path) -> None:
    """A handed-off run's collections must not walk what torch's imports made (a full collection of it
    is half a second on a recovery's path): a spare freezes it before the handoff, a cold interpreter
    carries it in its generations."""
    (tmp_path / "probe.py").write_text(HEAP_PROBE)
    proc, channel = start_spare(tmp_path, dict(os.environ), tmp_path / "spare.log")
    handoff = Handoff.for_command(
        WarmStart(RunMode.PATH, "probe.py", ()), environment=dict(os.environ), cwd=tmp_path
    )
    with open(tmp_path / "warm.log", "wb") as out:
        send_handoff(channel, handoff, out.fileno(), out.fileno())
    channel.close()
    assert proc.wait(timeout=120) == 0, (tmp_path / "spare.log").read_text()
    cold = subprocess.run(
        [sys.executable, "probe.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert cold.returncode == 0, cold.stderr
    warm_heap = json.loads((tmp_path / "warm.log").read_text().splitlines()[-1])
    cold_heap = json.loads(cold.stdout.splitlines()[-1])
    assert warm_heap["frozen"] > cold_heap["tracked"] / 2, (warm_heap, cold_heap)
    assert warm_heap["tracked"] * 4 < cold_heap["tracked"], (warm_heap, cold_heap)


def test_an_unhandled_exception_in_a_spare_is_a_crash_to_the_guardian_as_when_cold(tmp_path: Path) -> None:
    """The guardian's exit hook reads ``sys.last_value`` to tell a crash from an end: a loop that raises
    after training is never reported finished and gets no final checkpoint, warm as cold."""
    args = [str(procs.WORKER), "--steps", "10", "--loop", "own", "--raise-after-loop"]
    settings = {"checkpoint": {"everySteps": 4, "snapshotEverySteps": 4}, "statusIntervalSeconds": 0}
    outcomes = {}
    for how in ("cold", "warm"):
        ckpt, status_file = tmp_path / how / "ckpt", tmp_path / how / "status.json"
        status_file.parent.mkdir(parents=True)
        env = procs.worker_env(ckpt, settings=settings, status_file=status_file)
        log = tmp_path / how / "log"
        if how == "cold":
            with open(log, "wb") as out:
                code = subprocess.run([sys.executable, *args], env=env, stdout=out, stderr=subprocess.STDOUT)
            exit_code = code.returncode
        else:
            proc, channel = start_spare(tmp_path, env, tmp_path / how / "spare.log")
            plan = WarmStart(RunMode.PATH, args[0], tuple(args[1:]))
            with open(log, "wb") as out:
                send_handoff(
                    channel,
                    Handoff.for_command(plan, environment=env, cwd=tmp_path),
                    out.fileno(),
                    out.fileno(),
                )
            channel.close()
            exit_code = proc.wait(timeout=120)
        status = json.loads(status_file.read_text())
        newest = CheckpointStore(ckpt).newest_valid()
        outcomes[how] = (exit_code, status["phase"], newest, "the loop's epilogue failed" in log.read_text())
    assert outcomes["cold"] == (1, outcomes["cold"][1], 8, True)
    assert outcomes["cold"][1] != "finished"
    assert outcomes["warm"] == outcomes["cold"]


# A module (run as ``-m pkg.probe`` and as the script ``pkg/probe.py``) that says what a cold interpreter
# sets up for its __main__, writes to both streams, and ends as its first argument says; its exit hook
# pickles a class of __main__ and says what it finds then.
MAIN_PROBE = """\
import atexit, json, os, pickle, signal, sys, time

class Thing:
    pass

def frames(tb):
    found = []
    while tb is not None:
        found.append([os.path.basename(tb.tb_frame.f_code.co_filename), tb.tb_frame.f_code.co_name])
        tb = tb.tb_next
    return found

def at_exit():
    try:
        pickled = type(pickle.loads(pickle.dumps(Thing()))).__qualname__
    except Exception as exc:
        pickled = repr(exc)
    print(json.dumps({"pickled": pickled, "main_is_ours": sys.modules["__main__"].__dict__ is globals(),
                      "last": type(getattr(sys, "last_value", None)).__name__,
                      "last_frames": frames(getattr(sys, "last_traceback", None)),
                      "hook_is_default": sys.excepthook is sys.__excepthook__}), flush=True)

atexit.register(at_exit)
main = sys.modules["__main__"]
spec = main.__spec__
print(json.dumps({"globals": sorted(globals()), "main_is_ours": main.__dict__ is globals(),
                  "spec": spec and [spec.name, spec.origin, spec.parent], "file": __file__,
                  "package": __package__, "loader": type(__loader__).__name__,
                  "builtins": type(__builtins__).__name__, "argv": sys.argv, "orig_argv": sys.orig_argv[1:],
                  "path0": sys.path[0], "cwd": os.getcwd()}), flush=True)
print("to standard error", file=sys.stderr, flush=True)
mode = sys.argv[1]
if mode == "sigint":
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(60)
if mode == "raise":
    raise ValueError("boom")
if mode == "exit3":
    sys.exit(3)
"""
PACKAGE_INIT = """\
import json, sys
print(json.dumps({"package_argv": sys.argv, "main_then": sorted(vars(sys.modules["__main__"]))}), flush=True)
"""


@pytest.mark.parametrize("how", ["module", "script"])
@pytest.mark.parametrize("mode", ["ok", "sigint", "raise", "exit3"])
def test_a_spare_is_a_cold_interpreter_to_main_both_streams_and_the_exit(
    tmp_path: Path, how: str, mode: str
) -> None:
    """``python -m pkg.probe MODE`` and ``python pkg/probe.py MODE``, cold and in a spare: the same
    standard output and, apart, the same standard error (tracebacks included, a KeyboardInterrupt's too),
    the same exit (killed by SIGINT after the exit hooks for an interrupt), the same ``__main__`` (its
    ``__spec__``, ``__file__``, globals, ``sys.argv``, ``sys.path[0]``), and an exit hook that pickles a
    class of ``__main__`` finds it there."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    (work / "pkg").mkdir(parents=True)
    elsewhere.mkdir()
    (work / "pkg" / "__init__.py").write_text(PACKAGE_INIT)
    (work / "pkg" / "probe.py").write_text(MAIN_PROBE)
    plan = (
        WarmStart(RunMode.MODULE, "pkg.probe", (mode,))
        if how == "module"
        else WarmStart(RunMode.PATH, "pkg/probe.py", (mode,))
    )
    command = [sys.executable, "-m", "pkg.probe", mode] if how == "module" else [
        sys.executable, "pkg/probe.py", mode
    ]  # fmt: skip
    env = dict(os.environ)
    # A shell that starts a job in the background without job control (`cmd &` in a script, nohup) makes
    # it ignore SIGINT, and an ignored signal stays ignored across exec: then neither a cold interpreter
    # nor a spare sees a KeyboardInterrupt. Catching it here makes the children start with its default,
    # as they do under a terminal or CI.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    spare, channel = start_spare(elsewhere, env, tmp_path / "spare.log")
    outputs: dict[str, tuple[int, str, str]] = {}
    for start in ("warm", "cold"):
        out_path, err_path = tmp_path / f"{start}.out", tmp_path / f"{start}.err"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            if start == "warm":
                send_handoff(
                    channel, Handoff.for_command(plan, environment=env, cwd=work), out.fileno(), err.fileno()
                )
                channel.close()
                code = spare.wait(timeout=120)
            else:
                code = subprocess.run(
                    command, cwd=work, env=env, stdout=out, stderr=err, timeout=120
                ).returncode
        outputs[start] = (code, out_path.read_text(), err_path.read_text())
    spare_log = (tmp_path / "spare.log").read_text()
    assert outputs["warm"] == outputs["cold"], spare_log
    code, stdout, stderr = outputs["cold"]
    expected = {"ok": 0, "sigint": -signal.SIGINT, "raise": 1, "exit3": 3}
    assert code == expected[mode]
    assert "to standard error" in stderr
    assert "to standard error" not in stdout
    lines = [json.loads(line) for line in stdout.splitlines()]
    seen, at_exit = lines[-2], lines[-1]
    assert seen["main_is_ours"], seen
    assert at_exit["main_is_ours"], at_exit
    assert at_exit["pickled"] == "Thing", at_exit
    if how == "module":
        assert seen["spec"] == ["pkg.probe", str(work / "pkg" / "probe.py"), "pkg"]
        assert lines[0]["package_argv"][0] == "-m"
    if mode in ("sigint", "raise"):
        assert "Traceback" in stderr
        assert "trainer_sidecar" not in stderr, stderr  # none of the spare's frames
        assert at_exit["last"] == ("ValueError" if mode == "raise" else "KeyboardInterrupt")


# ------------------------------------------------------------------------------- trainguard run ---
def job(tmp_path: Path, command: list[str], *, faults: str, steps: int = 40, max_restarts: int = 3) -> Path:
    document: dict[str, Any] = {
        "apiVersion": "trainguard.dev/v1alpha1",
        "kind": "GuardedTrainingJob",
        "metadata": {"name": "warm-job", "namespace": "default"},
        "spec": {
            "replicas": 2,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "pytorch",
                            "image": "unused",
                            "command": [*command, "--steps", str(steps), "--step-sleep", "0.1"],
                            "env": [{"name": "TRAINGUARD_FAULTS", "value": faults}],
                        }
                    ]
                }
            },
            "checkpoint": {"claimName": "ckpt", "everySteps": 5, "snapshotEverySteps": 5},
            "health": {"hangTimeoutSeconds": 10, "startupGraceSeconds": 60, "probePeriodSeconds": 1},
            "recovery": {"maxRestarts": max_restarts, "backoffSeconds": [1]},
        },
    }
    path = tmp_path / "job.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document))
    return path


def run(tmp_path: Path, job_file: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "run", str(job_file), "--run-dir", str(tmp_path / "run"),
         "--summary", str(summary), "--plain", *extra],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    data = json.loads(summary.read_text()) if summary.exists() else {}
    return proc.returncode, data, proc.stdout + proc.stderr


def final_report(tmp_path: Path, attempt: int) -> dict[str, Any]:
    log = tmp_path / "run" / "latest" / "logs" / f"attempt-{attempt}-rank-0.log"
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    assert lines, log.read_text()[-3000:]
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def starts(summary: dict[str, Any]) -> list[str]:
    return [event["message"] for event in summary["timeline"] if event["kind"] == "start"]


def spare_processes(marker: str) -> list[int]:
    """Live spares whose environment names ``marker`` (a test's tmp_path)."""
    found = []
    for pid in procs.processes_mentioning(marker):
        try:
            if b"trainer_sidecar.guardian.spare" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


@pytest.mark.parametrize("fault", ["crash@25:1", "hang@25:1"])
def test_a_failure_recovered_in_warm_spares_resumes_bit_identically_and_leaves_nothing_running(
    tmp_path: Path, fault: str
) -> None:
    """Rank 1 crashes, or hangs in its own work (rank 0 then waits in the collective); either way every
    rank's worker is replaced by a spare, and the run ends with the uninterrupted run's weights."""
    command = ["python", str(procs.WORKER)]
    code, summary, output = run(tmp_path / "reference", job(tmp_path / "reference", command, faults=""))
    assert code == 0, output
    reference = final_report(tmp_path / "reference", 1)

    crashed = tmp_path / "crashed"
    code, summary, output = run(crashed, job(crashed, command, faults=fault))
    assert code == 0, output
    assert summary["attempts"] == 2, summary["timeline"]
    failure = next(event for event in summary["timeline"] if event["kind"] == "failure")
    assert ("hung" if fault.startswith("hang") else "crashed") in failure["message"], failure
    assert starts(summary)[1] == "started 2 worker(s) in warm spares", summary["timeline"]
    resumed = final_report(crashed, 2)
    assert resumed["step"] == 40
    assert resumed["digest"] == reference["digest"]
    # Attempt 2 stepped with restarts left, so attempt 3's spares were started, and never used:
    logs = crashed / "run" / "latest" / "logs"
    assert (logs / "attempt-3-rank-0.spare.log").exists(), sorted(p.name for p in logs.iterdir())
    assert procs.processes_mentioning(str(tmp_path)) == []


def test_a_runner_killed_while_its_spares_wait_leaves_nothing_running(tmp_path: Path) -> None:
    command = ["python", str(procs.WORKER)]
    runner = subprocess.Popen(
        [sys.executable, "-m", "trainguard.cli", "run", str(job(tmp_path, command, faults="", steps=400)),
         "--run-dir", str(tmp_path / "run"), "--plain"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        # The runner starts the two spares one after the other: wait for both, not for the first.
        while len(spares := spare_processes(str(tmp_path))) < 2 and time.monotonic() < deadline:
            assert runner.poll() is None
            time.sleep(0.2)
        assert len(spares) == 2
    finally:
        runner.send_signal(signal.SIGKILL)
        runner.wait()
    deadline = time.monotonic() + 20
    while (left := procs.processes_mentioning(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == []


def test_a_spare_that_died_is_replaced_by_a_cold_start(tmp_path: Path) -> None:
    """Spares are killed while attempt 1 trains; the crash's restart starts cold and the job finishes."""
    command = ["python", str(procs.WORKER)]
    runner = subprocess.Popen(
        [sys.executable, "-m", "trainguard.cli", "run", str(job(tmp_path, command, faults="crash@150:1",
         steps=160)), "--run-dir", str(tmp_path / "run"), "--summary", str(tmp_path / "summary.json"),
         "--plain"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while len(spares := spare_processes(str(tmp_path))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in spares:
        os.kill(pid, signal.SIGKILL)
    output, _ = runner.communicate(timeout=300)
    assert runner.returncode == 0, output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(spares) == 2
    assert starts(summary)[1] == "started 2 worker(s) cold (its warm spares had exited)", summary["timeline"]
    assert summary["final_step"] == 160
    assert procs.processes_mentioning(str(tmp_path)) == []


def test_a_command_that_is_not_plain_python_restarts_cold_without_spares(tmp_path: Path) -> None:
    script = tmp_path / "train.sh"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{procs.WORKER}" "$@"\n')
    script.chmod(0o755)
    code, summary, output = run(tmp_path, job(tmp_path, [str(script)], faults="crash@15:1", steps=30))
    assert code == 0, output
    assert summary["attempts"] == 2
    [_, second] = starts(summary)
    assert second.startswith("started 2 worker(s) cold ("), second
    assert "is not the interpreter trainguard runs in" in second
    assert not list((tmp_path / "run" / "latest" / "logs").glob("*.spare.log"))
    assert summary["final_step"] == 30


FIRST_USE = """\
import sys, tempfile
from trainer_sidecar.guardian.spare import warm
assert warm("") == []
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
before = set(sys.modules)
store = dist.FileStore(tempfile.mktemp(dir=sys.argv[1]), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
net = torch.nn.Linear(4, 2)
model = DistributedDataParallel(net)
optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
model(torch.ones(3, 4)).sum().backward()
optimizer.step()
dist.destroy_process_group()
ours = ("torch", "trainer_sidecar")
print(sorted(name for name in set(sys.modules) - before if name.split(".")[0] in ours))
"""


def test_a_warm_spare_has_imported_what_a_ddp_model_and_its_optimizer_import_on_first_use(
    tmp_path: Path,
) -> None:
    """After a restart's rendezvous the gang waits for its slowest rank's model, DDP and optimizer; torch
    imports modules for them on first use (``torch._dynamo``: 0.7 s), which a spare must have imported."""
    proc = subprocess.run(
        [sys.executable, "-c", FIRST_USE, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"

"""``trainguard run``: a GuardedTrainingJob on one machine, with the operator's recovery policy.

Each attempt starts ``replicas`` worker processes (the template's ``pytorch`` container command,
with the torch.distributed environment) and one sidecar process per worker on its own free port.
The runner probes each sidecar's ``/healthz`` every ``probePeriodSeconds`` like a kubelet, reads
``/status`` for the live view and the summary, watches exit codes, and hands what it saw to
``trainguard.policy.decide``. A restart stops the whole gang (SIGTERM, then SIGKILL after a grace),
waits the backoff and starts a new attempt; workers resume from the newest clean checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from trainer_sidecar.checkpoint import CheckpointStore
from trainer_sidecar.settings import Remediation
from trainer_sidecar.status import WorkerStatus
from trainguard.observation import GangView, ProcessState, SidecarReport, observe_gang
from trainguard.policy import Action, Decision, Observation, decide
from trainguard.spec import GuardedTrainingJob, SpecError
from trainguard.summary import Incident, RunRecord, fault_time

log = logging.getLogger("trainguard.run")

SIDECAR_START_TIMEOUT = 30.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _http_get(url: str, timeout: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as error:
        return int(error.code), bytes(error.read())
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, b""


@dataclass
class RankProcesses:
    """One rank of one attempt: the worker, its sidecar, and where their files are."""

    rank: int
    worker: subprocess.Popen[bytes]
    sidecar: subprocess.Popen[str]
    sidecar_url: str
    status_file: Path
    log_file: IO[bytes]
    alive: bool | None = None
    health_reason: str = ""
    #: The worker's status as its sidecar last served it (None: not read yet).
    status: WorkerStatus | None = None


@dataclass
class Event:
    """A line of the job's timeline."""

    time: float
    kind: str
    message: str
    attempt: int
    step: int | None = None

    def as_dict(self, origin: float) -> dict[str, Any]:
        """JSON form, with the time relative to the run's start."""
        return {
            "t": round(self.time - origin, 3),
            "kind": self.kind,
            "attempt": self.attempt,
            "step": self.step,
            "message": self.message,
        }


class LocalRunner:
    """Runs one GuardedTrainingJob to success or failure on this machine. See the module docstring."""

    def __init__(
        self,
        job: GuardedTrainingJob,
        *,
        checkpoint_root: Path,
        run_dir: Path,
        stop_grace_seconds: float = 10.0,
        view: Any = None,
    ) -> None:
        self.job = job
        self.spec = job.spec
        self.checkpoint_dir = checkpoint_root / self.spec.checkpoint.claim_name
        self.run_dir = run_dir
        self.stop_grace_seconds = stop_grace_seconds
        self.view = view
        self.worker = self.spec.template.spec.worker()
        self.command = self._command()
        self.template_env = self._template_env()
        self.attempt = 0
        self.restarts = 0
        self.remediation: Remediation | None = None
        # The attempt that introduced the remediation names it: workers apply a given id once, so a
        # later restart for another reason (a crash) does not lower the learning rate again.
        self.remediation_id = ""
        self.ranks: list[RankProcesses] = []
        self.events: list[Event] = []
        self.backoff_total = 0.0
        self.started = time.time()
        self.attempt_started = self.started
        self.record = RunRecord(self.started)
        self.final_decision: Decision | None = None

    @property
    def incidents(self) -> list[Incident]:
        """The gang restarts so far (appended by the run loop; their recovery is filled in as seen)."""
        return self.record.incidents

    # ---------------------------------------------------------------------------------- template ---
    def _command(self) -> list[str]:
        command = [*(self.worker.command or []), *(self.worker.args or [])]
        if not command:
            raise SpecError("spec.template.spec.containers[pytorch].command: a local run needs a command")
        # The image's python is this machine's interpreter (the one trainguard runs in).
        if Path(command[0]).name in ("python", "python3"):
            command[0] = sys.executable
        return command

    def _template_env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for index, item in enumerate(self.worker.env or []):
            where = f"spec.template.spec.containers[pytorch].env[{index}]"
            if "name" not in item:
                raise SpecError(f"{where}: needs a name")
            if "valueFrom" in item:
                raise SpecError(f"{where} ({item['name']}): valueFrom cannot be resolved without a cluster")
            env[str(item["name"])] = str(item.get("value", ""))
        return env

    def worker_env(self, rank: int, port: int, status_file: Path) -> dict[str, str]:
        """The environment of one worker process in the current attempt."""
        spec = self.spec
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
        env.update(self.template_env)
        env.update(
            PYTHONUNBUFFERED="1",
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(spec.replicas),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TRAINGUARD_SETTINGS=spec.guardian_settings().model_dump_json(by_alias=True),
            TRAINGUARD_CHECKPOINT_DIR=str(self.checkpoint_dir),
            TRAINGUARD_STATUS_FILE=str(status_file),
            TRAINGUARD_JOB_NAME=self.job.metadata.name,
            TRAINGUARD_NAMESPACE=self.job.metadata.namespace,
            TRAINGUARD_ATTEMPT=str(self.attempt),
        )
        if self.remediation is not None:
            payload = {"id": self.remediation_id, **self.remediation.model_dump(by_alias=True)}
            env["TRAINGUARD_REMEDIATION"] = json.dumps(payload)
        return env

    # ------------------------------------------------------------------------------------ events ---
    def event(self, kind: str, message: str, step: int | None = None) -> None:
        """Record a timeline event and show it."""
        entry = Event(time.time(), kind, message, self.attempt, step)
        self.events.append(entry)
        if self.view is not None:
            self.view.event(entry)

    # ------------------------------------------------------------------------------ gang control ---
    def start_gang(self) -> None:
        """Start the sidecars and workers of a new attempt."""
        self.attempt += 1
        self.attempt_started = time.time()
        attempt_dir = self.run_dir / f"attempt-{self.attempt}"
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        health = self.spec.health
        self.ranks = []
        for rank in range(self.spec.replicas):
            status_file = attempt_dir / f"rank-{rank}" / "status.json"
            status_file.parent.mkdir(parents=True, exist_ok=True)
            sidecar = subprocess.Popen(
                [
                    sys.executable, "-m", "trainer_sidecar.sidecar",
                    "--status-file", str(status_file),
                    "--host", "127.0.0.1", "--port", "0",
                    "--hang-timeout-seconds", str(health.hang_timeout_seconds),
                    "--startup-grace-seconds", str(health.startup_grace_seconds),
                    "--job", self.job.metadata.name, "--namespace", self.job.metadata.namespace,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )  # fmt: skip
            url = self._sidecar_url(sidecar)
            log_file = open(logs / f"attempt-{self.attempt}-rank-{rank}.log", "wb")  # noqa: SIM115
            worker = subprocess.Popen(
                self.command,
                env=self.worker_env(rank, port, status_file),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.ranks.append(RankProcesses(rank, worker, sidecar, url, status_file, log_file))
        remediation = ""
        if self.remediation is not None:
            remediation = f" with remediation lrScale={self.remediation.lr_scale}"
        self.event("start", f"started {self.spec.replicas} worker(s){remediation}")

    def _sidecar_url(self, sidecar: subprocess.Popen[str]) -> str:
        assert sidecar.stdout is not None
        deadline = time.monotonic() + SIDECAR_START_TIMEOUT
        while time.monotonic() < deadline:
            line = sidecar.stdout.readline()
            if not line:
                break
            if "listening on" in line:
                return line.strip().rsplit(" ", 1)[-1]
        sidecar.kill()
        raise RuntimeError("a sidecar did not start (no 'listening on' line)")

    def stop_gang(self) -> None:
        """SIGTERM every worker's process group, SIGKILL what is left after the grace, stop the sidecars."""
        for rank in self.ranks:
            _signal_group(rank.worker, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_seconds
        for rank in self.ranks:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                rank.worker.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                _signal_group(rank.worker, signal.SIGKILL)
                rank.worker.wait()
            _signal_group(rank.worker, signal.SIGKILL)  # stray children (data loader workers)
        for rank in self.ranks:
            _signal_group(rank.sidecar, signal.SIGTERM)
            try:
                rank.sidecar.wait(timeout=5)
            except subprocess.TimeoutExpired:
                rank.sidecar.kill()
                rank.sidecar.wait()
            if rank.sidecar.stdout is not None:
                rank.sidecar.stdout.close()
            rank.log_file.close()

    # --------------------------------------------------------------------------------- watching ---
    def probe(self) -> None:
        """Ask every sidecar for liveness (like the kubelet's probe) and status (like the operator)."""
        timeout = min(5.0, float(self.spec.health.probe_period_seconds))
        for rank in self.ranks:
            if rank.worker.poll() is not None:
                continue
            code, body = _http_get(rank.sidecar_url + "/healthz", timeout)
            rank.alive = None if code == 0 else code == 200
            rank.health_reason = "" if code == 200 else body.decode(errors="replace").strip()
            self.read_status(rank)

    def read_status(self, rank: RankProcesses) -> None:
        """Refresh one rank's status from its sidecar's /status (kept as it was when none can be had)."""
        code, body = _http_get(rank.sidecar_url + "/status", 2.0)
        if code != 200:
            return
        report = SidecarReport.from_document(body)
        if report.status is not None:
            rank.status = report.status

    def read_statuses(self) -> None:
        """Refresh every rank's status: the gang's step is its slowest rank's, so all are needed."""
        for rank in self.ranks:
            self.read_status(rank)

    def gang_view(self) -> GangView:
        """The current attempt's gang as its ranks last reported."""
        return observe_gang({r.rank: r.status for r in self.ranks}, self.spec.replicas)

    def observe(self) -> Observation:
        """What the policy sees now."""
        view = self.gang_view()
        ranks = []
        for rank in self.ranks:
            code = rank.worker.poll()
            process = ProcessState(exit_code=code, alive=rank.alive, health_reason=rank.health_reason)
            ranks.append(view.rank_observation(rank.rank, process))
        return Observation(
            attempt=self.attempt, ranks=ranks, restarts=self.restarts, handled_attempt=self.attempt - 1
        )

    def record_progress(self) -> None:
        """Take in the gang's progress and turn what changed into timeline events."""
        if not self.ranks:
            return
        for note in self.record.see(self.attempt, self.attempt_started, self.gang_view(), time.time()):
            self.event(note.kind, note.message, note.step)

    # ------------------------------------------------------------------------------------- main ---
    def run(self) -> int:
        """Run to the end; returns the process exit code (0 success, 1 failure, 130 interrupted)."""
        self.start_gang()
        period = float(self.spec.health.probe_period_seconds)
        next_probe = 0.0
        try:
            while True:
                now = time.monotonic()
                if now >= next_probe:
                    self.probe()
                    next_probe = now + period
                else:
                    self.read_statuses()
                self.record_progress()
                if self.view is not None:
                    self.view.update(self)
                decision = decide(self.spec.recovery, self.observe())
                if decision.action is Action.CONTINUE or decision.action is Action.WAIT:
                    time.sleep(0.25)
                    continue
                if decision.action is Action.SUCCEED:
                    self.finish(decision)
                    self.event("succeeded", "every rank exited 0")
                    return 0
                fault_time = self._fault_time(decision)
                detected = time.time()
                self.event(
                    decision.action.value if decision.action is Action.FAIL else "failure", decision.reason
                )
                self.stop_gang()
                if decision.action is Action.FAIL:
                    self.final_decision = decision
                    return 1
                self.restarts = decision.restarts
                if decision.remediation is not None:
                    self.remediation = decision.remediation
                    self.remediation_id = f"attempt-{self.attempt + 1}"
                self.incidents.append(
                    Incident(
                        self.attempt, decision.reason, fault_time, detected, decision.delay_seconds, None
                    )
                )
                self.event(
                    "restart",
                    f"restarting the whole gang in {decision.delay_seconds:g} s "
                    f"(restart {self.restarts} of {self.spec.recovery.max_restarts})",
                )
                time.sleep(decision.delay_seconds)
                self.backoff_total += decision.delay_seconds
                self.start_gang()
                next_probe = time.monotonic() + period
        except KeyboardInterrupt:
            self.event("interrupted", "stopped by the user; checkpoints are intact")
            self.stop_gang()
            return 130

    def finish(self, decision: Decision) -> None:
        """Record the final decision and let the workers' sidecars go."""
        self.final_decision = decision
        for rank in self.ranks:
            self.read_status(rank)
        self.record_progress()
        self.stop_gang()

    def _fault_time(self, decision: Decision) -> float:
        view = self.gang_view()
        return fault_time(decision, view, attempt_started=self.attempt_started, now=time.time())

    # ---------------------------------------------------------------------------------- summary ---
    def summary(self) -> dict[str, Any]:
        """The run's figures (see the README's summary reference)."""
        wall = time.time() - self.started
        store = CheckpointStore(self.checkpoint_dir)
        newest = store.newest_valid()
        checkpoint = None
        if newest is not None:
            ref = store.reference(newest)
            if ref is not None:
                checkpoint = {"step": ref.step, "path": ref.path, "sha256": ref.sha256}
        decision = self.final_decision
        if decision is None:
            result = "interrupted"
        else:
            result = "succeeded" if decision.action is Action.SUCCEED else "failed"
        return {
            "job": {"name": self.job.metadata.name, "namespace": self.job.metadata.namespace},
            "result": result,
            "reason": decision.reason if decision else "interrupted",
            "attempts": self.attempt,
            **self.record.figures(wall, self.backoff_total),
            "final_checkpoint": checkpoint,
            "timeline": [e.as_dict(self.started) for e in self.events],
            "series": self.record.series,
        }


def _signal_group(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)

"""``trainguard run``: a GuardedTrainingJob on one machine, with the operator's recovery policy.

Each attempt starts ``replicas`` worker processes (the template's ``pytorch`` container command, in its
``workingDir``, with the torch.distributed environment) and one sidecar process per worker on its own free
port. The runner probes each sidecar's ``/healthz`` every ``probePeriodSeconds`` like a
kubelet (see ``trainguard.local.sidecars``: failures counted to a threshold, a dead sidecar restarted),
reads ``/status`` for the live view and the summary, watches exit codes, and hands what it saw to
``trainguard.core.policy.decide``. A restart stops the whole gang (SIGTERM, then SIGKILL after a grace)
within the backoff and starts a new attempt; workers resume from the newest clean checkpoint. Where the
command is a plain ``python SCRIPT`` or ``python -m MODULE``, the new attempt runs in warm spares: one
interpreter per rank, started with the next attempt's environment and gang marker once the current attempt
steps, that has imported torch and waits to be handed the rank (``trainer_sidecar.contract.handoff``);
the first attempt, and any other command, start cold.

Nothing outlives the runner (see ``trainguard.local.launch`` and ``trainguard.local.watchdog``): every
child is registered for cleanup the moment it exists and dies with the runner even when the runner is
killed, and a watchdog kills the gang's processes a launcher started in sessions of their own; SIGINT,
SIGTERM and SIGHUP stop the gang and end the run with 128 + the signal's number. The command and working
directory are checked, and the checkpoint directory locked against a second run of the job, before
anything starts (see ``trainguard.local.rundir``). Each run writes into a folder of its own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from trainer_sidecar.contract.env import GANG_ENV, PREFIX, RUN_ENV
from trainer_sidecar.contract.files import read_small_file
from trainer_sidecar.contract.handoff import Handoff, WarmStart, plan_warm_start
from trainer_sidecar.contract.identity import job_identity
from trainer_sidecar.contract.status import (
    MAX_STATUS_BYTES,
    WorkerStatus,
    local_status_file,
    parse_status,
    read_status,
)
from trainer_sidecar.contract.warmspare import SpareSpawner, WarmSpare
from trainguard.core.environment import worker_environment
from trainguard.core.observation import GangView, ProcessState, observe_gang
from trainguard.core.policy import Action, Observation
from trainguard.core.spec import WORKER_CONTAINER, GuardedTrainingJob, SpecError
from trainguard.core.torchrun import NodeLaunch, NotPython, under_torchrun
from trainguard.local import sidecars
from trainguard.local.launch import (
    RunRefused,
    Stopped,
    StopSignals,
    check_working_dir,
    exit_detail,
    kill_marked,
    marked_processes,
    omp_threads,
    resolve_command,
    signal_group,
    spawn,
    wait_for_group,
)
from trainguard.local.rundir import CheckpointLock, make_dir_inside, new_run_folder, plain_name
from trainguard.local.sidecars import TERMINATION_MESSAGE_FILE, RankProcesses, SidecarProcess
from trainguard.local.supervisor import FinalCheckpoint, GangSupervisor, Look, RunResult
from trainguard.local.watchdog import Watchdog

log = logging.getLogger("trainguard.run")

_CONTAINER = f"spec.template.spec.containers[{WORKER_CONTAINER}]"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class LocalRunner(GangSupervisor):
    """Runs one GuardedTrainingJob to success or failure on this machine. See the module docstring."""

    def __init__(
        self,
        job: GuardedTrainingJob,
        *,
        checkpoint_root: Path,
        run_dir: Path,
        stop_grace_seconds: float = 10.0,
        view: Any = None,
        signals: StopSignals | None = None,
        warm_spares: bool = True,
    ) -> None:
        """Check the job against this machine (command, working directory, names); nothing starts yet.

        ``run_dir`` is the job's run root: each ``run()`` writes into a new folder under it
        (``run_folder``). ``warm_spares``: restart through warm spare interpreters where the command
        allows it (see ``warm_plan``). Raises SpecError or RunRefused naming the field.
        """
        super().__init__(job, view=view, stop_grace_seconds=stop_grace_seconds)
        self.checkpoint_root = checkpoint_root.absolute()
        claim = plain_name(self.spec.checkpoint.claim_name, "spec.checkpoint.claimName")
        self.checkpoint_dir = self.checkpoint_root / claim
        self.run_root = run_dir.absolute()
        self.run_folder: Path | None = None
        self.signals = signals
        self.worker = self.spec.template.spec.worker()
        self.template_env = self._template_env()
        self.working_dir = check_working_dir(self.worker.working_dir, field=f"{_CONTAINER}.workingDir")
        self.command = self._command()
        self.lock = CheckpointLock(self.checkpoint_dir)
        #: Kills the gang if the runner dies without stopping it (see ``trainguard.local.watchdog``).
        self.watchdog: Watchdog | None = None
        #: The locked checkpoint directory as the current attempt's workers were given it (its real path).
        self.worker_checkpoint_dir = self.checkpoint_dir
        # Every process of the current attempt, registered the moment it exists (see _spawn).
        self._workers: list[subprocess.Popen[Any]] = []
        self._sidecars: list[subprocess.Popen[Any]] = []
        #: The sidecars started for an attempt during the restart's backoff, by attempt number.
        self._next_sidecars: tuple[int, list[tuple[int, SidecarProcess, Path]]] | None = None
        self._files: list[IO[bytes]] = []
        self.gang_id = ""  # set per attempt: the marker every process of the gang carries (GANG_ENV)
        self.ranks: list[RankProcesses] = []
        self._next_probe = 0.0  # when the sidecars are probed next (time.monotonic())
        #: How a restart can run in warm spares, or (a str) why every attempt starts cold.
        self.warm_plan: WarmStart | str = self._warm_plan(warm_spares)
        # The spares of the next attempt (``_spare_attempt``) by rank, all carrying its gang marker.
        self._spares: dict[int, WarmSpare] = {}
        self._spare_attempt = 0
        self._spare_gang = ""
        # Every spare process, registered the moment it exists (as _workers), until handed off or stopped.
        self._spare_procs: list[subprocess.Popen[Any]] = []
        #: Spares handed off before they had finished their imports (the handoff waited for them).
        self.unready_handoffs = 0

    # ---------------------------------------------------------------------------------- template ---
    def _command(self) -> list[str]:
        command = [*(self.worker.command or []), *(self.worker.args or [])]
        if not command:
            raise SpecError(f"{_CONTAINER}.command: a local run needs a command")
        field_name = f"{_CONTAINER}.command[0]" if self.worker.command else f"{_CONTAINER}.args[0]"
        path = self.template_env.get("PATH", os.environ.get("PATH", os.defpath))
        resolved = resolve_command(command, field=field_name, cwd=self.working_dir, path=path)
        if self.spec.nproc_per_node > 1:
            try:
                under_torchrun(resolved, NodeLaunch("1", "1", "0", "127.0.0.1", "0"))
            except NotPython as exc:
                raise SpecError(f"{_CONTAINER}.command: {exc}") from exc
        return resolved

    def _warm_plan(self, enabled: bool) -> WarmStart | str:
        if not enabled:
            return "warm spares are turned off"
        if self.spec.nproc_per_node > 1:
            return "nprocPerNode above 1 starts the workers under torchrun"
        return plan_warm_start(self.command, sys.executable)

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

    def worker_env(
        self,
        rank: int,
        port: int,
        status_file: Path,
        *,
        attempt: int | None = None,
        gang_id: str | None = None,
    ) -> dict[str, str]:
        """The environment of one worker process in the current attempt (or in ``attempt`` with the gang
        marker ``gang_id``: a spare's, made before that attempt starts).

        As torchrun does, ``OMP_NUM_THREADS`` shares this machine's cores among the workers unless the
        user set it. The termination-message file sits beside the status file.
        """
        spec = self.spec
        env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
        env.update(self.template_env)
        env.setdefault("OMP_NUM_THREADS", omp_threads(spec.replicas * spec.nproc_per_node))
        env.update(
            PYTHONUNBUFFERED="1",
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(spec.replicas),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        env.update(
            worker_environment(
                self.job,
                attempt=self.attempt if attempt is None else attempt,
                remediation=self.remediation,
                checkpoint_dir=str(self.worker_checkpoint_dir),
                status_file=str(status_file),
                termination_message_path=str(status_file.with_name(TERMINATION_MESSAGE_FILE)),
                restarts=self.restarts,
                run_seconds=time.time() - self.started,
            ).variables()
        )
        env[GANG_ENV] = self.gang_id if gang_id is None else gang_id
        env[RUN_ENV] = self.run_marker
        return env

    # ------------------------------------------------------------------------------ gang control ---
    def prepare(self) -> None:
        """Create and lock the checkpoint directory, then this run's own folder (RunRefused if another
        run holds the lock or a path leads outside its root). No process is started."""
        self.checkpoint_dir = make_dir_inside(
            self.checkpoint_root, self.checkpoint_dir, "spec.checkpoint.claimName", "--checkpoint-root"
        )
        self.lock.acquire(job=self.job_identity)
        self._kill_leftovers()
        self.run_folder = new_run_folder(self.run_root)

    @property
    def job_identity(self) -> str:
        """``<namespace>/<name>``: what makes the job unique (the epoch claims record the same)."""
        return job_identity(self.job.metadata.namespace, self.job.metadata.name)

    @property
    def run_marker(self) -> str:
        """The value of RUN_ENV in every worker this job's runs start: one per job and checkpoint
        directory, the directory as its device and inode under the lock (``CheckpointLock.identity``),
        not a path: two roots spelled alike (a re-pointed symlink, a remounted path) are told apart, and
        another job at the same directory has a marker of its own. "" until the lock is held."""
        if self.lock.identity is None:  # not locked yet (prepare): no process can carry a marker yet
            return ""
        device, inode = self.lock.identity
        return hashlib.sha256(f"{device}:{inode}:{self.job_identity}".encode()).hexdigest()[:32]

    def _checked_checkpoint_dir(self) -> Path:
        """The checkpoint directory's real path, as the workers of the next attempt get it: the directory
        the lock is on (RunRefused if the path now leads to another, e.g. a re-pointed symlink)."""
        real = self.checkpoint_dir.resolve()
        try:
            info = os.stat(real)
        except OSError as exc:
            raise RunRefused(f"checkpoint directory {self.checkpoint_dir}: {exc}") from exc
        if (info.st_dev, info.st_ino) != self.lock.identity:
            raise RunRefused(
                f"checkpoint directory {self.checkpoint_dir} now leads to another directory ({real}) than "
                "the one this run locked; refusing to start workers there"
            )
        return real

    def _kill_leftovers(self, wait_seconds: float = 10.0) -> None:
        """Kill the workers an earlier run of this job left (a runner killed with SIGKILL takes its own
        children with it, but not a launcher's workers, which live in sessions of their own), and give
        them a moment to go (a GPU's memory is freed only then). Holding the lock, this run is the only
        one of the job: whatever carries its marker is left over."""
        leftovers = kill_marked(RUN_ENV, self.run_marker)
        if not leftovers:
            return
        log.warning("killed %d process(es) an earlier run of this job left: %s", len(leftovers), leftovers)
        deadline = time.monotonic() + wait_seconds
        while set(marked_processes(RUN_ENV, self.run_marker)) & set(leftovers):
            if time.monotonic() > deadline:
                log.warning("processes an earlier run left are still exiting; going on")
                return
            time.sleep(0.1)

    def _spawn(
        self, argv: list[str], *, worker: bool, spare: bool = False, **options: Any
    ) -> subprocess.Popen[Any]:
        """Start a child and register it for cleanup before a stop signal can interrupt."""
        signals = self.signals if self.signals is not None else StopSignals()
        with signals.deferred():
            try:
                proc = spawn(argv, **options)
            except OSError as exc:
                raise RunRefused(f"cannot start {argv[0]}: {exc}") from exc
            (self._spare_procs if spare else self._workers if worker else self._sidecars).append(proc)
        return proc

    def sidecar_env(self, status_file: Path) -> dict[str, str]:
        """The environment of one rank's sidecar: the job's, as the operator renders it, on loopback."""
        return sidecars.sidecar_env(self.job, status_file)

    def _pod_command(self, pod: int, port: int) -> list[str]:
        """The command of one pod: the job's, or with nprocPerNode above 1 the same under torchrun (as the
        operator renders it, with this machine's numbers in place of the training operator's)."""
        nproc = self.spec.nproc_per_node
        if nproc == 1:
            return self.command
        node = NodeLaunch(str(self.spec.replicas), str(nproc), str(pod), "127.0.0.1", str(port))
        return under_torchrun(self.command, node)

    def _prepare_attempt(self) -> None:
        """Before the next attempt is counted: its workers' checkpoint directory must still be the locked
        one (``prepare`` first)."""
        assert self.run_folder is not None, "prepare() before the first attempt"
        self.worker_checkpoint_dir = self._checked_checkpoint_dir()

    def _launch_sidecars(self, attempt: int) -> list[tuple[int, SidecarProcess, Path]]:
        """Start attempt ``attempt``'s sidecars side by side and wait until each listens
        (``sidecars.launch_sidecars``); each rank's sidecar and status file."""
        assert self.run_folder is not None, "prepare() before the first attempt"
        return sidecars.launch_sidecars(
            self.job,
            self.run_folder / f"attempt-{attempt}",
            lambda argv, **options: self._spawn(argv, worker=False, **options),
        )

    def _prepare_next_attempt(self) -> None:
        """Start the next attempt's sidecars during the restart's backoff (the old gang, its sidecars
        included, is stopped): its workers then start at the backoff's end. A run that ends before that
        attempt starts stops them with everything else it started."""
        self._next_sidecars = (self.attempt + 1, self._launch_sidecars(self.attempt + 1))

    def _start_workers(self) -> None:
        """Start the workers of attempt ``self.attempt`` (in its warm spares where there are some), each
        only beside its sidecar, listening: the sidecars started during the backoff
        (``_prepare_next_attempt``), or now."""
        assert self.run_folder is not None, "prepare() before the first attempt"
        period = float(self.spec.health.probe_period_seconds)
        self._next_probe = 0.0 if self.attempt == 1 else time.monotonic() + period
        spares = self._take_spares()
        if spares:
            self.gang_id = self._spare_gang  # announced to the watchdog before the spares started
        else:
            self.gang_id = self._new_gang_id(self.attempt)
            # Before the gang's first process: a runner killed from here on takes the gang with it, even
            # the processes a launcher (torchrun) starts in sessions of their own.
            self._announce(self.gang_id)
        logs = self.run_folder / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.ranks = []
        prepared, self._next_sidecars = self._next_sidecars, None
        if prepared is not None and prepared[0] == self.attempt:
            sidecars = prepared[1]
        else:
            sidecars = self._launch_sidecars(self.attempt)
        warm = 0
        for rank, sidecar, status_file in sidecars:
            log_path = logs / f"attempt-{self.attempt}-rank-{rank}.log"
            log_file = open(log_path, "xb")  # noqa: SIM115 - closed by _stop_workers
            self._files.append(log_file)
            env = self.worker_env(rank, port, status_file)
            worker = self._hand_off(rank, spares[rank], env, log_file) if rank in spares else None
            if worker is None:
                worker = self._spawn(
                    self._pod_command(rank, port),
                    worker=True,
                    env=env,
                    cwd=self.working_dir,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    pass_fds=(self.lock.fd,),  # the checkpoint lock lives as long as the gang
                )
            else:
                warm += 1
            self.ranks.append(RankProcesses(rank, worker, sidecar, status_file, log_path))
        self._stop_spares()  # those no rank took (a spare that had exited was replaced by a cold start)
        remediation = ""
        if self.remediation is not None:
            remediation = f" with remediation lrScale={self.remediation.lr_scale}"
        nproc = self.spec.nproc_per_node
        each = f" of {nproc} processes each" if nproc > 1 else ""
        how = self._how(warm, offered=len(spares))
        self.event("start", f"started {self.spec.replicas} worker(s){each}{remediation}{how}")

    def _how(self, warm: int, *, offered: int) -> str:
        """How an attempt's workers started, for its start event ("" for a first attempt, always cold):
        ``warm`` of them in the ``offered`` spares."""
        replicas = self.spec.replicas
        if warm == replicas:
            return " in warm spares"
        if warm:
            return f" ({warm} in warm spares, {replicas - warm} cold: a spare had exited)"
        if self.attempt == 1:
            return ""
        if isinstance(self.warm_plan, str):
            return f" cold ({self.warm_plan})"
        return " cold (its warm spares had exited)" if offered else " cold (no warm spares had started)"

    def _new_gang_id(self, attempt: int) -> str:
        return f"{os.getpid()}-{attempt}-{secrets.token_hex(4)}"

    def _announce(self, gang_id: str) -> None:
        if self.watchdog is None or not self.watchdog.announce(gang_id):
            log.warning(
                "attempt %d: no watchdog; if this runner is killed (SIGKILL), workers a launcher started "
                "may outlive it until the job's next run",
                self.attempt,
            )

    # ------------------------------------------------------------------------------ warm spares ---
    def _spares_due(self, look: Look) -> bool:
        """Whether to start the next attempt's spares now: restarts can run in them, there are none yet,
        a restart is still allowed, and this attempt has stepped (started earlier, the spares' imports
        would compete for the cores with the workers' own start, resume and first step; a resumed
        worker reports its checkpoint's step before it has taken one, so the step alone does not say)."""
        return (
            isinstance(self.warm_plan, WarmStart)
            and self._spare_attempt <= self.attempt
            and self.restarts < self.spec.recovery.max_restarts
            and look.view.stepped
        )

    def _start_spares(self) -> None:
        """Start one warm spare per rank for attempt ``self.attempt + 1``, carrying its gang marker (told
        the watchdog first) and its environment as far as it is known (the port, a remediation and the
        log come with the handoff). Spares are optional: if one cannot start, the attempt starts cold."""
        plan = self.warm_plan
        assert isinstance(plan, WarmStart)
        assert self.run_folder is not None
        attempt = self.attempt + 1
        gang = self._new_gang_id(attempt)
        self._spare_attempt, self._spare_gang = attempt, gang
        self._announce(gang)
        logs = self.run_folder / "logs"
        for rank in range(self.spec.replicas):
            status_file = self.run_folder / f"attempt-{attempt}" / f"rank-{rank}" / "status.json"
            env = self.worker_env(rank, 0, status_file, attempt=attempt, gang_id=gang)
            try:
                with open(logs / f"attempt-{attempt}-rank-{rank}.spare.log", "ab") as spare_log:
                    spare = WarmSpare.start(plan, sys.executable, self._spare_spawner(env, spare_log))
            except (RunRefused, OSError) as exc:
                log.warning("attempt %d: no warm spares (%s); it will start cold", attempt, exc)
                self._stop_spares()
                return
            self._spares[rank] = spare

    def _spare_spawner(self, env: dict[str, str], spare_log: IO[bytes]) -> SpareSpawner:
        """How one rank's spare is started: registered as a spare, with ``env`` in the working directory,
        writing to ``spare_log``, holding the checkpoint lock as a worker does."""

        def spawn_spare(argv: list[str], channel_fd: int) -> subprocess.Popen[Any]:
            return self._spawn(
                argv,
                worker=False,
                spare=True,
                env=env,
                cwd=self.working_dir,
                stdout=spare_log,
                stderr=subprocess.STDOUT,
                pass_fds=(self.lock.fd, channel_fd),
            )

        return spawn_spare

    def _take_spares(self) -> dict[int, WarmSpare]:
        """The spares made for the attempt starting now, by rank ({}: none)."""
        if self._spare_attempt != self.attempt:
            return {}
        return dict(self._spares)

    def _hand_off(
        self, rank: int, spare: WarmSpare, env: dict[str, str], log_file: IO[bytes]
    ) -> subprocess.Popen[Any] | None:
        """Make ``spare`` this attempt's worker of ``rank`` (see ``trainer_sidecar.contract.handoff``);
        None if it has exited or cannot be told (the rank then starts cold)."""
        assert isinstance(self.warm_plan, WarmStart)
        handoff = Handoff.for_command(self.warm_plan, environment=env, cwd=self.working_dir)
        if not spare.alive():
            return None
        if not spare.is_warm():
            self.unready_handoffs += 1
        try:
            # Both to the log, as a cold worker's (its stderr=STDOUT): one file, two descriptors.
            spare.hand_off(handoff, log_file.fileno(), log_file.fileno())
        except OSError as exc:
            log.warning("attempt %d: rank %d's spare could not be told (%s)", self.attempt, rank, exc)
            return None
        signals = self.signals if self.signals is not None else StopSignals()
        with signals.deferred():  # from a spare to a worker without a moment in neither list
            self._workers.append(spare.proc)
            self._spare_procs.remove(spare.proc)
        del self._spares[rank]
        return spare.proc

    def _stop_spares(self) -> None:
        """SIGKILL every spare not handed off (they hold nothing: no checkpoint, no peer) and reap it."""
        spares, procs = self._spares, self._spare_procs
        self._spares, self._spare_procs = {}, []
        for spare in spares.values():
            spare.drop()
        for proc in procs:  # also one registered by _spawn that never became a WarmSpare (a stop signal)
            if proc.poll() is None:  # not reaped yet: its pid cannot have been reused
                signal_group(proc, signal.SIGKILL)
        for proc in procs:
            proc.wait()

    def _stop_workers(self, grace_seconds: float | None = None) -> None:
        """SIGTERM every worker's process group and every sidecar, SIGKILL what is left after the grace
        (a sidecar's after 5 s).

        Stops every process registered in this attempt, also those of a rank that was still starting.
        The sidecars are told with the workers, not after them: nothing reads them once the gang is being
        stopped (its final statuses are read from the files), and their exit then overlaps the workers'
        grace instead of adding to every stop.
        """
        workers, sidecars, files = self._workers, self._sidecars, self._files
        self._workers, self._sidecars, self._files = [], [], []
        for worker in workers:
            signal_group(worker, signal.SIGTERM)
        for sidecar in sidecars:
            if sidecar.poll() is None:  # a restarted sidecar's predecessor is gone (its pid may be reused)
                signal_group(sidecar, signal.SIGTERM)
        grace = self.stop_grace_seconds if grace_seconds is None else grace_seconds
        deadline = time.monotonic() + grace
        for worker in workers:
            try:
                worker.wait(timeout=max(0.0, deadline - time.monotonic()))
                wait_for_group(worker, deadline)  # mp.spawn's workers outlive their parent's SIGTERM
            except subprocess.TimeoutExpired:
                signal_group(worker, signal.SIGKILL)
                worker.wait()
            signal_group(worker, signal.SIGKILL)  # stray children (data loader workers)
        strays = kill_marked(GANG_ENV, self.gang_id)  # a launcher's workers, in sessions of their own
        if strays:
            log.warning(
                "attempt %d: killed %d process(es) left by the gang: %s", self.attempt, len(strays), strays
            )
        for sidecar in sidecars:
            try:
                sidecar.wait(timeout=5)
            except subprocess.TimeoutExpired:
                signal_group(sidecar, signal.SIGKILL)
                sidecar.wait()
            if sidecar.stdout is not None:
                sidecar.stdout.close()
        for file in files:
            file.close()

    # --------------------------------------------------------------------------------- watching ---
    def _idle(self, seconds: float) -> None:
        """Wait ``seconds`` before the next look, or until a worker of the attempt ends: a crash is seen
        when it happens, not at the next look (Linux's pidfds; elsewhere the whole wait)."""
        pidfds: list[int] = []
        try:
            for worker in self._workers:
                if worker.poll() is None:  # not reaped, so its pid is still this child's
                    pidfds.append(os.pidfd_open(worker.pid))
        except (AttributeError, OSError):  # no pidfds here (an old kernel, not Linux)
            pidfds = self._closed(pidfds)
        try:
            if pidfds:
                select.select(pidfds, [], [], seconds)
            else:
                time.sleep(seconds)
        finally:
            self._closed(pidfds)

    @staticmethod
    def _closed(fds: list[int]) -> list[int]:
        for fd in fds:
            os.close(fd)
        return []

    def probe(self) -> None:
        """Probe every rank through its sidecar (``sidecars.probe``), restarts told as events."""
        sidecars.probe(
            self.ranks, float(self.spec.health.probe_period_seconds), self.stop_grace_seconds, self.event
        )

    def exit_reason(self, rank: RankProcesses) -> str:
        """Why an exited worker exited, from its termination message or log ("" if running or unknown)."""
        code = rank.worker.poll()
        if code is None:
            return ""
        if rank.exit_reason is None:
            rank.exit_reason = exit_detail(code, rank.termination_file, rank.log_path)
        return rank.exit_reason

    def read_status(self, rank: RankProcesses) -> None:
        """Refresh one rank's status from its sidecar's /status (kept as it was when none can be had),
        and heed the sidecar's verdict in it."""
        sidecars.read_status(rank)

    def _monitor_workers(self) -> Look:
        """Probe the sidecars once a probe period (as the kubelet does), read the statuses in between (as
        the operator does), and observe the gang."""
        now = time.monotonic()
        if now >= self._next_probe:
            self.probe()
            self._next_probe = now + float(self.spec.health.probe_period_seconds)
        else:
            self.read_statuses()
        look = self.observe()
        if self._spares_due(look):
            self._start_spares()
        return look

    def _read_final_statuses(self) -> None:
        """Once the gang is stopped (its sidecars too): each rank's final status from what its workers
        wrote as they ended, read from the files, kept as it was where none can be had."""
        for rank in self.ranks:
            final = self.final_status(rank)
            if final is not None:
                rank.status = final

    def final_status(self, rank: RankProcesses) -> WorkerStatus | None:
        """What a stopped rank's worker wrote last: its termination message (the guardian's final status),
        else its status file; for a pod of several processes, the slowest one's status file, as its
        sidecar shows a pod (they share one termination-message path). None: nothing readable."""
        nproc = self.spec.nproc_per_node
        if nproc == 1:
            try:
                message = read_small_file(rank.termination_file, MAX_STATUS_BYTES, "termination message")
            except OSError:  # FileRefused included
                message = b""  # none (killed), or not a file: the status file is the last word
            final = parse_status(message, str(rank.termination_file)).status if message else None
            return final if final is not None else read_status(rank.status_file).status
        statuses = [read_status(local_status_file(rank.status_file, i, nproc)).status for i in range(nproc)]
        found = [status for status in statuses if status is not None]
        return min(found, key=lambda status: status.step) if found else None

    def read_statuses(self) -> None:
        """Refresh every rank's status: the gang's step is its slowest rank's, so all are needed."""
        for rank in self.ranks:
            self.read_status(rank)

    def gang_view(self) -> GangView:
        """The current attempt's gang as its ranks last reported."""
        return observe_gang(
            {r.rank: r.status for r in self.ranks},
            self.spec.replicas,
            {r.rank: r.hang_timeout_seconds for r in self.ranks},
        )

    def observe(self) -> Look:
        """The gang now, and what the policy sees of it (from that one view)."""
        now = time.monotonic()  # one reading: exits first seen in one observation tie
        codes = []
        for rank in self.ranks:
            code = rank.worker.poll()
            if code is not None and rank.ended_at is None:
                rank.ended_at = now
                # What it wrote as it ended (the step it failed at, and why), not its last periodic
                # report: a crash's step is compared with the next attempt's (a deterministic failure).
                final = self.final_status(rank)
                if final is not None:
                    rank.status = final
            codes.append(code)
        view = self.gang_view()
        ranks = []
        for rank, code in zip(self.ranks, codes, strict=True):
            process = ProcessState(
                exit_code=code,
                alive=rank.alive,
                health_reason=rank.health_reason,
                exit_reason=self.exit_reason(rank),
                ended_at=rank.ended_at,
            )
            ranks.append(view.rank_observation(rank.rank, process))
        observation = Observation(
            attempt=self.attempt,
            ranks=ranks,
            restarts=self.restarts,
            handled_attempt=self.attempt - 1,
            step=view.last_step,
            previous_failure=self.last_failure,
            straggler=view.straggler(self.spec.health.straggler.threshold),
            now=now,
        )
        return Look(view, observation)

    # ------------------------------------------------------------------------------------- main ---
    def run(self) -> int:
        """Run to the end; returns the exit code: 0 success, 1 when the policy gives up, 2 for a
        permanent failure (a worker's configuration error, such as a checkpoint directory another job
        claimed, or a fenced worker: see ``exit_code_of``), 128 + N when stopped by signal N (130
        Ctrl-C, 143 SIGTERM, 129 SIGHUP). Raises RunRefused when the run cannot start; no process is
        left running either way."""
        if self.signals is not None:
            return self._run(self.signals)
        with StopSignals() as signals:
            self.signals = signals
            return self._run(signals)

    def _run(self, signals: StopSignals) -> int:
        try:
            with signals.deferred():  # registered before a stop signal can leave it unwaited for
                self.watchdog = Watchdog.start(str(self.checkpoint_dir))
            self.prepare()
            self.start_attempt()
            return self.supervise(signals)
        except Stopped as stop:
            signals.disarm()  # the gang is being stopped: a second signal cannot cut that short
            self.interrupted(stop.name)
            return stop.exit_code
        finally:
            signals.disarm()  # from here on a stop signal cannot cut the cleanup short
            self._stop_workers()
            self._stop_spares()
            self.lock.release()
            if self.watchdog is not None:
                self.watchdog.close()  # the gang is stopped: the watchdog has nothing left to do

    # ---------------------------------------------------------------------------------- summary ---
    def summary(self) -> RunResult:
        """The run's figures (see the README's summary reference)."""
        from trainer_sidecar.checkpoint import CheckpointStore  # imports torch: only when summarising

        wall = time.time() - self.started
        store = CheckpointStore(self.checkpoint_dir)
        newest = store.newest_valid()
        checkpoint = None
        if newest is not None:
            ref = store.reference(newest)
            if ref is not None:
                checkpoint = FinalCheckpoint(step=ref.step, path=ref.path, sha256=ref.sha256)
        decision = self.final_decision
        if decision is None:
            result = "interrupted"
        else:
            result = "succeeded" if decision.action is Action.SUCCEED else "failed"
        return RunResult(
            name=self.job.metadata.name,
            namespace=self.job.metadata.namespace,
            result=result,
            reason=decision.reason if decision else "interrupted",
            attempts=self.attempt,
            figures=self.record.figures(wall, self.backoff_total),
            final_checkpoint=checkpoint,
            timeline=[e.as_dict(self.started) for e in self.events],
            series=self.record.series,
        )

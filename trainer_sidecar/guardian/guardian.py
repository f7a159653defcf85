"""The Guardian: a training step that cannot be poisoned and checkpoints that cannot be lost.

Adopting it in a plain PyTorch loop::

    guardian = Guardian(model, optimizer, scheduler=scheduler)
    loader = guardian.loader(dataset, batch_size=32)
    for batch in guardian.run(loader, max_steps=10_000):
        loss = compute_loss(model, batch)
        guardian.step(loss)          # replaces backward(), optimizer.step(), scheduler.step(), zero_grad()

Every step: backward (always, on every rank: skipping it alone would deadlock DDP's all-reduce), unscale,
one fused total-norm reduction, one tiny all-reduce of (loss, non-finite flag, norm) under DDP so every
rank takes the same decision, and one host sync to read those three numbers. What to do with the step
is decided by the pure step judge (``trainer_sidecar.guardian.judge``); the Guardian carries the verdict out.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainer_sidecar.checkpoint import CheckpointError, EpochOwner, FencedError
from trainer_sidecar.contract.compute import ComputeWindow
from trainer_sidecar.contract.exitcodes import ExitCode
from trainer_sidecar.contract.identity import job_identity
from trainer_sidecar.contract.settings import GuardianSettings
from trainer_sidecar.contract.status import (
    Activity,
    Phase,
    WorkerStatus,
)
from trainer_sidecar.guardian.activity import ActivityTracker
from trainer_sidecar.guardian.busy import (
    BusySections,
    held,
)
from trainer_sidecar.guardian.checkpointing import CheckpointManager
from trainer_sidecar.guardian.config import ConfigError, GuardianConfig, report_config_error
from trainer_sidecar.guardian.counters import GuardCounters
from trainer_sidecar.guardian.data import DEAD_LETTER_NAME, DeadLetters, GuardedLoader, SizedDataset
from trainer_sidecar.guardian.ending import (
    Diverged,
    Fenced,
    Lifecycle,
    UncleanState,
    WorkerEnd,
    end_worker,
    noting_escapes,
)
from trainer_sidecar.guardian.epochs import EpochLoop
from trainer_sidecar.guardian.faults import FaultInjector
from trainer_sidecar.guardian.feed import DataFeed, Stateful
from trainer_sidecar.guardian.forensics import BatchRef
from trainer_sidecar.guardian.gang import Gang
from trainer_sidecar.guardian.judge import (
    Action,
    judge_step,
)
from trainer_sidecar.guardian.loading import Accumulation, Loading
from trainer_sidecar.guardian.localize import NaNLocator
from trainer_sidecar.guardian.measure import StepMeasure
from trainer_sidecar.guardian.pipeline import StepOutcome, StepPipeline
from trainer_sidecar.guardian.progress import ProgressClock
from trainer_sidecar.guardian.recovery import Recovery
from trainer_sidecar.guardian.reporting import StatusReporter
from trainer_sidecar.guardian.shutdown import Shutdown
from trainer_sidecar.guardian.starting import Start
from trainer_sidecar.guardian.status_view import StatusView
from trainer_sidecar.guardian.stopping import STOP
from trainer_sidecar.guardian.training import TrainingObjects, caller, check_loss, check_training_objects
from trainer_sidecar.guardian.watch import ActivityWatch

log = logging.getLogger("trainguard")

__all__ = ["ConfigError", "Diverged", "Fenced", "Guardian", "StepOutcome", "UncleanState"]


def _step_number(name: str, value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"{name} must be a step number (an integer of at least 0), got {value!r}")
    return value


class Guardian:
    """Guards one worker's training loop: finite checks, clipping, spikes, rollback, checkpoints, status.

    Promises: a non-finite or spiking step never reaches the weights; every rank takes the same
    decision; a state is saved (snapshot or checkpoint) only when every value in it is finite, and a
    checkpoint only counts once durable; on start the newest valid checkpoint (agreed by all ranks) is
    restored with the exact data position.

    Configuration comes from ``config`` when given (nothing is read from the environment), else from the
    orchestrator's ``TRAINGUARD_*`` variables (``GuardianConfig.from_env``) and the explicit
    ``checkpoint_dir``, ``settings`` and ``status_file`` arguments, which must agree with them. With
    ``resume`` (the default) the constructor ends by restoring the newest valid checkpoint (``resume``).

    ``max_steps`` declares the end of the run (as ``steps(max_steps)`` and ``run(loader, max_steps)``
    do): the step that reaches it is checkpointed on every rank, a step boundary past it is refused (no
    update, no count, no checkpoint: a finished job rerun trains nothing), and at interpreter exit the
    worker is reported finished if it was reached, or exits 1 if it was not (see ``_at_exit``).
    ``start_step`` says the loop continues an earlier run of its own at that step (it loaded its own
    checkpoint); it applies only while the guardian has no checkpoint of its own (``resume``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        scaler: torch.amp.GradScaler | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        settings: GuardianSettings | None = None,
        status_file: str | os.PathLike[str] | None = None,
        accumulation_steps: int = 1,
        validate: Callable[[], float] | None = None,
        resume: bool = True,
        config: GuardianConfig | None = None,
        max_steps: int | None = None,
        start_step: int | None = None,
    ) -> None:
        try:
            if config is None:
                config = GuardianConfig.from_env(
                    settings=settings, checkpoint_dir=checkpoint_dir, status_file=status_file
                )
            check_training_objects(model, optimizer, scheduler, scaler)
            if (
                isinstance(accumulation_steps, bool)
                or not isinstance(accumulation_steps, int)
                or accumulation_steps < 1
            ):
                raise ConfigError(
                    f"accumulation_steps must be an integer of at least 1, got {accumulation_steps!r}"
                )
            self._wire(model, optimizer, scheduler, scaler, config, accumulation_steps, validate)
            self.max_steps = _step_number("max_steps", max_steps)
            self._start = Start(
                *(self.settings, self.training, self.counters, self.checkpoints),
                *(self._recovery, self._reporter, _step_number("start_step", start_step)),
            )
            self._view = StatusView(
                *(self.config, self.gang, self.counters, self.feed, self.checkpoints),
                (self._life, self._busy, self._watch, self._activity, self._compute, self._progress),
                (self._pipeline, self._start),
                self.started_at,
            )
            self._open_checkpoints()
            self._publish(force=True)
            if resume:
                self.resume()
            elif start_step is not None:
                self._start.continue_at(start_step)
        except ConfigError as exc:
            report_config_error(config, exc)
            end_worker(Gang.current(), ExitCode.CONFIG_ERROR, exc)
        self._begin()

    # ------------------------------------------------------------------------------------- set-up ---
    def _wire(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        scaler: torch.amp.GradScaler | None,
        config: GuardianConfig,
        accumulation_steps: int,
        validate: Callable[[], float] | None,
    ) -> None:
        self.config = config
        self.settings = config.settings
        # Where the training thread is: marked at the guardian's calls, published with the status.
        self._activity = ActivityTracker(Activity.CHECKPOINT)
        self._mark = self._activity.mark
        # Each step's own compute (the marks' sum of own work between boundaries), kept in memory.
        self._compute = ComputeWindow(config.settings.compute_window_steps)
        self.gang = replace(Gang.current(), tracker=self._activity)
        # The phase, message and exit code the status publishes; whether the worker ended.
        self._life = Lifecycle()
        self._loop_state()
        self._reporter = StatusReporter(
            config.status_file,
            config.settings.status_interval_seconds,
            config.termination_message_path,
            self.status,
            self._activity,
        )
        self._end = WorkerEnd(self._life, self.gang, self._reporter)
        self.training = TrainingObjects(model, optimizer, scheduler, scaler, refuse=self._end.misused)
        self.model, self.module, self.optimizer = model, self.training.module, optimizer
        self.accumulation_steps = accumulation_steps
        self.validate = validate
        self.counters = GuardCounters(max_grad_norm=config.settings.guard.max_grad_norm)
        self.feed = DataFeed()
        self._locator = NaNLocator(self.module)
        self._busy = BusySections()
        self.checkpoint_dir = config.checkpoint_dir
        self._collaborators(config, validate)

    def _collaborators(self, config: GuardianConfig, validate: Callable[[], float] | None) -> None:
        """The collaborators that work on the training objects, the counters and the status parts."""
        self.checkpoints = CheckpointManager(
            config.checkpoint_dir,
            config.settings.checkpoint,
            self.gang,
            self.training,
            self.feed,
            self.counters,
            self._stop,
            (config.restarts, config.run_seconds),
        )
        self.dead_letters = DeadLetters(
            self.checkpoint_dir / DEAD_LETTER_NAME if self.checkpoint_dir else None
        )
        self._faults = FaultInjector(config.faults, self.gang.rank, self.checkpoint_dir)
        self._loading = Loading(
            self.feed, self.dead_letters, self._faults, self.counters, self.gang, self._mark, self._acc
        )
        self._meter = StepMeasure(self.training, self.checkpoints, self._faults, self._mark, self.gang)
        self._step_collaborators(config, validate)

    def _step_collaborators(self, config: GuardianConfig, validate: Callable[[], float] | None) -> None:
        """The collaborators of the step, its recovery, the watch and the ending."""
        status = (self._life, self._reporter, self._progress, self._busy)
        self._recovery = Recovery(
            *(config.settings, self.training, self.counters, self.feed, self.dead_letters),
            *(self.checkpoints, self._end, status, self._mark, validate),
        )
        self._pipeline = StepPipeline(
            *(config.settings, self.training, self.counters),
            (self._meter, self._recovery, self.checkpoints, self._locator, self._faults),
            (self.feed, self.dead_letters, self._acc),
            (self._life, self._reporter, self._progress, self._activity, self._compute),
            self.gang,
        )
        self._watch = ActivityWatch(
            self._activity, self._busy, self.counters, self._life, self.module, self._reporter, self._progress
        )
        ending = (self._life, self._reporter, self._watch, self._busy, self._activity)
        self._shutdown = Shutdown(
            self.checkpoints, self._recovery, self.counters, self._end, ending, self._stop
        )

    def _loop_state(self) -> None:
        """The state of the loop the guardian follows: its step, its data, its stop and what the activity
        watch infers; set once at construction, before anything reads it."""
        self.started_at = time.time()
        self._progress = ProgressClock()  # the only writer of progress time (``last_step_time``)
        self._acc = Accumulation()  # the step being accumulated (its micro-batches so far)
        self._epoch_loop: EpochLoop | None = None  # the loop iterates ``epochs`` and ``batches``
        self._adoption_checked = False  # see ``_check_adoption``
        self._stop = STOP

    def _open_checkpoints(self) -> None:
        job = job_identity(self.config.namespace, self.config.job)  # namespace/name: what makes it unique
        owner = EpochOwner(job=job, attempt=self.config.attempt)
        self.checkpoints.open(owner, self.model)
        if self.checkpoints.enabled:
            self.dead_letters.load()

    def _begin(self) -> None:
        if not self._recovery.snapshot.taken:
            self._recovery.take_snapshot()  # the starting weights: the first a rollback can return to
        self._recovery.apply_orchestrator_remediation(self.config.remediation)
        self._shutdown.hold_stop()
        if self.gang.distributed:
            self._busy.watch_peers(self.rank, self._watch.peer_changed)
        self.phase = Phase.RUNNING
        self._mark(Activity.LOOP)  # the loop's code runs next
        self._publish(force=True)
        self._watch.begin(threading.get_ident())  # the training thread calls _begin
        self._reporter.watch_activity(lambda: self._life.phase, look=self._watch.look)
        self._shutdown.watch(self._at_exit)  # and the loop's own collectives mark their waits from here on

    # ---------------------------------------------------------------------------------------- busy ---
    @contextmanager
    def busy(self, reason: str, seconds: float | None = None) -> Iterator[None]:
        """Mark a section that makes no training step (an evaluation, a save of the loop's own) as busy,
        so that it is not mistaken for a hang: the sidecar allows it ``seconds`` (at most its startup
        grace; the grace when not given) instead of the hang timeout, so a real hang inside it is still
        caught. Peers that wait for this rank meanwhile (in their next collective) report themselves
        busy too. Sections nest (at most ``MAX_BUSY_SECTIONS`` open): each is measured from its own
        start, and an outer section's bound still ends everything inside it (see
        ``trainer_sidecar.contract.allowance``). Each rank enters its own (``with guardian.busy("eval"):``
        around the evaluation only rank 0 runs is enough). Usable as a decorator as well."""
        with self._adoption():
            section = self._busy.enter(reason, seconds)
        with held(self._busy, section, self._mark, lambda: self._publish(force=True), self._progress):
            yield

    # --------------------------------------------------------------------------- counters, compat ---
    @property
    def rank(self) -> int:
        """This process's rank in the job (0 without a process group)."""
        return self.gang.rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the job (1 without a process group)."""
        return self.gang.world_size

    @property
    def phase(self) -> Phase:
        """The worker's phase, as its status publishes it."""
        return self._life.phase

    @phase.setter
    def phase(self, phase: Phase) -> None:
        self._life.phase = phase

    @property
    def message(self) -> str:
        """The status's message (a held-out loss, why the worker ended)."""
        return self._life.message

    @message.setter
    def message(self, message: str) -> None:
        self._life.message = message

    @property
    def exit_code(self) -> int | None:
        """The exit code the worker ends with, once it is known."""
        return self._life.exit_code

    @property
    def max_steps(self) -> int | None:
        """The run's declared last step (None: not declared): see ``Guardian``."""
        return self.checkpoints.last_step

    @max_steps.setter
    def max_steps(self, max_steps: int | None) -> None:
        self.checkpoints.last_step = max_steps  # the checkpoint of the last step keeps the generators

    @property
    def last_grad_norm(self) -> float | None:
        """The newest step's gradient norm (None before the first)."""
        return self._pipeline.last_grad_norm

    @property
    def nan_location(self) -> str | None:
        """The module whose output went non-finite first, once the localisation found it."""
        return self._pipeline.nan_location

    @property
    def resumed_step(self) -> int:
        """The step this attempt started at (0: a fresh start)."""
        return self._start.resumed_step

    @property
    def busy_since(self) -> float | None:
        """When the rollback under way began (unix seconds; None: none)."""
        return self._life.busy_since

    @property
    def last_step_time(self) -> float | None:
        """When the worker last made progress (unix seconds; None before its first step)."""
        return self._progress.last

    @property
    def step_count(self) -> int:
        """Steps kept in the model (a rollback reverts it)."""
        return self.counters.step

    @property
    def iterations(self) -> int:
        """Every step boundary ever attempted (never reverts)."""
        return self.counters.iterations

    @property
    def optimizer_steps(self) -> int:
        """Optimizer updates kept in the model."""
        return self.counters.optimizer_steps

    @property
    def skipped_steps(self) -> int:
        """Steps skipped over the job."""
        return self.counters.skipped_steps

    @property
    def spikes(self) -> int:
        """Loss and gradient-norm spikes over the job."""
        return self.counters.spikes

    @property
    def rollbacks(self) -> int:
        """Rollbacks over the job."""
        return self.counters.rollbacks

    @property
    def lr_scale(self) -> float:
        """The factor the remediation applied to the learning rates (1: none)."""
        return self.counters.lr_scale

    @property
    def max_grad_norm(self) -> float | None:
        """The clipping norm in force (None: no clipping, the default; tightened by remediation)."""
        return self.counters.max_grad_norm

    @property
    def losses(self) -> list[float]:
        """The finite losses of the recent kept steps, oldest first."""
        return list(self.counters.history.losses)

    @property
    def last_loss(self) -> float | None:
        """The loss of the newest kept step."""
        return self.counters.last_loss

    # ---------------------------------------------------------------------------------------- data ---
    def loader(
        self,
        dataset: SizedDataset | DataLoader[Any],
        *,
        batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        drop_last: bool = True,
    ) -> GuardedLoader:
        """A GuardedLoader for this worker's rank, positioned where the resumed checkpoint left off.

        ``dataset`` is a map-style dataset, or a ``torch.utils.data.DataLoader`` over one, whose batch size,
        shuffling, collate function and workers are taken over (``loader = guardian.loader(loader)``),
        and which trains the samples it would: its last partial batch unless its ``drop_last``, the
        ranks' shards evened out as its DistributedSampler does (or would, by default). For a dataset,
        ``drop_last`` (the default) drops each epoch's partial last batch and the last samples that do
        not share out evenly over the ranks.
        """
        with self._adoption():
            return self._loading.guarded(
                dataset, batch_size, shuffle, seed, collate_fn, num_workers, drop_last, {}, False
            )

    def track(self, name: str | None = None, stateful: Stateful | None = None, **named: Stateful) -> None:
        """Keep ``stateful`` (anything with ``state_dict`` and ``load_state_dict``: torchdata's
        StatefulDataLoader, a sampler or a data stream of the loop's own) in every checkpoint, in this
        rank's own file, and restore it on resume, so a loop's own data resumes exactly where it was.
        Several at once by keyword: ``track(scheduler=scheduler, best=Variables(globals(), "best_acc1"))``.
        Raises ConfigError at once when its state cannot be checkpointed (only dicts, lists, tuples, str,
        int, float, bool, None and tensors can)."""
        with self._adoption():
            if (name is None) != (stateful is None) or (name is None and not named):
                raise ConfigError("guardian.track(name, stateful) or guardian.track(name=stateful, ...)")
            if name is not None and stateful is not None:
                named = {name: stateful, **named}
            for key, value in named.items():
                self.feed.track(key, value)

    def attach_loader(self, loader: GuardedLoader) -> None:
        """Keep ``loader``'s position in checkpoints (and restore a resumed position into it)."""
        self.feed.attach(loader)

    def steps(self, max_steps: int | None = None) -> Iterator[int]:
        """Yield the number of the step to train, ``step_count``, until ``max_steps`` steps are kept;
        then ``finish`` (the final checkpoint, ``finished``). For a loop that draws its own batches::

            for iter_num in guardian.steps(max_iters):   # was: while iter_num < max_iters: ... iter_num += 1
                lr = get_lr(iter_num)
                ...
                guardian.step()

        The number is the guardian's, so it cannot drift from the model: after a rollback it goes back
        with the weights (63 then 60), the learning-rate schedule follows, and the loop ends with exactly
        ``max_steps`` steps kept. A resumed job starts at its checkpoint's step; a finished one yields
        nothing. Each iteration must reach one step boundary (``step``): one that does not raises
        RuntimeError. ``max_steps`` defaults to the one given to the constructor; it declares the end
        (see ``Guardian``). Should the final state not be clean, the guardian rolls back and goes on.
        """
        end = self._declare_end(max_steps)
        self._recovery.driven = True  # the loop iterates ``steps`` or ``run``: the counter is the guardian's
        while True:
            while self.counters.step < end:
                before = self.counters.iterations
                yield self.counters.step
                if self.counters.iterations == before:
                    raise RuntimeError(
                        "an iteration of guardian.steps() reached no step boundary "
                        f"(step {self.counters.step}): call guardian.step() once per iteration"
                    )
            try:
                self.finish()
                return
            except UncleanState as exc:
                log.warning("%s; training on", exc)

    def _declare_end(self, max_steps: int | None) -> int:
        """The run's last step, from the argument or the constructor's ``max_steps`` (which must agree)."""
        max_steps = _step_number("max_steps", max_steps)
        if max_steps is None:
            if self.max_steps is None:
                raise TypeError("Guardian.steps() needs max_steps (here or in Guardian(..., max_steps=N))")
            return self.max_steps
        if self.max_steps is not None and self.max_steps != max_steps:
            raise ConfigError(
                f"max_steps={max_steps} here, but Guardian(..., max_steps={self.max_steps}): "
                "a run has one end"
            )
        self.max_steps = max_steps
        return max_steps

    def run(self, loader: GuardedLoader | DataLoader[Any], max_steps: int) -> Iterator[Any]:
        """Yield batches (one per micro-step) until ``max_steps`` steps are kept, then ``finish``.

        Epochs follow one another; a resumed job starts at the exact next batch, a finished one yields
        nothing. A DataLoader is taken over first (``loader``). ``max_steps`` declares the end as the
        constructor's does. Should the final state not be clean, the guardian rolls back and training
        goes on until it is.
        """
        max_steps = self._declare_end(max_steps)
        self._recovery.driven = True  # the loop iterates ``steps`` or ``run``: the counter is the guardian's
        if isinstance(loader, DataLoader):
            loader = self.loader(loader)
        if self.feed.loader is not loader:
            self.feed.attach(loader)
        while True:
            yield from self._loading.batches_until(loader, max_steps)
            try:
                self.finish()
                return
            except UncleanState as exc:
                log.warning("%s; training on", exc)

    def epochs(self, epochs: int, start: int = 0) -> Iterator[int]:
        """Yield the epochs to run, ``start`` (the loop's own resume, used while the guardian has no
        checkpoint of its own) to ``epochs - 1``, then ``finish``; with ``batches`` inside::

            for epoch in guardian.epochs(args.epochs, start=args.start_epoch):  # was: range(start, epochs)
                sampler.set_epoch(epoch)
                train(guardian.batches(train_loader))   # was: train(train_loader)
                validate(...); scheduler.step(); save(...)

        The end of the data is the end of training (the step count does not decide it). A resume starts
        at the checkpoint's epoch and batch; a finished job yields nothing (or only its last epoch's end
        again, from the state before it). After a rollback into an earlier epoch, the loop's next epoch
        end is that epoch's, from its state before (a tracked scheduler and best score went back with
        the weights), and the epochs after it come again, without the batches already consumed
        (``trainer_sidecar.guardian.epochs``)."""
        self._recovery.driven = True  # the loop iterates ``epochs``: the counter is the guardian's
        loop = self._epochs()
        while True:
            yield from loop.epochs(epochs, start)
            try:
                self.finish()
                return
            except UncleanState as exc:
                log.warning("%s; training on", exc)

    def batches(self, loader: DataLoader[Any]) -> Iterator[Any]:
        """Yield the batches of the loop's own training ``loader`` that the current epoch of ``epochs``
        has not consumed, as the loader makes them (its sampler, ``set_epoch``, collate and workers): all
        of them in an epoch begun afresh, bit for bit the loop's own iteration; in a resumed epoch from
        the next batch on, skipped by index without loading one; never a dead-lettered batch. Raises
        ConfigError outside ``epochs`` or when called twice in one epoch (an evaluation iterates its own
        loader). An epoch's data that runs out waits for a checkpoint still in flight, so a crash in the
        evaluation that follows resumes from it."""
        return self._epochs().batches(loader)

    def _epochs(self) -> EpochLoop:
        if self._epoch_loop is None:
            self._epoch_loop = EpochLoop(
                self.feed.track,
                lambda epoch, batch: self.dead_letters.is_dead(epoch, batch),
                lambda epoch, batch: setattr(self._acc, "current", BatchRef(epoch, batch)),
                self._epoch_data_done,
            )
        return self._epoch_loop

    def _epoch_data_done(self) -> None:
        if not self.checkpoints.writing:
            return
        with self.busy("checkpoint: the epoch's last write"):
            try:
                self.checkpoints.wait()
            except FencedError as exc:
                self._end.fenced(exc)
            except CheckpointError as exc:
                log.error("the checkpoint written at the end of an epoch's data failed: %s", exc)

    # ---------------------------------------------------------------------------------------- step ---
    @noting_escapes
    def backward(self, loss: torch.Tensor) -> None:
        """Backward one micro-batch's ``loss``: exactly what the loop would call ``.backward()`` on.

        The guardian never rescales a loss: under gradient accumulation, divide by the number of
        micro-batches where the loop already does (or not, as it does not), and the gradients are the
        ones the loop had without the guardian. The loss is scaled by the GradScaler when there is one.
        Call ``step()`` at the accumulation boundary. A loss of one element in any shape and floating
        dtype is taken as its scalar; anything else ``loss.backward()`` would refuse (more elements, an
        integer tensor, one that does not require grad, no tensor) is a configuration error (exit code 2)
        naming the loop's line and the reason.
        """
        with self._adoption():
            check_loss(loss)
        if self._acc.micro == 0 and self._faults.active:
            # An injected hang or crash stands for one in the loop's forward pass: before the backward.
            loss = self._faults.loss_hook(loss, self.counters.step)
        self._mark(Activity.BACKWARD)
        with self._adoption():
            self.training.backward(loss)
        self._meter.after_backward()
        # A one-element loss of any shape ([1] from a loop's own reduction) is its scalar: the step's
        # measures are stacked with 0-dim tensors.
        detached = loss.detach().float().reshape(())
        acc = self._acc
        acc.loss_sum = detached if acc.micro == 0 or acc.loss_sum is None else acc.loss_sum + detached
        if acc.current is not None:
            acc.batches.append(acc.current)
        acc.micro += 1
        self._mark(Activity.LOOP)

    @noting_escapes
    def step(self, loss: torch.Tensor | None = None, replay: Callable[[], Any] | None = None) -> StepOutcome:
        """Check, clip and step the optimizer (or skip the update, or roll back) at a step boundary.

        With a ``loss``, it is first given to ``backward``, and with ``accumulation_steps=k`` only every
        k-th call is a boundary. Without one, the micro-batches given to ``backward`` since the last step
        make the step (a loop keeps its own accumulation). The step's loss, as reported and judged, is the
        sum of those micro-batch losses. ``replay`` optionally re-runs this step's forward pass; on the
        first non-finite loss it is used to name the module whose output went non-finite first.
        """
        if loss is not None:
            self.backward(loss)
            if self._acc.micro < self.accumulation_steps:
                return StepOutcome(boundary=False)
        elif self._acc.micro == 0:
            self._refuse_step_without_backward()
        self._mark(Activity.STEP)
        self._acc.micro = 0
        if self.max_steps is not None and self.counters.step >= self.max_steps:
            return self._pipeline.past_the_end(self.max_steps)
        if self._faults.active:
            self._pipeline.slow_down()
        if not self._adoption_checked:
            self._check_adoption()
        if self.checkpoints.fenced is not None:
            self._end.fenced(self.checkpoints.fenced)  # a save in the background met a newer writer's claim
        assert self._acc.loss_sum is not None
        self._recovery.step_begins()
        stop = self._stop.requested or self.checkpoints.stop_deferred
        agreed = self._meter.measure(self._acc.loss_sum, self.counters.step, stop)
        reading = agreed.reading
        verdict = judge_step(self.settings.guard, self.counters.history, reading)
        batches, self._acc.batches = self._acc.batches, []
        if verdict.action is Action.APPLY:
            when = (agreed.checkpoint_due, self.max_steps)
            outcome = self._pipeline.apply(verdict, reading, agreed.current_norm, batches, when)
        else:
            outcome = self._pipeline.reject(verdict, reading, batches, replay, agreed.locally_nonfinite)
        self._busy.progressed()
        self.checkpoints.boundary()
        # After this boundary's checkpoint decision, so that the next forward pass foresees the new cadence.
        self.checkpoints.adopt(agreed.interval)
        if agreed.stop:
            if agreed.rng_missing and self.checkpoints.enabled and not self.checkpoints.stop_deferred:
                # Some rank's last forward pass did not keep the random generators (the signal came after
                # it): every rank keeps them at the next one, and the gang stops at the next boundary, so
                # that the checkpoint resumes a loop that draws its batches from them exactly.
                self.checkpoints.stop_deferred = True
            else:
                self._shutdown.stop_now()
        self._mark(Activity.LOOP)
        self._compute.lap(self._activity.own)
        return outcome

    def _refuse_step_without_backward(self) -> None:
        """``step()`` without a loss and no ``backward(loss)`` since the last step: the loop backwards its
        loss itself (still ``loss.backward()``), or forgot it. Either way the guardian saw no loss to judge
        (and no GradScaler scaled it): a configuration error naming the loop's line."""
        backwarded = any(p.grad is not None for p in self.training.params)
        what = (
            "the gradients come from the loop's own loss.backward()"
            if backwarded
            else "no backward pass ran since the last step"
        )
        with self._adoption():
            raise ConfigError(
                f"guardian.step() without a loss ({caller()}) but no guardian.backward(loss) since the last "
                f"step: {what}. Replace the loop's loss.backward() (or scaler.scale(loss).backward()) with "
                "guardian.backward(loss), or pass the loss: guardian.step(loss)"
            )

    @contextmanager
    def _adoption(self) -> Iterator[None]:
        """A ConfigError inside (a misuse of the guardian's API) is published as the worker's final status
        (phase failed, exit code 2) before it propagates."""
        try:
            yield
        except ConfigError as error:
            self._end.misused(error)

    def _check_adoption(self) -> None:
        """At the first step boundary, when the loop has given the guardian all it will: refuse a loop
        whose own learning-rate scheduler checkpoints would not keep."""
        self._adoption_checked = True
        try:
            self.training.check_scheduler_kept(self.feed.tracked)
        except ConfigError as error:
            self._end.misused(error)

    def settle(self) -> None:
        """Wait until the snapshot and checkpoint copies running in the background have read the state.

        The guardian copies parameters and optimizer state while the next forward and backward passes
        run, and waits only before the next optimizer step. A loop that changes parameters or optimizer
        state in place between steps (weight clamping, a manual re-initialisation) calls this first; on
        a GPU the current stream waits, not the host. A loop that does not is noticed at the next step
        (by the tensors' version counters): nothing torn is kept, and copies are synchronous after."""
        self._recovery.settle()

    def save_checkpoint(self) -> bool:
        """Start an asynchronous checkpoint of the current step if the whole state is clean.

        Returns False without a checkpoint directory, or when the state is not clean (then the guardian
        rolled back, or diverged). Every rank must call it at the same step (it agrees collectively).
        """
        return self._recovery.save_checkpoint()

    # ------------------------------------------------------------------------------------- resume ---
    def resume(self) -> int | None:
        """Restore the newest checkpoint every rank can load (weights, optimizer, scheduler, scaler, RNG,
        data position, counters); returns its step, or None for a fresh start.

        A checkpoint that turns out not to load (damaged after it was verified, counters or RNG state
        malformed) is skipped for the next older one, on every rank alike (``guardian.resume``). A
        checkpoint of another model or optimizer is a configuration error (nothing is deleted).

        With no checkpoint of its own and the constructor's ``start_step=N``, the run continues at step N
        (``Start.continue_at``) and None is returned. Once the guardian has a checkpoint of its own,
        ``start_step`` is not used: that checkpoint holds weights, optimizer, data position, random
        generators and counters together, and overwrites what the loop loaded (a warning names both
        steps when they differ).
        """
        return self._start.resume()

    # ------------------------------------------------------------------------------------- status ---
    def status(self) -> WorkerStatus:
        """The worker's current status, as published to the sidecar."""
        return self._view.status()

    def _publish(self, force: bool = False) -> None:
        self._reporter.publish(self.phase, force)

    def finish(self) -> None:
        """Write a final checkpoint (if not already written and the state is clean), wait for every
        write, and publish ``finished``.

        ``steps`` and ``run`` call it when their last step is kept, and so does interpreter exit when the
        loop ends otherwise (``_at_exit``): a loop calls it itself only to end before ``max_steps`` (early
        stopping). Raises UncleanState (after rolling back) when the final state is not finite: the job
        is not done.
        """
        self._shutdown.finish()

    def close(self) -> None:
        """Wait for a checkpoint in flight without marking the job finished (for interrupted loops)."""
        self._shutdown.close()

    def _at_exit(self, crashed: bool) -> None:
        """The interpreter exits and the loop neither finished nor closed the guardian (``Shutdown.at_exit``:
        the hook is armed on the guardian, held weakly, so a guardian dropped earlier is never touched)."""
        self._shutdown.at_exit(crashed)

"""Checkpoint cadence, saving and resume for one rank: the guardian's checkpoint manager.

``CheckpointManager`` owns this rank's view of the clean-checkpoint ring (``trainer_sidecar.checkpoint``):
the epoch the gang claimed, when a checkpoint is due (every ``every_steps`` steps, or ``every_seconds`` as
the gang agreed; with ``every_steps: auto`` the interval rank 0 chose from the measured save stall and step
time by the Young-Daly rule, ``contract.cadence``, as the gang agreed), what a checkpoint holds (the
training objects, the data position, the counters and the random generators as of the last forward
pass), writing it in the background, and on start restoring the newest checkpoint every rank can load.
Whether a state is clean enough to save is the guardian's call (the step judge); the manager is told only
to save.

Without a checkpoint directory the manager is inert: nothing is due, nothing is saved, nothing resumes.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from trainer_sidecar.checkpoint import (
    CheckpointError,
    CheckpointId,
    CheckpointStore,
    EpochOwner,
    FencedError,
)
from trainer_sidecar.contract.cadence import CadenceChoice, choose_interval
from trainer_sidecar.contract.env import CHECKPOINT_DIR_ENV
from trainer_sidecar.contract.settings import CheckpointPolicy
from trainer_sidecar.contract.status import CheckpointRef
from trainer_sidecar.guardian.config import ConfigError
from trainer_sidecar.guardian.counters import CountersError, GuardCounters
from trainer_sidecar.guardian.feed import DataFeed
from trainer_sidecar.guardian.gang import Gang
from trainer_sidecar.guardian.resume import NewestRestorable, claim_gang_epoch
from trainer_sidecar.guardian.stopping import StopRequest
from trainer_sidecar.guardian.training import StateMismatch, TrainingObjects
from trainer_sidecar.tensors.rng import RngStateError, rng_state, set_rng_state

log = logging.getLogger("trainguard")

__all__ = ["CheckpointManager", "FencedError"]


class CheckpointManager:
    """One rank's checkpoints: claim, cadence, asynchronous saves, waiting, resume.

    Promises: a checkpoint holds everything a resumed run needs to continue bit for bit (training
    objects, data position, counters, random generators as they were before the next batch was drawn);
    ``checkpointed_step`` is the step of the last checkpoint started or resumed from, the same on every
    rank; a checkpoint of another model or optimizer is a ``ConfigError`` and deletes nothing. A newer
    writer's claim surfaces as ``FencedError`` from ``save``, ``wait`` and ``close`` (or as ``fenced``
    after a background write), for the guardian to end the worker.
    """

    def __init__(
        self,
        directory: Path | None,
        policy: CheckpointPolicy,
        gang: Gang,
        training: TrainingObjects,
        feed: DataFeed,
        counters: GuardCounters,
        stop: StopRequest,
        history: tuple[int, float] = (0, 0.0),
    ) -> None:
        self.directory = directory
        self.policy = policy
        self.gang = gang
        self.training = training
        self.feed = feed
        self._counters, self._stop = counters, stop
        self.store: CheckpointStore | None = None
        # The step of the last checkpoint started (or resumed from): the same on every rank, unlike what
        # each rank's store has seen complete, so decisions taken on it need no agreement.
        self.checkpointed_step: int | None = None
        self._clock = time.monotonic()  # when the last checkpoint started (for every_seconds)
        self._started_at: float | None = None  # wall-clock time the last background write started
        self._rng_after_forward: dict[str, Any] | None = None  # see ``_capture_rng``
        #: The run's declared last step (None: not declared yet), and whether the gang deferred a stop to
        #: keep the random generators: either makes the coming boundary checkpoint (``_rng_wanted``). The
        #: guardian sets both.
        self.last_step: int | None = None
        self.stop_deferred = False
        #: Capture at every forward pass: set once a checkpoint was written at a boundary no forward pass
        #: had foreseen (``save_checkpoint`` of the loop's own, a time cadence slower than predicted).
        self._rng_always = False
        self._boundary_at: float | None = None  # monotonic time of the last step boundary
        self._step_seconds = 0.0  # the last interval between step boundaries
        # everySteps auto. The interval every rank uses (None: not chosen yet in this attempt, the first
        # checkpoint comes after auto_first_seconds); rank 0's choice, which travels in the step's
        # collective (``proposal``, ``adopt``), so every rank changes it at the same boundary.
        self.interval: int | None = None if policy.every_steps == "auto" else int(policy.every_steps)
        self.choice: CadenceChoice | None = None
        self._proposal = 0
        self._reason = ""  # why the interval in force (rank 0's choice; other ranks only adopt it)
        self._step_mean = 0.0  # a moving mean of the step time (rank 0's numbers decide)
        self._stall_pending: float | None = None  # a save's synchronous part, until its copy is waited for
        self._stall = 0.0
        self._stalled = 0.0  # stall seconds since the last boundary
        #: This job's restarts and run time before this attempt (from the runner), for the failure rate.
        self.failures, self.run_seconds = history

    @property
    def enabled(self) -> bool:
        """Whether this rank writes checkpoints (a directory was given and claimed)."""
        return self.store is not None

    def open(self, owner: EpochOwner, model: torch.nn.Module) -> None:
        """Claim the gang's epoch of the directory and open the store (every rank together).

        Raises ConfigError naming the directory when it cannot be claimed or used."""
        if self.directory is None:
            log.warning(
                "no checkpoint directory (argument or %s): nothing survives a restart", CHECKPOINT_DIR_ENV
            )
            return
        try:
            claim = claim_gang_epoch(self.directory, self.gang, owner)
            self.store = CheckpointStore(
                self.directory,
                rank=self.gang.rank,
                world_size=self.gang.world_size,
                keep_clean=self.policy.keep_clean,
                epoch=claim.epoch,
            )
        except CheckpointError as exc:
            raise ConfigError(str(exc)) from exc
        if claim.damage is not None:
            # A start that found damage deletes nothing: what it passed over may be all that is left.
            self.store.hold_pruning(claim.damage)
        # Where a loop draws its own batches from the random generators, a resumed run draws the same
        # ones only if the generators are saved as they were before the next step's batch was drawn. A
        # loop that prefetches (draws the next batch after the forward pass, before the step ends) has
        # drawn it by the step boundary; after the last forward pass it has not: save them as of then.
        model.register_forward_hook(self._capture_rng)

    def _capture_rng(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        """After every forward pass: keep the generators' state when the coming boundary may save it, and
        forget an older one otherwise (a save then takes them as they are at the save). Reading them
        costs about 50 us to 0.35 ms (NumPy's state most of it), so this is not done at every step."""
        wanted = self._rng_always or self._time_near_due() or self._rng_wanted()
        self._rng_after_forward = rng_state() if wanted else None

    def _rng_wanted(self) -> bool:
        """Asked at every forward pass: whether the coming step boundary may write a checkpoint for
        which the random generators must be kept as of this forward pass: the step cadence's, a stop's
        (this rank was told to stop, or the gang deferred its stop to keep them), the run's last step.
        (The time cadence is foreseen by ``_time_near_due``.)"""
        step = self._counters.step
        return (
            self.may_save_after(step)
            or self._stop.requested
            or self.stop_deferred
            or (self.last_step is not None and step + 1 >= self.last_step)
        )

    @property
    def rng_captured(self) -> bool:
        """Whether the last forward pass kept the generators' state for a checkpoint."""
        return self._rng_after_forward is not None

    def may_save_after(self, step: int) -> bool:
        """Whether the step-count cadence writes a checkpoint at the boundary that follows ``step``."""
        return self.store is not None and self._steps_due(step + 1)

    def _steps_due(self, step: int) -> bool:
        """Whether the step cadence checkpoints ``step``: a multiple of a fixed interval, or (auto) the
        agreed interval since the last checkpoint."""
        if self.interval is None:
            return False
        if not self.policy.auto:
            return step % self.interval == 0
        return step - (self.checkpointed_step or 0) >= self.interval

    @property
    def _every_seconds(self) -> int | None:
        """The time cadence: ``every_seconds``, and before auto has chosen an interval at most
        ``auto_first_seconds`` (the first checkpoint measures what a save costs)."""
        every = self.policy.every_seconds
        if self.policy.auto and self.interval is None:
            first = self.policy.auto_first_seconds
            return first if every is None else min(every, first)
        return every

    def _time_near_due(self) -> bool:
        """Whether ``every_seconds`` may make the coming boundary checkpoint: within two step intervals (at
        least 10% of the period, and a second) of being due on this rank's clock, which every rank reset at
        the same boundary."""
        every = self._every_seconds
        if self.store is None or every is None:
            return False
        margin = max(1.0, 0.1 * every, 2 * self._step_seconds)
        return time.monotonic() - self._clock >= every - margin

    def boundary(self) -> None:
        """Note a step boundary (for the time cadence's margin, and auto's step time)."""
        now = time.monotonic()
        if self._boundary_at is not None:
            # A save's stall is not a step's work: the interval is counted in steps of work.
            self._step_seconds = max(0.0, now - self._boundary_at - self._stalled)
            mean = self._step_mean
            self._step_mean = self._step_seconds if mean == 0.0 else 0.8 * mean + 0.2 * self._step_seconds
        self._boundary_at = now
        self._stalled = 0.0

    # ------------------------------------------------------------------------------ auto cadence ---
    def proposal(self) -> int:
        """What this rank adds to the step's collective (a sum) for the auto interval: rank 0 its choice,
        every other rank 0, so the sum is rank 0's choice on every rank (0: none yet)."""
        return self._proposal if self.gang.rank == 0 else 0

    def adopt(self, agreed: int) -> None:
        """After a step boundary's checkpoint decision: take the interval the gang agreed on (the sum of
        the proposals, ``proposal``) for the boundaries that follow. Every rank calls it at the same
        boundary with the same number, so every rank checkpoints at the same steps."""
        if not self.policy.auto or agreed <= 0:
            return
        changed, self.interval = agreed != self.interval, agreed
        choice = self.choice
        if choice is not None and choice.steps == agreed:  # rank 0: the reason of the interval in force
            self._reason = choice.reason()
            if changed:
                log.info("checkpoint cadence %s", self._reason)

    def _measured_stall(self, seconds: float) -> None:
        """A save's stall of the training thread is known: rank 0 chooses the next interval from it."""
        self._stall = seconds
        if not self.policy.auto or self.gang.rank != 0:
            return
        policy = self.policy
        self.choice = choose_interval(
            seconds,
            self._step_mean,
            policy.auto_min_steps,
            policy.auto_max_steps,
            policy.assumed_mtbf_seconds,
            self.failures,
            self.run_seconds,
        )
        self._proposal = self.choice.steps

    @property
    def stall_seconds(self) -> float:
        """The last checkpoint's stall of the training thread (seconds): the synchronous part of the save
        and the wait for its background copy before the next optimizer step; 0 before the first."""
        return self._stall

    @property
    def cadence(self) -> str:
        """The checkpoint cadence and why, for the status."""
        if not self.policy.auto:
            return f"every {self.policy.every_steps} steps"
        if self.interval is None:
            return f"auto: first checkpoint after {self._every_seconds} s (measures the save's stall)"
        return self._reason or f"auto: every {self.interval} steps (chosen by rank 0)"

    # ---------------------------------------------------------------------------------- cadence ---
    def time_due(self) -> bool:
        """Whether ``every_seconds`` passed since this rank's last checkpoint (or start); any rank's clock
        makes the whole gang checkpoint at the same boundary (the guardian agrees it in the step's
        collective)."""
        every = self._every_seconds
        return self.store is not None and every is not None and time.monotonic() - self._clock >= every

    def due(self, step: int, time_due: bool) -> bool:
        """Whether a checkpoint is due after ``step`` (by steps, or by time as the gang agreed)."""
        return self.store is not None and (self._steps_due(step) or time_due)

    def saved(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` was started (or resumed from) already."""
        return self.checkpointed_step == step

    # ----------------------------------------------------------------------------------- saving ---
    def save(self, counters: GuardCounters, stable: Any, rank: int) -> None:
        """Start writing a checkpoint of the current (clean) state in the background.

        ``stable`` is the training objects' storage the copy may read while the loop goes on (None: copy
        synchronously). Raises FencedError when a newer writer claimed the directory."""
        assert self.store is not None, "save() without a checkpoint directory"
        started = time.monotonic()
        meta = {"loss": counters.last_loss, "state_finite": True, "clean": True}
        self._started_at = time.time()
        self.store.save_async(counters.step, self._state(counters, rank), meta, stable=stable)
        self.checkpointed_step = counters.step
        self._clock = time.monotonic()
        # The stall: this, and the next settle's wait for the background copy of what the step changes
        # (the forward and backward passes between them overlap the copy and are not counted).
        self._stall_pending = self._clock - started
        self._stalled += self._stall_pending

    def _state(self, counters: GuardCounters, rank: int) -> dict[str, Any]:
        rng = self._rng_after_forward
        if rng is None:
            # No forward pass foresaw this save: the generators as they are now (the same, unless the loop
            # drew from them after its last forward pass), and from now on kept at every forward pass.
            rng, self._rng_always = rng_state(), True
        state: dict[str, Any] = {"rng": rng, **self.feed.state()}
        if rank == 0:
            state.update(guardian=counters.to_state(), **self.training.state())
        else:
            state.update(self.training.shard_state())  # a sharded model's shards of this rank (else none)
        return state

    @property
    def fenced(self) -> FencedError | None:
        """The fencing a background write met (a newer writer's claim), if any."""
        return self.store.fenced if self.store is not None else None

    @property
    def writing(self) -> bool:
        """Whether a checkpoint is still being written in the background."""
        return self.store is not None and self.store.busy

    def settle(self) -> bool:
        """Wait until a background copy has read the state; True if the state changed under it."""
        if self.store is None:
            return False
        started = time.monotonic()
        changed = self.store.settle()
        if self._stall_pending is not None:
            waited = time.monotonic() - started
            self._stalled += waited
            self._measured_stall(self._stall_pending + waited)
            self._stall_pending = None
        return changed

    def wait(self) -> None:
        """Wait until every checkpoint started is durable (or failed). Raises FencedError."""
        if self.store is not None:
            self.store.wait()

    def close(self) -> None:
        """Wait for the writes in flight and stop the writer threads. Raises FencedError."""
        if self.store is not None:
            self.store.close()

    def newest_valid(self) -> int | None:
        """The step of the newest checkpoint that verifies on disk now (None: none, or no directory)."""
        return self.store.newest_valid() if self.store is not None else None

    @property
    def last_clean(self) -> CheckpointRef | None:
        """The newest checkpoint this rank saw become durable, as the status reports it."""
        return self.store.last_clean if self.store is not None else None

    @property
    def writing_since(self) -> float | None:
        """When the checkpoint write still in flight started (unix seconds), or None: none in flight."""
        return self._started_at if self.writing else None

    @property
    def last_write_seconds(self) -> float | None:
        """How long the last checkpoint took to become durable (None before the first)."""
        return self.store.last_write_seconds if self.store is not None else None

    # ----------------------------------------------------------------------------------- resume ---
    def resume(self, spike_window: int) -> tuple[CheckpointId, GuardCounters] | None:
        """Restore the newest checkpoint every rank can load into the training objects, the data feed and
        the random generators; its id and counters, or None for a fresh start.

        A checkpoint whose content turns out unusable (damaged after it was verified, counters or RNG
        state malformed) is passed over for the next older one, on every rank alike
        (``guardian.resume``). One of another model or optimizer is a ConfigError (nothing is deleted)."""
        if self.store is None:
            return None
        search = NewestRestorable(self.store, self.gang)
        counters: GuardCounters | None = None
        while (candidate := search.candidate()) is not None:
            counters = self._try_restore(candidate, spike_window)
            if search.restored(candidate, counters is not None):
                break
        resumed = search.done()
        if resumed.damaged:
            passed = "; ".join(resumed.passed_over) or "on another rank (see its log)"
            self.store.hold_pruning(f"this start passed over damaged checkpoints: {passed}")
        checkpoint = resumed.checkpoint
        if checkpoint is None:
            return None
        assert counters is not None  # every rank restored it, this one too
        self.checkpointed_step = checkpoint.step
        return checkpoint, counters

    def _try_restore(self, checkpoint: CheckpointId, spike_window: int) -> GuardCounters | None:
        """Load and apply one checkpoint; None (with the reason logged) when its content is unusable.

        Only what this rank holds is read: of a sharded model, its own box of every tensor, gathered
        from the shards of whatever world size wrote them."""
        assert self.store is not None
        try:
            with self.store.open(checkpoint) as state:
                counters = GuardCounters.from_state(state.get("guardian"), spike_window)
                if "rng" in state:
                    set_rng_state(state["rng"])
                self._load_training(checkpoint, state)
        except (CheckpointError, CountersError, RngStateError) as exc:
            log.error("checkpoint %s cannot be restored, trying an older one: %s", checkpoint.dir_name, exc)
            return None
        self.feed.restore(state)
        return counters

    def _load_training(self, checkpoint: CheckpointId, state: dict[str, Any]) -> None:
        try:
            self.training.load(state)
        except StateMismatch as exc:
            raise ConfigError(f"checkpoint {checkpoint.dir_name} under {self.directory} {exc}") from exc

"""The pure recovery policy, tested hard: examples for each rule, hypothesis for the invariants."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.support import causes
from trainer_sidecar.contract.exitcodes import ExitCode
from trainer_sidecar.contract.status import Activity, WorkerStatus
from trainguard.core.policy import (
    PEER_FAILURE_GRACE_SECONDS,
    Action,
    Decision,
    FailureKind,
    FailureSignature,
    Observation,
    RankObservation,
    backoff_seconds,
    classify,
    decide,
    killed_by_signal,
    lost_a_peer,
    same_cause,
    waiting_order,
)
from trainguard.core.spec import RecoverySpec

RECOVERY = RecoverySpec()
running = RankObservation


def gang(*ranks: RankObservation, attempt: int = 1, restarts: int = 0, handled: int = 0) -> Observation:
    return Observation(attempt=attempt, ranks=ranks, restarts=restarts, handled_attempt=handled)


def test_healthy_gang_continues() -> None:
    assert decide(RECOVERY, gang(running(0), running(1))).action is Action.CONTINUE


def test_all_ranks_exited_zero_is_success() -> None:
    decision = decide(RECOVERY, gang(running(0, exit_code=0), running(1, exit_code=0)))
    assert decision.action is Action.SUCCEED


def test_one_rank_done_while_another_runs_is_not_yet_success() -> None:
    assert decide(RECOVERY, gang(running(0, exit_code=0), running(1))).action is Action.CONTINUE


def test_crash_restarts_the_gang_after_the_first_backoff() -> None:
    decision = decide(RECOVERY, gang(running(0), running(1, exit_code=-9)))
    assert decision.action is Action.RESTART
    assert decision.delay_seconds == 10
    assert decision.failure is FailureKind.CRASH
    assert decision.rank == 1
    assert decision.remediation is None
    assert decision.restarts == 1
    assert "signal 9" in decision.reason


def test_hang_is_a_failure_of_the_unhealthy_rank() -> None:
    decision = decide(RECOVERY, gang(running(0), running(1, alive=False, reason="no step for 31 s")))
    assert decision.failure is FailureKind.HANG
    assert "no step for 31 s" in decision.reason


def test_divergence_explains_the_peers_that_crashed_with_it() -> None:
    decision = decide(RECOVERY, gang(running(0, exit_code=1), running(1, exit_code=ExitCode.DIVERGED)))
    assert decision.failure is FailureKind.DIVERGED
    assert decision.rank == 1
    assert decision.remediation == RECOVERY.on_divergence


def test_config_error_fails_at_once() -> None:
    decision = decide(RECOVERY, gang(running(0, exit_code=ExitCode.CONFIG_ERROR)))
    assert decision.action is Action.FAIL
    assert decision.failure is FailureKind.CONFIG


def test_lost_pod_restarts() -> None:
    assert decide(RECOVERY, gang(running(0, lost=True, alive=None))).failure is FailureKind.LOST


def test_already_handled_attempt_waits() -> None:
    observation = gang(running(0, exit_code=1), attempt=2, restarts=1, handled=2)
    assert decide(RECOVERY, observation).action is Action.WAIT


def test_exhausted_restarts_fail_with_the_last_reason() -> None:
    decision = decide(RECOVERY, gang(running(0, exit_code=1), attempt=6, restarts=5))
    assert decision.action is Action.FAIL
    assert "restarts exhausted (5 of 5)" in decision.reason
    assert "rank 0 crashed" in decision.reason


schedules = st.lists(st.integers(min_value=1, max_value=600), min_size=1, max_size=6).map(sorted)
rank_states = st.builds(
    RankObservation,
    rank=st.integers(0, 7),
    exit_code=st.one_of(st.none(), st.sampled_from([0, 1, 2, 137, 200, -9, -15])),
    alive=st.one_of(st.none(), st.booleans()),
    diverged=st.booleans(),
    lost=st.booleans(),
    ended_at=st.one_of(st.none(), st.integers(0, 3).map(float)),
)


@given(schedule=schedules, restarts=st.integers(0, 50))
def test_backoff_is_non_decreasing_and_capped(schedule: list[int], restarts: int) -> None:
    recovery = RecoverySpec(backoff_seconds=schedule)
    assert backoff_seconds(recovery, restarts) <= backoff_seconds(recovery, restarts + 1)
    assert backoff_seconds(recovery, restarts) <= max(schedule)
    assert backoff_seconds(recovery, restarts + len(schedule)) == max(schedule)


@settings(max_examples=200)
@given(
    max_restarts=st.integers(0, 8),
    schedule=schedules,
    history=st.lists(st.lists(rank_states, min_size=1, max_size=4), min_size=1, max_size=30),
)
def test_a_simulated_job_never_exceeds_max_restarts_and_ends_final(
    max_restarts: int, schedule: list[int], history: list[list[RankObservation]]
) -> None:
    recovery = RecoverySpec(max_restarts=max_restarts, backoff_seconds=schedule)
    attempt, restarts, handled = 1, 0, 0
    terminal: Action | None = None
    delays: list[float] = []
    for ranks in history:
        observation = Observation(attempt, ranks, restarts, handled, terminal)
        decision = decide(recovery, observation)
        if terminal is not None:
            assert decision.action is terminal  # success and failure are final
            continue
        if decision.action is Action.RESTART:
            assert decision.restarts == restarts + 1 <= max_restarts
            if decision.failure is FailureKind.DIVERGED:
                assert decision.remediation is not None
            delays.append(decision.delay_seconds)
            handled, restarts, attempt = attempt, decision.restarts, attempt + 1
        elif decision.action in (Action.SUCCEED, Action.FAIL):
            terminal = decision.action
    assert restarts <= max_restarts
    assert delays == sorted(delays)


@given(ranks=st.lists(rank_states, min_size=1, max_size=4), restarts=st.integers(0, 4))
def test_a_diverged_restart_always_carries_remediation(ranks: list[RankObservation], restarts: int) -> None:
    decision = decide(
        RECOVERY, Observation(attempt=restarts + 1, ranks=ranks, restarts=restarts, handled_attempt=restarts)
    )
    if decision.failure is FailureKind.DIVERGED and decision.action is Action.RESTART:
        assert decision.remediation == RECOVERY.on_divergence
    if decision.action is Action.RESTART and decision.failure is not FailureKind.DIVERGED:
        assert decision.remediation is None


def test_several_ranks_failing_alike_are_all_named() -> None:
    decision = decide(RECOVERY, gang(running(0, alive=False), running(1, alive=False), running(2)))
    assert decision.reason.startswith("ranks 0, 1 hung")


def test_of_ranks_that_crashed_the_one_that_ended_first_is_the_cause() -> None:
    # Rank 1 died; rank 0's collective then failed and it exited 1 a second later.
    decision = decide(
        RECOVERY, gang(running(0, exit_code=1, ended_at=11.0), running(1, exit_code=1, ended_at=10.0))
    )
    assert decision.rank == 1
    assert decision.reason == "rank 1 crashed first: exited with code 1; rank 0 too"


def test_ranks_that_ended_together_blame_the_one_killed_by_a_signal() -> None:
    decision = decide(
        RECOVERY, gang(running(0, exit_code=1, ended_at=10.0), running(1, exit_code=137, ended_at=10.0))
    )
    assert (decision.rank, decision.exit_code) == (1, 137)
    assert "signal 9" in decision.reason


#: Rank 0 of the FSDP example, whose peer was killed: what gloo raised in it, as its pod reported it.
GLOO_PEER_GONE = (
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
    "[10.244.0.7]:45213"
)


def test_a_rank_that_lost_its_peer_is_not_the_cause_even_when_it_ended_first() -> None:
    # The FSDP example on the real node: rank 1 was killed at step 33; rank 0's all-gather then failed
    # and its pod's end reached the operator first, a second ahead of rank 1's.
    decision = decide(
        RECOVERY,
        gang(
            running(0, exit_code=1, ended_at=10.0, reason=GLOO_PEER_GONE),
            running(1, exit_code=137, ended_at=11.0),
        ),
    )
    assert (decision.rank, decision.exit_code) == (1, 137)
    assert decision.reason == "rank 1 crashed: killed by signal 9; rank 0 too (after losing it as a peer)"


def test_a_lost_peer_waits_for_the_peers_own_exit_within_the_grace_then_is_named() -> None:
    rank0 = running(0, exit_code=1, ended_at=100.0, reason=GLOO_PEER_GONE)
    look = Observation(attempt=1, ranks=[rank0, running(1)], now=101.0)
    waiting = decide(RECOVERY, look)
    assert waiting.action is Action.WAIT
    assert waiting.rank is None
    assert "rank 0 failed for losing a peer" in waiting.reason
    # The peer's end arrives: it is named.
    ended = replace(look, ranks=[rank0, running(1, exit_code=137, ended_at=100.0)], now=101.5)
    assert decide(RECOVERY, ended).rank == 1
    # The peer never ends (hung, or its pod's end is lost): after the grace the effect is named.
    late = replace(look, now=100.0 + PEER_FAILURE_GRACE_SECONDS)
    assert (decide(RECOVERY, late).action, decide(RECOVERY, late).rank) == (Action.RESTART, 0)
    # An executor that does not say when it looked, and a gang with nobody left running: at once.
    assert decide(RECOVERY, replace(look, now=None)).rank == 0
    alone = replace(look, ranks=[rank0, running(1, exit_code=0, ended_at=99.0)])
    assert decide(RECOVERY, alone).rank == 0


def test_a_node_clock_ahead_of_the_executors_does_not_stretch_the_wait_past_twice_the_grace() -> None:
    rank0 = running(0, exit_code=1, ended_at=100.0, reason=GLOO_PEER_GONE)
    ahead = Observation(attempt=1, ranks=[rank0, running(1)], now=100.0 - PEER_FAILURE_GRACE_SECONDS)
    assert decide(RECOVERY, ahead).action is Action.RESTART


def test_a_crash_that_did_not_lose_a_peer_is_acted_on_at_once_beside_running_ranks() -> None:
    look = Observation(
        attempt=1,
        ranks=[running(0, exit_code=1, ended_at=100.0, reason="ValueError: bad"), running(1)],
        now=100.5,
    )
    assert decide(RECOVERY, look).action is Action.RESTART


def test_the_transports_peer_loss_messages_are_recognised_and_ordinary_errors_are_not() -> None:
    assert lost_a_peer(GLOO_PEER_GONE)
    assert lost_a_peer(
        "torch.distributed.DistBackendError: NCCL error: remote process exited or there was a network error"
    )
    assert lost_a_peer("RuntimeError: Connection reset by peer")
    assert not lost_a_peer("RuntimeError: CUDA out of memory")
    assert not lost_a_peer("exited with code 1")


peer_reasons = st.sampled_from(["", "ValueError: bad batch", GLOO_PEER_GONE, "NCCL: remote process exited"])


@settings(max_examples=400)
@given(
    ranks=st.lists(
        st.builds(
            RankObservation,
            rank=st.integers(0, 7),
            exit_code=st.one_of(st.none(), st.sampled_from([0, 1, 137])),
            reason=peer_reasons,
            ended_at=st.one_of(st.none(), st.integers(0, 3).map(float)),
        ),
        min_size=1,
        max_size=6,
        unique_by=lambda r: r.rank,
    )
)
def test_a_rank_that_lost_a_peer_is_blamed_only_when_every_crashed_rank_did(
    ranks: list[RankObservation],
) -> None:
    decision = decide(RECOVERY, gang(*ranks))
    if decision.failure is not FailureKind.CRASH:
        return
    blamed = next(r for r in ranks if r.rank == decision.rank)
    crashed = [r for r in ranks if classify(r) is FailureKind.CRASH]
    if lost_a_peer(blamed.reason):
        assert all(lost_a_peer(r.reason) for r in crashed)


@settings(max_examples=400)
@given(ranks=st.lists(rank_states, min_size=1, max_size=6, unique_by=lambda r: r.rank))
def test_the_rank_blamed_ended_no_later_than_any_rank_failing_alike(ranks: list[RankObservation]) -> None:
    decision = decide(RECOVERY, gang(*ranks))
    if decision.action not in (Action.RESTART, Action.FAIL) or decision.failure is not FailureKind.CRASH:
        return
    blamed = next(r for r in ranks if r.rank == decision.rank)
    crashed = [r for r in ranks if classify(r) is FailureKind.CRASH]
    assert blamed in crashed
    if blamed.ended_at is None:
        assert all(r.ended_at is None for r in crashed)
        return
    ended = [r.ended_at for r in crashed if r.ended_at is not None]
    assert blamed.ended_at == min(ended)
    tied = [r for r in crashed if r.ended_at == blamed.ended_at]
    if any(killed_by_signal(r.exit_code) for r in tied):
        assert killed_by_signal(blamed.exit_code)


def test_the_hang_of_a_gang_between_steps_names_guardian_busy() -> None:
    # A long evaluation without guardian.busy used to read "ranks 0, 1 hung" with no hint: the sidecar's
    # verdict carries it (trainer_sidecar.sidecar.health.OUTSIDE_STEPS_HINT), and the decision keeps it.
    from trainer_sidecar.sidecar.health import OUTSIDE_STEPS_HINT

    why = "no step for 31.0 s (hang timeout 30 s), last step 80" + OUTSIDE_STEPS_HINT
    decision = decide(
        RECOVERY, gang(running(0, alive=False, reason=why), running(1, alive=False, reason=why))
    )
    assert decision.action is Action.RESTART
    assert decision.reason.startswith("ranks 0, 1 hung: no step for 31.0 s")
    assert decision.reason.endswith('wrap that in guardian.busy("eval")')


def test_a_failures_reason_names_the_step_of_the_look_it_was_decided_on_and_carries_it() -> None:
    hung = running(1, alive=False, reason="no step for 3.1 s, last step 140")
    at = Observation(attempt=1, ranks=[running(0), hung], step=140)
    decision = decide(RECOVERY, at)
    assert decision.reason == "rank 1 hung at step 140: no step for 3.1 s, last step 140"
    assert decision.step == 140
    first = running(0, exit_code=1, ended_at=11.0), running(1, exit_code=1, ended_at=10.0)
    crashed = decide(RECOVERY, Observation(attempt=1, ranks=first, step=7))
    assert crashed.reason == "rank 1 crashed first at step 7: exited with code 1; rank 0 too"
    both = decide(RECOVERY, Observation(attempt=1, ranks=[running(0, alive=False), hung], step=9))
    assert both.reason.startswith("ranks 0, 1 hung at step 9: ")
    # Exhausted restarts keep the step in the last reason they quote; no step known: none named.
    exhausted = decide(RecoverySpec(max_restarts=0), at)
    assert (exhausted.action, exhausted.step) == (Action.FAIL, 140)
    assert exhausted.reason.endswith("last: rank 1 hung at step 140: no step for 3.1 s, last step 140")
    assert decide(RECOVERY, gang(running(0), hung)).step is None


# ------------------------------------------------------------------------- deterministic failures ---
def crashed_at(
    step: int | None, *, attempt: int, code: int = 1, why: str = "ValueError: bad shape"
) -> Observation:
    return Observation(
        attempt=attempt, ranks=[running(0, exit_code=code, reason=f"exited: {why}")], step=step
    )


def run_of_failures(
    recovery: RecoverySpec, failures: list[Observation]
) -> tuple[list[Decision], FailureSignature | None]:
    """Feed failures to the policy as an executor does: each attempt's observation carries the signature
    of the failure acted on before it; stops at the first final decision."""
    previous: FailureSignature | None = None
    restarts = 0
    decisions = []
    for attempt, failure in enumerate(failures, start=1):
        observation = replace(
            failure,
            attempt=attempt,
            restarts=restarts,
            handled_attempt=attempt - 1,
            previous_failure=previous,
        )
        decision = decide(recovery, observation)
        decisions.append(decision)
        if decision.action is not Action.RESTART:
            break
        previous, restarts = decision.signature, decision.restarts
    return decisions, previous


def test_the_same_crash_at_the_same_step_twice_fails_as_deterministic_with_the_evidence() -> None:
    first = decide(RECOVERY, crashed_at(1234, attempt=1))
    assert first.action is Action.RESTART
    assert first.signature == FailureSignature(
        FailureKind.CRASH, 1234, 1, "exited: ValueError: bad shape", attempt=1, repeats=1
    )
    second = decide(
        RECOVERY,
        replace(crashed_at(1234, attempt=2), restarts=1, handled_attempt=1, previous_failure=first.signature),
    )
    assert second.action is Action.FAIL
    assert second.failure is FailureKind.DETERMINISTIC
    assert second.signature is not None
    assert second.signature.repeats == 2
    assert second.reason == (
        "deterministic failure: attempts 1 and 2 failed alike at step 1234 (exited: ValueError: bad shape), "
        "so another restart would fail there too; not retried; "
        "last: rank 0 crashed at step 1234: exited: ValueError: bad shape"
    )
    assert (second.rank, second.exit_code, second.step) == (0, 1, 1234)


def test_a_crash_before_any_step_that_repeats_is_deterministic_too() -> None:
    # A missing file: the script fails before its first step, twice alike.
    decisions, _ = run_of_failures(
        RECOVERY, [crashed_at(None, attempt=0, why="FileNotFoundError: data.bin")] * 2
    )
    assert [d.action for d in decisions] == [Action.RESTART, Action.FAIL]
    assert "attempts 1 and 2 failed alike before any step was reported" in decisions[-1].reason


def test_a_crash_at_another_step_after_progress_is_transient() -> None:
    decisions, _ = run_of_failures(RECOVERY, [crashed_at(1234, attempt=0), crashed_at(1800, attempt=0)])
    assert [d.action for d in decisions] == [Action.RESTART, Action.RESTART]
    assert decisions[-1].signature is not None
    assert decisions[-1].signature.repeats == 1


def test_a_kill_by_a_signal_an_oom_kill_a_hang_or_a_lost_pod_never_is_deterministic() -> None:
    for ranks in (
        [running(0, exit_code=137, reason="OOMKilled")],
        [running(0, exit_code=-9)],
        [running(0, alive=False, reason="no step for 31 s")],
        [running(0, lost=True, alive=None, reason="node lost")],
    ):
        failures = [Observation(attempt=0, ranks=ranks, step=50)] * 4
        decisions, _ = run_of_failures(RecoverySpec(max_restarts=3), failures)
        assert [d.action for d in decisions] == [Action.RESTART] * 3 + [Action.FAIL], ranks
        assert "restarts exhausted" in decisions[-1].reason


def test_a_limit_of_0_turns_the_verdict_off_and_3_waits_for_a_third() -> None:
    same = [crashed_at(7, attempt=0)] * 6
    off, _ = run_of_failures(RecoverySpec(max_restarts=5, deterministic_failure_limit=0), same)
    assert len(off) == 6
    assert "restarts exhausted" in off[-1].reason
    three, _ = run_of_failures(RecoverySpec(max_restarts=5, deterministic_failure_limit=3), same)
    assert [d.action for d in three] == [Action.RESTART, Action.RESTART, Action.FAIL]
    assert "attempts 1, 2 and 3 failed alike at step 7" in three[-1].reason


def test_the_verdict_names_itself_even_when_restarts_run_out_at_the_same_time() -> None:
    decisions, _ = run_of_failures(RecoverySpec(max_restarts=1), [crashed_at(7, attempt=0)] * 2)
    assert decisions[-1].failure is FailureKind.DETERMINISTIC


def test_a_previous_failure_of_an_older_attempt_is_not_a_repeat() -> None:
    old = FailureSignature(FailureKind.CRASH, 7, 1, "exited: ValueError: bad shape", attempt=1)
    decision = decide(
        RECOVERY, replace(crashed_at(7, attempt=3), restarts=2, handled_attempt=2, previous_failure=old)
    )
    assert decision.action is Action.RESTART


failure_kinds = st.sampled_from(["crash", "signal", "hang", "lost", "diverged"])
failure_steps = st.one_of(st.none(), st.integers(0, 3))
failure_codes = st.sampled_from([1, 4, 7])
failure_causes = st.sampled_from(["ValueError: a", "ValueError: b"])


def failing_rank(kind: str, code: int, cause: str) -> RankObservation:
    return {
        "crash": running(0, exit_code=code, reason=cause),
        "signal": running(0, exit_code=128 + code, reason=cause),
        "hang": running(0, alive=False, reason=cause),
        "lost": running(0, lost=True, alive=None, reason=cause),
        "diverged": running(0, exit_code=ExitCode.DIVERGED, diverged=True, reason=cause),
    }[kind]


failures = st.builds(
    lambda kind, step, code, cause: Observation(
        attempt=0, ranks=[failing_rank(kind, code, cause)], step=step
    ),
    failure_kinds,
    failure_steps,
    failure_codes,
    failure_causes,
)


@settings(max_examples=300)
@given(failure=failures, limit=st.sampled_from([2, 3, 5]), max_restarts=st.integers(0, 12))
def test_identical_repeated_crashes_fail_after_exactly_the_limit_and_nothing_else_does(
    failure: Observation, limit: int, max_restarts: int
) -> None:
    recovery = RecoverySpec(max_restarts=max_restarts, deterministic_failure_limit=limit)
    decisions, _ = run_of_failures(recovery, [failure] * 20)
    final = decisions[-1]
    assert final.action is Action.FAIL
    crash = classify(failure.ranks[0]) is FailureKind.CRASH and not killed_by_signal(
        failure.ranks[0].exit_code
    )
    if crash and limit <= max_restarts + 1:
        assert len(decisions) == limit
        assert final.failure is FailureKind.DETERMINISTIC
    else:
        # Never for a hang, a lost rank, a signal kill or a divergence: the full policy.
        assert len(decisions) == max_restarts + 1
        assert final.failure is not FailureKind.DETERMINISTIC


@settings(max_examples=300)
@given(history=st.lists(failures, min_size=2, max_size=12), limit=st.sampled_from([2, 3]))
def test_the_verdict_fires_only_after_limit_identical_crashes_in_a_row(
    history: list[Observation], limit: int
) -> None:
    recovery = RecoverySpec(max_restarts=20, deterministic_failure_limit=limit)
    decisions, _ = run_of_failures(recovery, history)
    for index, decision in enumerate(decisions):
        if decision.failure is not FailureKind.DETERMINISTIC:
            continue
        assert index == len(decisions) - 1  # final
        window = history[index - limit + 1 : index + 1]
        assert len(window) == limit
        signatures = {(o.step, o.ranks[0].exit_code, o.ranks[0].reason) for o in window}
        assert len(signatures) == 1  # every failure of the run identical
        assert all(classify(o.ranks[0]) is FailureKind.CRASH for o in window)
        assert not killed_by_signal(window[0].ranks[0].exit_code)
    # Any differing pair in a row never counts: a different last failure resets the count.
    for before, after, decision in zip(history, history[1:], decisions[1:], strict=False):
        if (
            (before.step, before.ranks[0].reason, before.ranks[0].exit_code)
            != (
                after.step,
                after.ranks[0].reason,
                after.ranks[0].exit_code,
            )
            or before.ranks[0].diverged != after.ranks[0].diverged
            or before.ranks[0].lost != after.ranks[0].lost
        ):
            assert decision.signature is not None
            assert decision.signature.repeats == 1


# --- Naming the cause of a hang (or a crash) by where each rank was: its own work, or a collective ---

activities = st.one_of(st.none(), st.sampled_from(list(Activity)))
hung_states = st.builds(
    RankObservation,
    rank=st.integers(0, 7),
    alive=st.just(False),
    reason=st.just("no step for 31 s"),
    step=st.one_of(st.none(), st.integers(10, 13)),
    activity=activities,
    activity_since=st.one_of(st.none(), st.integers(0, 3).map(float)),
)


def test_a_rank_stuck_in_its_forward_is_named_and_the_rank_waiting_for_it_is_not() -> None:
    decision = decide(
        RECOVERY,
        Observation(
            attempt=1,
            step=15,
            ranks=(
                running(0, alive=False, reason="no step for 31 s", step=15, activity=Activity.COLLECTIVE),
                running(
                    1,
                    alive=False,
                    reason="no step for 33 s",
                    step=15,
                    activity=Activity.LOOP,
                    place="pod job-worker-0 on node n2",
                ),
            ),
        ),
    )
    assert (decision.failure, decision.rank) == (FailureKind.HANG, 1)
    assert decision.reason == (
        "rank 1 (pod job-worker-0 on node n2) hung at step 15 in its own work (the loop: next batch or "
        "forward pass): no step for 33 s; rank 0 waited for it in a collective"
    )


def test_under_ddp_a_rank_in_its_forward_is_named_before_a_rank_in_its_backward() -> None:
    # DDP's gradient all-reduce runs inside backward: rank 0 waits there for rank 1, which never got to it.
    decision = decide(
        RECOVERY,
        gang(
            running(0, alive=False, step=15, activity=Activity.BACKWARD, activity_since=1.0),
            running(1, alive=False, step=15, activity=Activity.LOOP, activity_since=2.0),
        ),
    )
    assert decision.rank == 1
    assert "rank 0 waited for it in the backward pass" in decision.reason


@settings(max_examples=300)
@given(ranks=st.lists(hung_states, min_size=1, max_size=6, unique_by=lambda r: r.rank))
def test_a_hung_rank_in_its_own_work_among_waiters_is_always_named(ranks: list[RankObservation]) -> None:
    decision = decide(RECOVERY, gang(*ranks))
    assert decision.failure is FailureKind.HANG
    blamed = next(r for r in ranks if r.rank == decision.rank)
    least = min(waiting_order(r.activity) for r in ranks)
    assert waiting_order(blamed.activity) == least
    if least < 3 and any(r.activity is not None for r in ranks):
        assert f"rank {blamed.rank} hung" in decision.reason
        for waiter in (r for r in ranks if r.activity is Activity.COLLECTIVE):
            assert f"rank {waiter.rank} hung" not in decision.reason
            assert not decision.reason.startswith("ranks")


@settings(max_examples=200)
@given(ranks=st.lists(hung_states, min_size=1, max_size=6, unique_by=lambda r: r.rank))
def test_when_every_hung_rank_waits_in_a_collective_the_lowest_step_then_the_earliest_is_named(
    ranks: list[RankObservation],
) -> None:
    waiting = [replace(r, activity=Activity.COLLECTIVE) for r in ranks]
    decision = decide(RECOVERY, Observation(attempt=1, ranks=waiting, step=13))
    never = float("inf")
    first = min(
        waiting,
        key=lambda r: (
            r.step if r.step is not None else never,
            r.activity_since if r.activity_since is not None else never,
            r.rank,
        ),
    )
    assert decision.rank == first.rank
    assert "every one waiting in a collective" in decision.reason


def test_a_running_rank_in_its_own_work_is_the_likely_cause_of_peers_waiting_for_it() -> None:
    # The peer's liveness has not failed yet (its sidecar's clock, a probe period): it is still named.
    decision = decide(
        RECOVERY,
        gang(
            running(0, alive=False, reason="no step for 31 s", activity=Activity.COLLECTIVE),
            running(1, alive=True, activity=Activity.DATA, place="pod w-1 on node n7"),
        ),
    )
    assert (decision.failure, decision.rank) == (FailureKind.HANG, 1)
    assert decision.reason == (
        "rank 1 (pod w-1 on node n7) hung in its own work (fetching the next batch): its own liveness had "
        "not failed yet, rank 0's had (no step for 31 s); rank 0 waited for it in a collective"
    )


def test_under_ddp_a_running_rank_in_its_forward_is_the_likely_cause_of_a_peer_hung_in_backward() -> None:
    # The real node's hang test: rank 1 hung in its forward pass; rank 0 waited in the gradient
    # all-reduce of its backward and its sidecar's learned deadline (6.0 s) ran out first.
    decision = decide(
        RECOVERY,
        Observation(
            attempt=1,
            step=40,
            ranks=[
                running(0, alive=False, reason="no step for 6.1 s", step=40, activity=Activity.BACKWARD),
                running(1, alive=True, step=40, activity=Activity.LOOP, place="pod w-1 on node n7"),
            ],
        ),
    )
    assert (decision.failure, decision.rank) == (FailureKind.HANG, 1)
    assert decision.reason == (
        "rank 1 (pod w-1 on node n7) hung at step 40 in its own work (the loop: next batch or forward pass): "
        "its own liveness had not failed yet, rank 0's had (no step for 6.1 s); rank 0 waited for it in the "
        "backward pass"
    ), decision.reason


def test_a_peer_in_its_own_backward_is_not_blamed_for_a_rank_hung_in_backward() -> None:
    decision = decide(
        RECOVERY,
        gang(
            running(0, alive=False, reason="no step for 31 s", activity=Activity.BACKWARD),
            running(1, alive=True, activity=Activity.BACKWARD),
        ),
    )
    assert decision.rank == 0
    assert decision.reason == "rank 0 hung in its backward pass: no step for 31 s"


@settings(max_examples=300)
@given(
    ranks=st.lists(rank_states, min_size=1, max_size=6, unique_by=lambda r: r.rank),
    steps=st.lists(st.integers(0, 9), min_size=6, max_size=6),
)
@example(  # two hung ranks, the higher one's process seen to end: it is named, first
    ranks=[
        RankObservation(rank=0, exit_code=None, alive=False),
        RankObservation(rank=1, exit_code=None, alive=False, ended_at=0.0),
    ],
    steps=[0] * 6,
)
def test_without_activity_reports_the_decision_is_the_old_one(
    ranks: list[RankObservation], steps: list[int]
) -> None:
    # Workers older than the activity field report none: their steps and places change nothing, and a
    # hang names every hung rank, lowest first, as it always did; of hung ranks whose processes ended
    # (a runner that saw the process end without its exit code), the one that ended first.
    decision = decide(RECOVERY, gang(*ranks))
    evidenced = [
        replace(r, step=s, activity_since=1.0, place="pod p") for r, s in zip(ranks, steps, strict=False)
    ]
    assert decide(RECOVERY, gang(*evidenced)) == decision
    if decision.failure is FailureKind.HANG:
        hung = [r for r in ranks if classify(r) is FailureKind.HANG]
        first = min(hung, key=lambda r: (r.ended_at if r.ended_at is not None else float("inf"), r.rank))
        assert decision.rank == first.rank
        numbers = sorted(r.rank for r in hung)
        if len(hung) == 1:
            named = f"rank {first.rank} hung"
        elif first.ended_at is not None:
            named = f"rank {first.rank} hung first"
        else:
            named = f"ranks {', '.join(map(str, numbers))} hung"
        assert decision.reason.startswith(named), decision.reason


def test_of_crashed_ranks_that_ended_together_the_one_in_its_own_work_is_the_cause() -> None:
    # Rank 1 raised in its own work; rank 0's collective broke and it exited 1 in the same second.
    decision = decide(
        RECOVERY,
        gang(
            running(0, exit_code=1, ended_at=10.0, activity=Activity.COLLECTIVE),
            running(1, exit_code=1, ended_at=10.0, activity=Activity.STEP),
        ),
    )
    assert decision.rank == 1
    assert (
        decision.reason
        == "rank 1 crashed first: exited with code 1; rank 0 too (in a collective its exit broke)"
    )


def test_of_crashed_ranks_that_ended_together_one_killed_by_a_signal_is_the_cause_whatever_the_activity() -> (
    None
):
    # FSDP: rank 1 is SIGKILLed in its step (its last published activity says a collective); rank 0,
    # waiting in the forward pass's all-gather (which reads as its own work), exits 1 the same second.
    decision = decide(
        RECOVERY,
        gang(
            running(0, exit_code=1, ended_at=10.0, activity=Activity.LOOP),
            running(1, exit_code=137, ended_at=10.0, activity=Activity.COLLECTIVE),
        ),
    )
    assert decision.rank == 1


# --- The cause compared without what differs between two runs of one failure (issue 42) ---

DATALOADER_CRASH = (
    "RuntimeError: DataLoader worker (pid {}) is killed by signal: Segmentation fault. "
    "(at signal_handling.py:73)"
)


def test_a_dataloader_worker_named_by_another_pid_each_attempt_is_the_same_failure() -> None:
    failures = [crashed_at(49, attempt=0, why=DATALOADER_CRASH.format(pid)) for pid in (21248, 21367, 21502)]
    decisions, _ = run_of_failures(RecoverySpec(max_restarts=3), failures)
    assert [d.action for d in decisions] == [Action.RESTART, Action.FAIL]
    assert decisions[-1].failure is FailureKind.DETERMINISTIC
    assert decisions[0].signature is not None
    assert decisions[0].signature.cause == "exited: " + DATALOADER_CRASH.format("<pid>")
    last = "last: rank 0 crashed at step 49: exited: " + DATALOADER_CRASH.format(21367)
    assert decisions[-1].reason.endswith(last)


def test_a_cause_recorded_raw_by_an_older_version_compares_with_a_stable_one() -> None:
    old = FailureSignature(FailureKind.CRASH, 49, 1, "exited: " + DATALOADER_CRASH.format(21248), attempt=1)
    observation = crashed_at(49, attempt=2, why=DATALOADER_CRASH.format(21367))
    decision = decide(RECOVERY, replace(observation, restarts=1, handled_attempt=1, previous_failure=old))
    assert decision.failure is FailureKind.DETERMINISTIC


def run_of_two(first: str, second: str, steps: tuple[int, int] = (49, 49)) -> list[Decision]:
    failures = [crashed_at(steps[0], attempt=0, why=first), crashed_at(steps[1], attempt=0, why=second)]
    decisions, _ = run_of_failures(RecoverySpec(max_restarts=3), failures)
    return decisions


@settings(max_examples=200)
@given(data=st.data(), message=causes.messages)
def test_two_runs_of_one_crash_are_deterministic_at_the_second_whatever_their_pids_times_or_ports(
    data: st.DataObject, message: causes.Message
) -> None:
    first, second = data.draw(causes.two_runs(message))
    assert [d.failure for d in run_of_two(first, second)] == [FailureKind.CRASH, FailureKind.DETERMINISTIC]


@settings(max_examples=200)
@given(data=st.data(), message=causes.messages, step=st.integers(0, 10**6))
def test_a_crash_with_another_word_or_at_another_step_is_a_new_failure(
    data: st.DataObject, message: causes.Message, step: int
) -> None:
    first, second = data.draw(causes.two_runs(message))
    kept = [i for i, part in enumerate(message.parts) if isinstance(part, str)]
    where = data.draw(st.sampled_from(kept))
    word = data.draw(st.sampled_from(causes.WORDS).filter(lambda w: w != message.parts[where]))
    changed = causes.Message((*message.parts[:where], word, *message.parts[where + 1 :]))
    other = changed.render([data.draw(slot.values) for slot in changed.slots])
    for decisions in (run_of_two(first, other), run_of_two(first, second, steps=(step, step + 1))):
        assert [d.action for d in decisions] == [Action.RESTART, Action.RESTART]
        assert decisions[-1].signature is not None
        assert decisions[-1].signature.repeats == 1


@settings(max_examples=200)
@given(data=st.data(), message=causes.messages, filler=st.integers(1100, 3000))
def test_a_long_message_cut_by_the_status_is_compared_as_far_as_both_runs_are_whole(
    data: st.DataObject, message: causes.Message, filler: int
) -> None:
    # The status cuts a worker's message at 1024 characters; two runs whose pids (or times) differ in
    # length are cut at different points of the same text.
    long = causes.Message((*message.parts, "x" * 10, *(["corrupt sample"] * (filler // 15))))
    runs = data.draw(causes.two_runs(long))
    first, second = (WorkerStatus(started_at=1.0, message=text).message for text in runs)
    assert [d.failure for d in run_of_two(first, second)] == [FailureKind.CRASH, FailureKind.DETERMINISTIC]


def test_a_cut_cause_is_the_same_only_as_far_as_it_is_whole_and_long_enough() -> None:
    text = " ".join(f"word{i}" for i in range(300))
    assert same_cause(text[:1000] + "...", text[:1100] + "...")
    assert same_cause(text[:1000] + "...", text)  # the whole text goes on as the cut one does
    assert not same_cause(text[:1000] + "...", "other " + text)
    assert not same_cause(text[:1000], text[:1100])  # neither was cut: two texts
    assert not same_cause(text[:150] + "...", text[:160] + "...")  # too little to tell
    assert not same_cause(text[:900], text[:1000] + "...")  # whole, and shorter than the cut one


# --- The culprit is named first, whichever rank's verdict or exit reached the executor first ---

#: The first rank a reason names: "rank 3 hung ...", "ranks 0, 1 hung ...".
FIRST_NAMED = re.compile(r"^ranks? (\d+)")
#: The ranks a reason names as waiting for the culprit: "ranks 0, 2 waited for it in a collective".
WAITED = re.compile(r"(ranks? (?:\d+, )*\d+) waited for it")
OWN_WORK_ACTIVITIES = [Activity.LOOP, Activity.DATA, Activity.STEP, Activity.CHECKPOINT, Activity.BUSY]
WAITING_ACTIVITIES = [Activity.COLLECTIVE, Activity.LOOP_COLLECTIVE]


def first_named(reason: str) -> int:
    found = FIRST_NAMED.match(reason)
    assert found is not None, reason
    return int(found.group(1))


def named_waiting(reason: str) -> set[int]:
    return {int(n) for group in WAITED.findall(reason) for n in re.findall(r"\d+", group)}


def test_a_hang_whose_waiting_ranks_verdict_fired_first_names_the_culprit_first() -> None:
    # Issue 40: hang@290:0 of the demo model, 2 ranks, DDP. Rank 0 hangs in its forward pass; rank 1 waits
    # for its gradients in the backward pass, and rank 1's sidecar fires first.
    decision = decide(
        RECOVERY,
        Observation(
            attempt=1,
            step=290,
            ranks=[
                running(0, alive=True, step=290, activity=Activity.LOOP, place="pod w-0 on node n1"),
                running(1, alive=False, reason="no step for 6.1 s", step=290, activity=Activity.BACKWARD),
            ],
        ),
    )
    assert (decision.failure, decision.rank) == (FailureKind.HANG, 0)
    assert decision.reason == (
        "rank 0 (pod w-0 on node n1) hung at step 290 in its own work (the loop: next batch or forward "
        "pass): its own liveness had not failed yet, rank 1's had (no step for 6.1 s); rank 1 waited for it "
        "in the backward pass"
    )


def test_a_hang_whose_culprits_verdict_fired_first_names_the_ranks_still_waiting_after_it() -> None:
    decision = decide(
        RECOVERY,
        Observation(
            attempt=1,
            step=290,
            ranks=[
                running(0, alive=False, reason="no step for 6.3 s", step=290, activity=Activity.LOOP),
                running(1, alive=True, step=290, activity=Activity.BACKWARD),
                running(2, alive=True, step=290, activity=Activity.LOOP_COLLECTIVE),
                running(3, alive=True, step=290, activity=Activity.LOOP),  # neither hung nor waiting
            ],
        ),
    )
    assert decision.rank == 0
    assert decision.reason == (
        "rank 0 hung at step 290 in its own work (the loop: next batch or forward pass): no step for 6.3 s; "
        "rank 1 waited for it in the backward pass; rank 2 waited for it in a collective of the loop's "
        "(torch.distributed)"
    )


def test_a_rank_in_its_own_work_beside_ranks_in_the_loops_own_collective_is_the_culprit() -> None:
    # Issue 42: the loop all-reduces its sample count before each forward; rank 1 hangs in its own work,
    # rank 0 waits in that all-reduce. Both verdicts fired.
    decision = decide(
        RECOVERY,
        Observation(
            attempt=1,
            step=60,
            ranks=[
                running(
                    0, alive=False, reason="no step for 5.2 s", step=60, activity=Activity.LOOP_COLLECTIVE
                ),
                running(1, alive=False, reason="no step for 5.0 s", step=60, activity=Activity.LOOP),
            ],
        ),
    )
    assert decision.rank == 1
    assert decision.reason == (
        "rank 1 hung at step 60 in its own work (the loop: next batch or forward pass): no step for 5.0 s; "
        "rank 0 waited for it in a collective of the loop's (torch.distributed)"
    )


def test_every_rank_in_a_collective_names_the_one_chosen_first_and_the_others_after() -> None:
    decision = decide(
        RECOVERY,
        gang(
            running(0, alive=False, reason="no step for 31 s", step=12, activity=Activity.COLLECTIVE),
            running(1, alive=False, reason="no step for 30 s", step=11, activity=Activity.LOOP_COLLECTIVE),
        ),
    )
    assert decision.rank == 1  # the lowest step
    assert decision.reason == (
        "rank 1 hung waiting in a collective of the loop's (torch.distributed): no step for 30 s; rank 0 "
        "too, every one waiting in a collective (for a peer that is gone, or the network)"
    )


def test_a_peer_lost_or_hung_is_named_before_the_rank_whose_collective_broke_for_losing_it() -> None:
    gone = running(0, exit_code=1, ended_at=10.0, reason=GLOO_PEER_GONE)
    lost = decide(RECOVERY, gang(gone, running(1, alive=None, lost=True, reason="node n2 lost")))
    assert (lost.failure, lost.rank) == (FailureKind.LOST, 1)
    assert lost.reason == "rank 1 lost: node n2 lost; rank 0 crashed after losing it as a peer"
    hung = decide(
        RECOVERY, gang(gone, running(1, alive=False, reason="no step for 31 s", activity=Activity.DATA))
    )
    assert (hung.failure, hung.rank) == (FailureKind.HANG, 1)
    assert hung.reason == (
        "rank 1 hung in its own work (fetching the next batch): no step for 31 s; rank 0 crashed after "
        "losing it as a peer"
    )


def test_crashes_told_apart_by_a_signal_alone_name_the_killed_rank_first() -> None:
    # No ending times: the kill by a signal is what tells them apart, and the killed rank is named first.
    decision = decide(RECOVERY, gang(running(0, exit_code=1), running(1, exit_code=137)))
    assert decision.rank == 1
    assert decision.reason == "rank 1 crashed: killed by signal 9; rank 0 too"


def test_crashes_nothing_tells_apart_name_every_rank_lowest_first() -> None:
    decision = decide(RECOVERY, gang(running(0, exit_code=1), running(1, exit_code=1)))
    assert decision.rank == 0
    assert decision.reason == "ranks 0, 1 crashed: exited with code 1"


@st.composite
def hang_shapes(draw: st.DrawFn) -> tuple[list[RankObservation], int]:
    """A gang of 2 to 6 where one rank stopped in its own work (or its backward pass) and the others wait
    for it (in a collective, or in the backward pass when the culprit is in its own work); any non-empty
    set of them has been judged hung by its sidecar (the rest: alive, or not judged yet)."""
    size = draw(st.integers(2, 6))
    culprit = draw(st.integers(0, size - 1))
    own = draw(st.sampled_from([*OWN_WORK_ACTIVITIES, Activity.BACKWARD]))
    waits = WAITING_ACTIVITIES + ([Activity.BACKWARD] if own is not Activity.BACKWARD else [])
    fired = draw(st.sets(st.integers(0, size - 1), min_size=1))
    step = draw(st.integers(0, 400))
    ranks = [
        RankObservation(
            rank=r,
            alive=False if r in fired else draw(st.sampled_from([True, None])),
            reason=f"no step for {5 + r} s" if r in fired else "",
            step=step,
            activity=own if r == culprit else draw(st.sampled_from(waits)),
            activity_since=draw(st.floats(0, 10)),
            place=draw(st.sampled_from(["", f"pod w-{r} on node n{r}"])),
        )
        for r in range(size)
    ]
    return draw(st.permutations(ranks)), culprit


@settings(max_examples=400)
@given(shape=hang_shapes())
def test_a_hangs_culprit_is_named_first_whichever_sidecars_fired_and_every_waiter_after_it(
    shape: tuple[list[RankObservation], int],
) -> None:
    ranks, culprit = shape
    decision = decide(RECOVERY, Observation(attempt=1, ranks=ranks, step=7))
    assert (decision.failure, decision.rank) == (FailureKind.HANG, culprit), decision.reason
    assert decision.reason.startswith(f"rank {culprit} "), decision.reason
    assert " hung at step 7 " in decision.reason.split(";")[0], decision.reason
    assert named_waiting(decision.reason) == {r.rank for r in ranks if r.rank != culprit}, decision.reason


@st.composite
def crash_shapes(draw: st.DrawFn) -> tuple[list[RankObservation], int]:
    """A gang of 2 to 6 where one rank crashed (raised, or was killed) and each other rank either crashed
    for losing it as a peer (before or after the culprit's end reached the executor), was judged hung in a
    collective, or still runs waiting in one."""
    size = draw(st.integers(2, 6))
    culprit = draw(st.integers(0, size - 1))
    ended = draw(st.floats(0, 10))
    ranks = []
    for r in range(size):
        if r == culprit:
            code = draw(st.sampled_from([1, 137, -9]))
            ranks.append(RankObservation(rank=r, exit_code=code, alive=None, reason="", ended_at=ended))
            continue
        shape = draw(st.sampled_from(["lost it", "hung", "waiting"]))
        activity = draw(st.sampled_from([*WAITING_ACTIVITIES, None]))
        if shape == "lost it":
            at = draw(st.one_of(st.none(), st.floats(0, 10)))
            ranks.append(
                RankObservation(
                    rank=r, exit_code=1, alive=None, reason=GLOO_PEER_GONE, ended_at=at, activity=activity
                )
            )
        else:
            alive = shape != "hung"
            ranks.append(RankObservation(rank=r, alive=alive, reason="no step for 9 s", activity=activity))
    return draw(st.permutations(ranks)), culprit


@settings(max_examples=300)
@given(shape=crash_shapes())
def test_a_crashs_culprit_is_named_first_whatever_its_peers_reported_first(
    shape: tuple[list[RankObservation], int],
) -> None:
    ranks, culprit = shape
    decision = decide(RECOVERY, gang(*ranks))
    assert (decision.failure, decision.rank) == (FailureKind.CRASH, culprit), decision.reason
    assert decision.reason.startswith(f"rank {culprit} crashed"), decision.reason
    if any(r.exit_code == 1 and r.rank != culprit for r in ranks):
        assert "too (after losing it as a peer)" in decision.reason, decision.reason


gang_states = st.builds(
    RankObservation,
    rank=st.integers(0, 7),
    exit_code=st.one_of(st.none(), st.sampled_from([0, 1, 2, 3, 137, -9])),
    alive=st.one_of(st.none(), st.booleans()),
    reason=st.sampled_from(["", "no step for 31 s", GLOO_PEER_GONE]),
    diverged=st.booleans(),
    lost=st.booleans(),
    ended_at=st.one_of(st.none(), st.integers(0, 3).map(float)),
    step=st.one_of(st.none(), st.integers(10, 13)),
    activity=activities,
    activity_since=st.one_of(st.none(), st.integers(0, 3).map(float)),
)


@settings(max_examples=500)
@given(
    ranks=st.lists(gang_states, min_size=1, max_size=6, unique_by=lambda r: r.rank),
    order=st.randoms(use_true_random=False),
)
def test_the_first_rank_any_failures_reason_names_is_the_rank_the_decision_blames(
    ranks: list[RankObservation], order: Any
) -> None:
    decision = decide(RECOVERY, gang(*ranks))
    shuffled = list(ranks)
    order.shuffle(shuffled)
    assert decide(RECOVERY, gang(*shuffled)) == decision  # the order ranks are listed in changes nothing
    if decision.failure is None or decision.action is Action.WAIT:
        return
    assert decision.rank is not None
    assert first_named(decision.reason) == decision.rank, decision.reason

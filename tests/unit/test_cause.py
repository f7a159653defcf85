"""A failure's cause made stable: what differs between two runs of one failure goes, what says what failed
stays (``trainguard.core.cause``)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.causes import REAL_NUMBERS, VOLATILES, WORDS, Message, messages, two_runs
from trainguard.core.cause import stable_cause

#: What issue 42 saw: one corrupt sample, two attempts, two pids.
DATALOADER = (
    "RuntimeError: DataLoader worker (pid {}) is killed by signal: Segmentation fault. "
    "(at signal_handling.py:73)"
)


def test_the_dataloader_worker_named_by_its_pid_reads_alike_in_every_attempt() -> None:
    first, second = DATALOADER.format(21248), DATALOADER.format(21367)
    assert first != second
    assert stable_cause(first) == stable_cause(second) == DATALOADER.format("<pid>")


def test_what_says_what_failed_is_kept_word_for_word() -> None:
    text = "ValueError: mat1 and mat2 shapes cannot be multiplied (8x16 and 32x1) (at tiny_train.py:160)"
    assert stable_cause(text) == text
    assert stable_cause("exited with code 1 (killed by signal 11): index 4096 out of range") == (
        "exited with code 1 (killed by signal 11): index 4096 out of range"
    )


def test_each_kind_of_volatile_token_is_named_by_its_kind() -> None:
    assert stable_cause("<Foo object at 0x7f3a9c0012a0>") == "<Foo object at 0x<hex>>"
    assert stable_cause("at 2026-12-07T05:29:01.123Z, [05:29:01]") == "at <time>, [<time>]"
    assert stable_cause("No such file: '/tmp/tmpab12cd34/shard-3.bin'") == "No such file: '<tmp>'"
    assert stable_cause("socket connect to 10.0.0.12<45123> failed") == "socket connect to <ip>:<port> failed"
    assert stable_cause("store 127.0.0.1:29500, port: 29501") == "store <ip>:<port>, port: <port>"
    assert stable_cause("thread 140234992 (Thread-12) tid=7") == "thread <tid> (Thread-<n>) tid=<tid>"
    assert stable_cause("timed out after 30.5 s (1800000ms)") == "timed out after <duration> (<duration>)"
    assert stable_cause("exitcode : 1 (pid: 1234) host : job-2-worker-0") == (
        "exitcode : 1 (pid: <pid>) host : <host>"
    )


@settings(max_examples=400)
@given(data=st.data(), message=messages)
def test_two_runs_of_one_failure_read_alike_and_reading_again_changes_nothing(
    data: st.DataObject, message: Message
) -> None:
    first, second = data.draw(two_runs(message))
    assert stable_cause(first) == stable_cause(second), (first, second)
    assert stable_cause(stable_cause(first)) == stable_cause(first)


@settings(max_examples=400)
@given(data=st.data(), message=messages)
def test_another_word_or_number_of_what_failed_reads_otherwise(data: st.DataObject, message: Message) -> None:
    kept = [i for i, part in enumerate(message.parts) if isinstance(part, str)]
    where = data.draw(st.sampled_from(kept))
    others = st.one_of(st.sampled_from(WORDS), REAL_NUMBERS)
    other = data.draw(others.filter(lambda part: part != message.parts[where]))
    changed = Message((*message.parts[:where], other, *message.parts[where + 1 :]))
    values = [data.draw(slot.values) for slot in message.slots]
    assert stable_cause(message.render(values)) != stable_cause(changed.render(values))


def test_every_volatile_kind_is_exercised() -> None:
    names = [v.name for v in VOLATILES]
    assert len(names) == len(set(names))

"""Hypothesis strategies for failure messages: the words that say what failed, and the tokens that differ
between two runs of the same failure (pids, addresses, times, paths, ports, ...), as real programs print
them (PyTorch's DataLoader, gloo, c10d, torchrun, Python's own errors)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from hypothesis import strategies as st

#: Words that say what failed: none is, or ends in, a unit or a name a volatile token is told by.
WORDS = (
    "DataLoader", "worker", "is", "killed", "by", "signal:", "Segmentation", "fault.", "RuntimeError:",
    "ValueError:", "shapes", "cannot", "be", "multiplied", "batch", "index", "out", "of", "range", "file",
    "not", "found", "error", "in", "sample", "corrupt", "decode", "failed", "tensor", "size", "mismatch",
    "(at", "train.py:88)", "loader.py:12)", "expected", "got", "connect", "socket", "read", "KeyError:",
)  # fmt: skip

#: Numbers that are part of what failed (a shape, an index, a line, a signal): kept as they are.
REAL_NUMBERS = st.one_of(
    st.builds("({}x{})".format, st.integers(0, 4096), st.integers(1, 64)),
    st.builds("index {}".format, st.integers(0, 4096)),
    st.builds("line {}".format, st.integers(1, 4096)),
    st.builds("signal {}".format, st.integers(1, 64)),
)


@dataclass(frozen=True)
class Volatile:
    """One kind of volatile token: how to print it from a value drawn by ``values``."""

    name: str
    values: st.SearchStrategy[object]
    render: Callable[[object], str]


_MOMENTS = st.datetimes(min_value=datetime(2018, 1, 1), max_value=datetime(2032, 12, 31))


def _iso(moment: object) -> str:
    assert isinstance(moment, datetime)
    return moment.replace(tzinfo=UTC).isoformat().replace("+00:00", "Z")


def _pair(value: object) -> tuple[int, int]:
    assert isinstance(value, tuple)
    return int(value[0]), int(value[1])


def _address(value: object) -> str:
    ip, port = _pair(value)
    return "{}.{}.{}.{}:{}".format(*_ip(ip), port)


def _nccl_peer(value: object) -> str:
    ip, port = _pair(value)
    return "{}.{}.{}.{}<{}>".format(*_ip(ip), port)


_NAMES = st.text("abcdefghijklmnopqrstuvwxyz0123456789_", min_size=8, max_size=8)
_ADDRESSES = st.tuples(st.integers(0, 2**32 - 1), st.integers(1024, 65535))
_PIDS = st.integers(1, 4_194_304)

VOLATILES = (
    Volatile("pid", _PIDS, lambda v: f"(pid {v})"),
    Volatile("pids", st.tuples(_PIDS, _PIDS), lambda v: "pid(s) {}, {}".format(*_pair(v))),
    Volatile("pid=", _PIDS, lambda v: f"pid={v}"),
    Volatile("address", st.integers(0x1000, 2**48), lambda v: f"<object at {v:#x}>"),
    Volatile("iso time", _MOMENTS, _iso),
    Volatile("torchrun time", _MOMENTS, lambda v: f"time : {v:%Y-%m-%d_%H:%M:%S}"),
    Volatile("clock", _MOMENTS, lambda v: f"[{v:%H:%M:%S}]"),
    Volatile("unix time", st.floats(1.6e9, 1.9e9), lambda v: f"at {v:.3f}"),
    Volatile("duration", st.floats(0.0, 1e5), lambda v: f"after {v:.2f} s"),
    Volatile("milliseconds", st.integers(0, 10**7), lambda v: f"timeout {v}ms"),
    Volatile("seconds", st.integers(1, 10**5), lambda v: f"waited {v} seconds"),
    Volatile("tmp path", _NAMES, lambda v: f"'/tmp/tmp{v}/shard.bin'"),
    Volatile("proc path", _PIDS, lambda v: f"/proc/{v}/status"),
    Volatile("ip and port", _ADDRESSES, _address),
    Volatile("nccl peer", _ADDRESSES, _nccl_peer),
    Volatile("port", st.integers(1024, 65535), lambda v: f"port: {v},"),
    Volatile("thread", st.integers(1, 2**47), lambda v: f"thread {v}"),
    Volatile("thread name", st.integers(1, 10**4), lambda v: f"Thread-{v}"),
    Volatile("uuid", st.integers(0, 2**128 - 1), lambda v: str(uuid.UUID(int=int(str(v))))),
    Volatile("host", st.integers(1, 10**6), lambda v: f"host : tiny-lm-{v}-worker-0"),
)


def _ip(value: int) -> tuple[int, int, int, int]:
    return (value >> 24) & 255, (value >> 16) & 255, (value >> 8) & 255, value & 255


@dataclass(frozen=True)
class Message:
    """A failure message with volatile tokens: its parts, words and the kinds of its slots."""

    parts: tuple[str | Volatile, ...]

    def render(self, values: list[object]) -> str:
        """The message with its slots filled by ``values``, in order."""
        slots = iter(values)
        return " ".join(part if isinstance(part, str) else part.render(next(slots)) for part in self.parts)

    @property
    def slots(self) -> list[Volatile]:
        """Its volatile slots, in order."""
        return [part for part in self.parts if isinstance(part, Volatile)]


messages = st.builds(
    lambda parts: Message(tuple(parts)),
    st.lists(
        st.one_of(st.sampled_from(WORDS), REAL_NUMBERS, st.sampled_from(VOLATILES)), min_size=1, max_size=30
    ).filter(lambda parts: any(isinstance(p, str) for p in parts)),
)


@st.composite
def two_runs(draw: st.DrawFn, message: Message) -> tuple[str, str]:
    """``message`` printed by two runs of the same failure: every slot filled twice, independently."""
    first = [draw(slot.values) for slot in message.slots]
    second = [draw(slot.values) for slot in message.slots]
    return message.render(first), message.render(second)

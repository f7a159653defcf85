"""A failure's cause as the deterministic-failure rule compares it: its text with what differs between two
attempts of the same failure replaced by placeholders. Pure.

The same crash, repeated, does not print the same text: a DataLoader worker killed by a corrupt sample
is named by its pid ("DataLoader worker (pid 21248) is killed by signal: Segmentation fault."), an object
by its address, an error by its time, its temporary file, its port or its peer's address. ``stable_cause``
replaces exactly those tokens, each by what it is (``pid <pid>``, ``0x<hex>``, ``<time>``, ``<tmp>``,
``<ip>:<port>``, ...), and keeps every other word and number: a tensor's shape (``8x16``), an index, a
file's name and line (``train.py:88``) and a signal's number say what failed, and differ when the failure
does. It is idempotent (a cause already made stable stays as it is), so a cause recorded by an older
version (raw) and one recorded now compare alike.

What it cannot see: a volatile value with no telling context (a bare number that happens to be a pid, a
host name) stays, and such a failure counts as a new one each time (a restart too many, never one too
few).
"""

from __future__ import annotations

import re

__all__ = ["stable_cause"]

_HEX = r"[0-9a-fA-F]"

#: (pattern, replacement), applied in this order: a token is replaced once, by its most specific kind.
_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    # 123e4567-e89b-12d3-a456-426614174000: request, trace and container ids.
    (re.compile(rf"\b{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}\b"), "<uuid>"),
    # torchrun's and c10d's "host : job-2-worker-0", "hostname=..." (a pod's name changes with its attempt).
    (re.compile(r"\b(host(?:name)?\s*[:=]\s*)(?!<)[^\s,;()]+", re.IGNORECASE), r"\1<host>"),
    # Numbers named by what they are, before any rule for a number's shape: a port (c10d's "port: 29500"),
    # pid 123, pid=123, pid: 123, pid(s) 123, 456, ppid 7, process id 8; tid 9, thread 140234, Thread-12.
    (re.compile(r"\b(ports?|MASTER_PORT)(\s*[:=]?\s*)\d{1,5}(?!\w)", re.IGNORECASE), r"\1\2<port>"),
    (
        re.compile(r"\b(p?pids?(?:\(s\))?|process id)(\s*[:=#]?\s*)\d+(?:,\s*\d+)*(?!\w)", re.IGNORECASE),
        r"\1\2<pid>",
    ),
    (re.compile(r"\b(tid|thread id|thread)(\s*[:=#]?\s*)\d+(?!\w)", re.IGNORECASE), r"\1\2<tid>"),
    (re.compile(r"\bThread-\d+(?!\w)"), "Thread-<n>"),
    # 2026-12-07T05:29:01.123Z, 2026-12-07 05:29:01, torchrun's 2026-12-07_05:29:01, then a date alone.
    (
        re.compile(
            r"\b\d{4}-\d{2}-\d{2}(?:[T _]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?\b"
        ),
        "<time>",
    ),
    # 05:29:01, 05:29:01.123 (a clock time: two colons, so never a file's line "train.py:88").
    (re.compile(r"\b\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?\b"), "<time>"),
    # Unix times in seconds (2017 to 2033) or milliseconds, as logs print them.
    (re.compile(r"\b1[5-9]\d{8}(?:\d{3})?(?:\.\d+)?\b"), "<time>"),
    # Memory addresses and handles: "at 0x1000", 0x7f3a9c0012a0 (else six digits at least, or a letter
    # among them: a shape with an empty dimension prints as "0x16").
    (re.compile(rf"(?<=\bat )0[xX]{_HEX}+\b|\b0[xX](?:{_HEX}{{6,}}|\d*[a-fA-F]{_HEX}*)\b"), "0x<hex>"),
    # Long hexadecimal tokens with a digit in them (container ids, digests of temporary things).
    (re.compile(rf"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F]){_HEX}{{16,}}\b"), "<hex>"),
    # /proc/12345/..., then paths under the temporary directories, then tempfile's own names.
    (re.compile(r"/proc/\d+"), "/proc/<pid>"),
    (
        re.compile(r"(?<![\w.])/(?:tmp|var/tmp|dev/shm|private/var/folders)(?![\w.-])(?:/[^\s'\"(),:;\]]*)?"),
        "<tmp>",
    ),
    (re.compile(r"\btmp[a-z0-9_]{6,}\b"), "<tmp>"),
    # IPv4 addresses (a pod's changes with every attempt) and a port after an address or a host name.
    (re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}\b"), "<ip>"),
    (re.compile(r"(<ip>|\blocalhost|\])[:<](\d{1,5})\b>?"), r"\1:<port>"),
    # Durations: 1.5 s, 30 seconds, 250ms, 2.1e-03s, 1h.
    (
        re.compile(
            r"(?<![\w.])\d+(?:\.\d+)?(?:e[-+]?\d+)?\s?"
            r"(?:ns|us|µs|ms|s|sec|secs|seconds?|mins?|minutes?|h|hours?)\b(?!\.\w)",
            re.IGNORECASE,
        ),
        "<duration>",
    ),
)


def stable_cause(text: str) -> str:
    """``text`` with every token that differs between repeats of one failure replaced by a placeholder
    naming its kind (see the module docstring), and runs of white space made one space. Idempotent."""
    result = " ".join(text.split())
    for pattern, replacement in _RULES:
        result = pattern.sub(replacement, result)
    return result

"""What the launcher reads of its container's memory cgroup (v2, then v1): the OOM killer's kills, and
whether a warm spare has room under the memory limit (``spare_room``). Torch-free, reads files only."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

#: Where the container's memory cgroup counts the OOM killer's kills (``oom_kill N``): cgroup v2, then
#: v1 (a container sees its own cgroup at the root of its cgroup namespace or mount).
OOM_COUNTERS = (Path("/sys/fs/cgroup/memory.events"), Path("/sys/fs/cgroup/memory/memory.oom_control"))


def oom_kills(counters: Sequence[Path] = OOM_COUNTERS) -> int | None:
    """How many processes the OOM killer has killed in this container's memory cgroup (None: no counter
    to read here)."""
    for path in counters:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


#: The container's memory use and limit: cgroup v2's files, then v1's.
MEMORY_FILES = (
    (Path("/sys/fs/cgroup/memory.current"), Path("/sys/fs/cgroup/memory.max")),
    (
        Path("/sys/fs/cgroup/memory/memory.usage_in_bytes"),
        Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
    ),
)
#: A limit above this is no limit (cgroup v1 writes its "unlimited" as a page-rounded 2^63).
NO_LIMIT_BYTES = 1 << 60
#: What a warm spare is taken to cost its container (torch imported: 0.7 GB measured, 0.39 GB anonymous).
SPARE_MEMORY_BYTES = 1 << 30
#: A spare starts only if the container's use with it stays below this share of its memory limit, and is
#: dropped once the use passes ``SPARE_DROP_SHARE``: the worker needs the room more than its restart does.
SPARE_ROOM_SHARE = 0.85
SPARE_DROP_SHARE = 0.95
#: How often the container's memory is looked at while a spare is due or kept.
MEMORY_LOOK_SECONDS = 1.0


def memory_use(files: Sequence[tuple[Path, Path]] = MEMORY_FILES) -> tuple[int, int | None] | None:
    """The container's memory use and limit, in bytes (limit None: unlimited); None when there is no
    memory cgroup to read here."""
    for current, maximum in files:
        try:
            used = int(current.read_text().strip())
            text = maximum.read_text().strip()
        except (OSError, ValueError):
            continue
        if text == "max":
            return used, None
        try:
            limit = int(text)
        except ValueError:
            continue
        return used, limit if limit < NO_LIMIT_BYTES else None
    return None


def spare_room(use: tuple[int, int | None] | None, keeping: bool) -> str:
    """Why the container has no room for a warm spare ("" when it has): a spare to start must fit with
    ``SPARE_MEMORY_BYTES`` under ``SPARE_ROOM_SHARE`` of the limit; a spare kept (``keeping``, its memory
    already counted) goes once the use passes ``SPARE_DROP_SHARE``."""
    if use is None:
        return ""
    used, limit = use
    if limit is None:
        return ""
    if keeping and used > SPARE_DROP_SHARE * limit:
        return f"the container uses {used / 2**30:.2f} GiB of its {limit / 2**30:.2f} GiB memory limit"
    if not keeping and used + SPARE_MEMORY_BYTES > SPARE_ROOM_SHARE * limit:
        return (
            f"the container uses {used / 2**30:.2f} GiB of its {limit / 2**30:.2f} GiB memory limit, "
            f"too little room for a spare of about {SPARE_MEMORY_BYTES / 2**30:.0f} GiB"
        )
    return ""

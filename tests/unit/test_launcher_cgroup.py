"""What the launcher reads of its container's memory cgroup (v2, then v1): OOM kills, and whether a warm
spare has room under the memory limit."""

from __future__ import annotations

from pathlib import Path

from trainer_sidecar.launcher.launcher import (
    SPARE_MEMORY_BYTES,
    memory_use,
    oom_kills,
    spare_room,
)

GIB = 1 << 30


def test_the_oom_kill_count_is_read_from_cgroup_v2_then_v1(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "memory.events", tmp_path / "memory.oom_control"
    assert oom_kills((v2, v1)) is None  # neither counter: nothing to tell
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert oom_kills((v2, v1)) == 5
    v2.write_text("low 0\nhigh 0\nmax 7\noom 3\noom_kill 2\noom_group_kill 0\n")
    assert oom_kills((v2, v1)) == 2


def test_a_counter_without_a_kill_line_or_with_garbage_reads_as_none(tmp_path: Path) -> None:
    counter = tmp_path / "memory.events"
    counter.write_text("oom 1\noom_kill_disable 0\noom_kill lots\n")
    assert oom_kills((counter,)) is None
    directory = tmp_path / "dir"
    directory.mkdir()
    assert oom_kills((directory,)) is None


def test_memory_use_and_limit_are_read_from_v2_then_v1_and_a_huge_limit_is_none(tmp_path: Path) -> None:
    v2 = (tmp_path / "memory.current", tmp_path / "memory.max")
    v1 = (tmp_path / "memory.usage_in_bytes", tmp_path / "memory.limit_in_bytes")
    assert memory_use((v2, v1)) is None
    v1[0].write_text("1000\n")
    v1[1].write_text("9223372036854771712\n")  # v1's unlimited
    assert memory_use((v2, v1)) == (1000, None)
    v2[0].write_text("2000\n")
    v2[1].write_text("max\n")
    assert memory_use((v2, v1)) == (2000, None)
    v2[1].write_text(f"{4 * GIB}\n")
    assert memory_use((v2, v1)) == (2000, 4 * GIB)
    v2[1].write_text("garbage\n")
    assert memory_use((v2, v1)) == (1000, None)  # an unreadable v2 falls to v1


def test_a_spare_starts_only_with_room_under_the_limit_and_goes_when_the_worker_needs_it() -> None:
    assert spare_room(None, keeping=False) == ""
    assert spare_room((10 * GIB, None), keeping=False) == ""
    assert spare_room((2 * GIB, 4 * GIB), keeping=False) == ""  # 3 GiB with it: below 85 % of 4
    refused = spare_room((int(2.5 * GIB), 4 * GIB), keeping=False)
    assert "2.50 GiB of its 4.00 GiB memory limit" in refused
    assert int(2.5 * GIB) + SPARE_MEMORY_BYTES > 0.85 * 4 * GIB
    # A spare kept (already counted in the use) stays until the use passes 95 %.
    assert spare_room((int(3.7 * GIB), 4 * GIB), keeping=True) == ""
    assert spare_room((int(3.9 * GIB), 4 * GIB), keeping=True)

"""The launcher's reading of its container's OOM kills, from cgroup v2's and v1's counters."""

from __future__ import annotations

from pathlib import Path

from trainer_sidecar.launcher.launcher import oom_kills


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

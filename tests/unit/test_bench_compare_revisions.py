"""The revision comparison's pure parts: its arguments, the benchmark's JSON line, the table."""

from __future__ import annotations

import pytest

from bench.compare_revisions import compare, last_json, numeric_keys, parse_args, resolve


def test_the_benchmarks_own_arguments_follow_the_double_dash() -> None:
    args = parse_args(["--base", "abc", "--bench", "recovery_local", "--rounds", "2", "--", "--runs", "1"])
    assert (args.base, args.bench, args.rounds, args.bench_args) == (
        "abc",
        "recovery_local",
        2,
        ["--runs", "1"],
    )


def test_zero_rounds_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])


def test_an_unknown_revision_is_named() -> None:
    with pytest.raises(SystemExit, match="no-such-revision"):
        resolve("no-such-revision")


def test_the_last_line_must_be_a_json_object_and_the_error_shows_the_output() -> None:
    assert last_json('warming up\n{"a": 1}\n\n', "tree") == {"a": 1}
    for output in ("", "not json", "[1, 2]"):
        with pytest.raises(RuntimeError, match="did not end with a JSON object"):
            last_json(output, "tree")


def test_only_keys_numeric_in_every_run_are_compared_and_head_over_base_is_of_medians() -> None:
    base = [{"x": 1.0, "flag": True, "name": "a", "y": 0}, {"x": 3.0, "flag": False, "name": "b", "y": 0}]
    head = [
        {"x": 4.0, "flag": True, "y": 5, "only_head": 1},
        {"x": 2.0, "flag": True, "y": 7, "only_head": 2},
    ]
    assert numeric_keys(base) == {"x": [1.0, 3.0], "y": [0.0, 0.0]}
    table = compare(base, head)
    assert table == {
        "x": {"base": 2.0, "head": 3.0, "head_over_base": 1.5},
        "y": {"base": 0.0, "head": 6.0, "head_over_base": None},
    }


def test_nested_figures_are_compared_by_dotted_keys_and_raw_runs_are_not() -> None:
    base = [{"median": {"crash": {"recover_s": 2.0}}, "runs": {"crash": [{"recover_s": 9.0}]}}]
    head = [{"median": {"crash": {"recover_s": 3.0}}, "runs": {"crash": [{"recover_s": 9.0}]}}]
    assert compare(base, head) == {
        "median.crash.recover_s": {"base": 2.0, "head": 3.0, "head_over_base": 1.5}
    }

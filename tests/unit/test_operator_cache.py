"""The operator's cache of watched objects and its choice of a job's copy (``operator/cache.py``)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from trainguard_operator.cache import ObjectCache, fresher_body, without_managed_fields, write_still_ahead
from trainguard_operator.render import JOB_LABEL


def obj(
    name: str, version: int, job: str | None = "a", uid: str | None = None, ns: str = "ns"
) -> dict[str, Any]:
    labels = {JOB_LABEL: job} if job else {"app": "other"}
    return {
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": uid or f"uid-{name}",
            "resourceVersion": str(version),
            "labels": labels,
        }
    }


def test_events_fill_the_cache_by_job_and_name_the_jobs_they_change() -> None:
    cache = ObjectCache()
    assert cache.apply("ADDED", obj("p1", 1)) == {("ns", "a")}
    assert cache.apply("ADDED", obj("p2", 2, job="b")) == {("ns", "b")}
    assert cache.apply("MODIFIED", obj("p1", 1)) == set()  # nothing new
    assert [o["metadata"]["name"] for o in cache.of_job("ns", "a")] == ["p1"]
    assert cache.apply("DELETED", obj("p1", 3)) == {("ns", "a")}
    assert cache.of_job("ns", "a") == []


def test_other_workloads_objects_are_never_held() -> None:
    cache = ObjectCache()
    assert cache.apply("ADDED", obj("theirs", 1, job=None)) == set()
    assert cache.replace([obj("theirs", 1, job=None)], None) == set()
    assert len(cache) == 0


def test_an_older_state_or_a_deleted_objects_late_answer_does_not_come_back() -> None:
    cache = ObjectCache()
    cache.apply("MODIFIED", obj("j", 5))
    assert cache.apply("ADDED", obj("j", 4)) == set()  # a write's answer after the watch's later news
    assert cache.of_job("ns", "a")[0]["metadata"]["resourceVersion"] == "5"
    cache.apply("DELETED", obj("j", 6))
    assert cache.apply("ADDED", obj("j", 5)) == set()
    assert cache.of_job("ns", "a") == []
    # A namesake (another uid) is another object.
    assert cache.apply("ADDED", obj("j", 9, uid="new")) == {("ns", "a")}


def test_a_list_replaces_its_namespace_only_and_marks_the_kind_served() -> None:
    cache = ObjectCache()
    cache.apply("ADDED", obj("p1", 1))
    cache.apply("ADDED", obj("q1", 2, ns="other"))
    assert cache.mark_absent("ns") == {("ns", "a")}
    assert cache.absent
    assert cache.replace([obj("p2", 3)], "ns") == {("ns", "a")}
    assert not cache.absent
    assert [o["metadata"]["name"] for o in cache.of_job("ns", "a")] == ["p2"]
    assert [o["metadata"]["name"] for o in cache.of_job("other", "a")] == ["q1"]


events = st.lists(
    st.tuples(
        st.sampled_from(["ADDED", "MODIFIED", "DELETED"]),
        st.sampled_from(["p1", "p2", "p3"]),
        st.sampled_from(["a", "b"]),
        st.integers(1, 50),
    ),
    max_size=20,
)


@given(
    before=events, listed=st.dictionaries(st.sampled_from(["p1", "p2", "p4"]), st.sampled_from(["a", "b"]))
)
def test_after_a_relist_the_cache_is_the_listing_whatever_it_held(
    before: list[tuple[str, str, str, int]], listed: dict[str, str]
) -> None:
    cache = ObjectCache()
    for kind, name, job, version in before:
        cache.apply(kind, obj(name, version, job=job, uid=f"{name}-{version}"))
    cache.replace([obj(name, 100, job=job, uid=f"{name}-100") for name, job in listed.items()], None)
    held = {(o["metadata"]["name"], job) for job in ("a", "b") for o in cache.of_job("ns", job)}
    assert held == set(listed.items())


def test_the_newer_copy_of_a_job_is_acted_on_and_an_undecidable_one_is_read_fresh() -> None:
    watched, written = obj("job", 7), obj("job", 9)
    assert fresher_body(watched, None) is watched
    assert fresher_body(watched, written) is written  # kopf's copy predates the operator's own write
    assert fresher_body(obj("job", 10), written)["metadata"]["resourceVersion"] == "10"  # type: ignore[index]
    assert fresher_body(watched, obj("job", 9, uid="namesake")) is watched
    odd = obj("job", 1)
    odd["metadata"]["resourceVersion"] = "opaque"
    assert fresher_body(odd, written) is None
    assert fresher_body(None, written) is None


def test_the_operator_s_own_write_is_kept_only_until_kopf_s_copy_catches_up() -> None:
    written = obj("job", 9)
    assert write_still_ahead(obj("job", 7), written) is written  # kopf's copy still predates it
    assert write_still_ahead(obj("job", 9), written) is None  # caught up: no second copy at rest
    assert write_still_ahead(obj("job", 12), written) is None
    assert write_still_ahead(obj("job", 7, uid="namesake"), written) is None  # another object now
    odd = obj("job", 1)
    odd["metadata"]["resourceVersion"] = "opaque"
    assert write_still_ahead(odd, written) is written  # cannot be told: kept, and the job read fresh
    assert write_still_ahead(None, written) is written
    assert write_still_ahead(obj("job", 7), None) is None


def test_only_what_decisions_read_is_kept_of_an_object() -> None:
    pod = obj("p", 1)
    pod["metadata"]["managedFields"] = [{"manager": "kubelet"}]
    pod["spec"] = {"nodeName": "node-1", "containers": [{"name": "pytorch", "env": [{"name": "A"}]}]}
    pod["status"] = {"phase": "Running"}
    cache = ObjectCache()
    cache.apply("ADDED", pod)
    held = cache.of_job("ns", "a")[0]
    assert held["spec"] == {"nodeName": "node-1"}
    assert held["status"] == {"phase": "Running"}
    assert "managedFields" not in held["metadata"]
    assert held["metadata"]["labels"] == {JOB_LABEL: "a"}
    # A change of what is not kept is no change.
    pod["spec"]["containers"] = []
    assert cache.apply("MODIFIED", pod) == set()


def test_a_kept_job_drops_only_its_managed_fields() -> None:
    job = obj("job", 3)
    job["metadata"]["managedFields"] = [{"manager": "trainguard", "fieldsV1": {"f:status": {}}}]
    job["spec"] = {"maxSteps": 10}
    job["status"] = {"attempt": 2}
    slim = without_managed_fields(job)
    assert "managedFields" not in slim["metadata"]
    assert "managedFields" in job["metadata"]  # the answer itself is left alone
    del job["metadata"]["managedFields"]
    assert slim == job
    assert without_managed_fields({"kind": "X"}) == {"kind": "X"}


def test_a_creations_late_answer_never_hides_what_the_watch_showed_of_that_object() -> None:
    # The creation's answer (no status) arrives after the watch's later state (status set). Versions
    # that are not integers cannot order the two; the uid can.
    for version in ("7", "opaque"):
        cache = ObjectCache()
        later = obj("j", 8) | {"status": {"conditions": [{"type": "Succeeded", "status": "True"}]}}
        later["metadata"]["resourceVersion"] = "later" if version == "opaque" else "8"
        cache.apply("MODIFIED", later)
        answer = obj("j", 7)
        answer["metadata"]["resourceVersion"] = version
        assert cache.created(answer) == set()
        assert cache.of_job("ns", "a")[0]["status"] == later["status"]
    # The answer is the manifest as sent (no uid, no version): the watch's copy stays.
    cache = ObjectCache()
    cache.apply("MODIFIED", later)
    sent = obj("j", 1)
    del sent["metadata"]["uid"], sent["metadata"]["resourceVersion"]
    assert cache.created(sent) == set()
    assert cache.of_job("ns", "a")[0]["status"] == later["status"]
    # Held under another uid (an earlier namesake whose deletion the watch has not shown): replaced.
    cache = ObjectCache()
    cache.apply("ADDED", obj("j", 3, uid="old"))
    assert cache.created(obj("j", 9, uid="new")) == {("ns", "a")}
    assert cache.of_job("ns", "a")[0]["metadata"]["uid"] == "new"
    # Not held at all: held from now on.
    assert ObjectCache().created(obj("k", 1)) == {("ns", "a")}

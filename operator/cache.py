"""What the operator keeps in memory of the objects it watches, and which copy of a job to act on. Pure.

The operator's watches (``kube.Informer``) feed an ``ObjectCache`` per kind (PyTorchJobs, pods): a list
replaces everything of its scope (so an object deleted while a watch was down is gone after the relist
that follows), and each watch event adds, changes or removes one object. Only objects labelled with a
job (``JOB_LABEL``) are held, whatever the API server sent. Each change names the jobs it concerns, so
their reconciles can be woken at once; nothing is read from the API server to reconcile a job.

``fresher_body`` picks which copy of a GuardedTrainingJob a reconcile step acts on: kopf's (fed by its
watch) or the one the operator's own last status write returned, whichever is newer; when that cannot
be told, the caller reads the job fresh from the API server.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from trainguard_operator.pods import labels, meta
from trainguard_operator.render import JOB_LABEL

#: A job, as ``(namespace, name)``.
JobKey = tuple[str, str]
#: How many uids of deleted objects are remembered (see ``ObjectCache.apply``).
FORGOTTEN_UIDS = 4096


#: The metadata a decision reads of a PyTorchJob or a pod (``pods``, ``reconcile``).
KEPT_METADATA = (
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "labels",
    "ownerReferences",
    "creationTimestamp",
    "deletionTimestamp",
)


def kept(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator keeps of a PyTorchJob or a pod: the metadata in ``KEPT_METADATA``, the status,
    and of the spec only the node (a failure names it). A PyTorchJob's spec (every pod template) and
    a pod's (containers, environment) are most of their size and nothing decides from them."""
    found = meta(obj)
    slim: dict[str, Any] = {key: obj[key] for key in ("apiVersion", "kind", "status") if key in obj}
    slim["metadata"] = {key: found[key] for key in KEPT_METADATA if key in found}
    spec = obj.get("spec")
    if isinstance(spec, Mapping) and spec.get("nodeName"):
        slim["spec"] = {"nodeName": spec["nodeName"]}
    return slim


def without_managed_fields(obj: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` without ``metadata.managedFields`` (the server-side apply bookkeeping), a shallow copy
    otherwise. A GuardedTrainingJob the operator keeps (its last status write's answer, one per job) is
    about half managedFields, which nothing here reads: at thousands of jobs that half is most of the
    operator's memory that is not kopf's own."""
    slim = dict(obj)
    found = meta(obj)
    if "managedFields" in found:
        slim["metadata"] = {key: value for key, value in found.items() if key != "managedFields"}
    return slim


def job_of(obj: Mapping[str, Any]) -> JobKey | None:
    """The job an object belongs to by its label, or None when it carries none."""
    job = labels(obj).get(JOB_LABEL)
    if not isinstance(job, str) or not job:
        return None
    return str(meta(obj).get("namespace") or "default"), job


def version_of(obj: Mapping[str, Any] | None) -> int | None:
    """An object's resourceVersion as an integer, or None when it has none or it is not one."""
    if obj is None:
        return None
    raw = meta(obj).get("resourceVersion")
    try:
        return int(str(raw))
    except ValueError:
        return None


def _older(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    """Whether ``new`` is known to be an older state of ``old`` (both versions are integers)."""
    new_version, old_version = version_of(new), version_of(old)
    return new_version is not None and old_version is not None and new_version < old_version


class ObjectCache:
    """The objects of one kind that carry a job label, as the watches last showed them (what
    ``kept`` keeps of them).

    ``absent`` says the API server does not serve the kind at all (a list answered 404: the PyTorchJob
    CRD is not installed); ``synced`` that a list has filled the cache at least once.
    """

    def __init__(self) -> None:
        self._objects: dict[tuple[str, str], Mapping[str, Any]] = {}
        self._by_job: dict[JobKey, set[tuple[str, str]]] = {}
        self._gone: dict[str, None] = {}
        self.absent = False
        self.synced = False

    def __len__(self) -> int:
        return len(self._objects)

    def of_job(self, namespace: str, job: str) -> list[Mapping[str, Any]]:
        """The objects labelled with ``job`` in ``namespace``, ordered by name."""
        keys = sorted(self._by_job.get((namespace, job), ()))
        return [self._objects[key] for key in keys]

    def _put(self, key: tuple[str, str], obj: Mapping[str, Any] | None) -> set[JobKey]:
        """Store (or with None remove) one object; the jobs whose objects changed."""
        touched: set[JobKey] = set()
        old = self._objects.pop(key, None)
        if old is not None:
            old_job = job_of(old)
            if old_job is not None:
                self._by_job[old_job].discard(key)
                if not self._by_job[old_job]:
                    del self._by_job[old_job]
                touched.add(old_job)
        new_job = job_of(obj) if obj is not None else None
        if obj is not None and new_job is not None:
            obj = kept(obj)
            self._objects[key] = obj
            self._by_job.setdefault(new_job, set()).add(key)
            touched.add(new_job)
        if old is not None and obj is not None and old == obj:
            return set()
        return touched

    @staticmethod
    def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
        return str(meta(obj).get("namespace") or "default"), str(meta(obj).get("name", ""))

    def created(self, obj: Mapping[str, Any]) -> set[JobKey]:
        """The answer to the operator's own creation of ``obj``: its first state, held unless the
        watch already showed this object (the same uid, or any object of that name when the answer
        carries no uid: it is the manifest as sent), whose copy is then as new or newer; returns the
        jobs whose objects changed.

        Versions alone cannot say so where an API server's are not integers (they are opaque), and a
        creation's answer can arrive after the watch reported a later state (its status set).
        """
        held = self._objects.get(self._key(obj))
        if held is not None and held_uid(obj) in ("", held_uid(held)):
            return set()
        return self.apply("ADDED", obj)

    def apply(self, kind: str, obj: Mapping[str, Any]) -> set[JobKey]:
        """One watch event (``ADDED``, ``MODIFIED``, ``DELETED``), or the answer of the operator's own
        write (``ADDED``); returns the jobs whose objects changed.

        A state older than the one held (by resourceVersion) is ignored, and so is a non-deletion of an
        object whose deletion was already seen (by uid): a write's answer may arrive after the watch
        has reported later states.
        """
        key = self._key(obj)
        uid = str(meta(obj).get("uid") or "")
        held = self._objects.get(key)
        if kind == "DELETED":
            if uid:
                self._gone[uid] = None
                while len(self._gone) > FORGOTTEN_UIDS:
                    del self._gone[next(iter(self._gone))]
            if held is not None and held_uid(held) not in ("", uid) and uid:
                return set()  # the deletion of a namesake already replaced
            return self._put(key, None)
        if uid and uid in self._gone:
            return set()
        if held is not None and held_uid(held) == uid and _older(obj, held):
            return set()
        return self._put(key, obj)

    def replace(self, items: Iterable[Mapping[str, Any]], namespace: str | None) -> set[JobKey]:
        """A list's answer for ``namespace`` (None: every namespace): what it does not show is gone;
        returns the jobs whose objects changed."""
        self.absent = False
        self.synced = True
        listed = {self._key(obj): obj for obj in items if job_of(obj) is not None}
        touched: set[JobKey] = set()
        for key in [k for k in self._objects if namespace is None or k[0] == namespace]:
            if key not in listed:
                touched |= self._put(key, None)
        for key, obj in listed.items():
            touched |= self._put(key, obj)
        return touched

    def mark_absent(self, namespace: str | None) -> set[JobKey]:
        """The kind is not served (a list answered 404): nothing of it exists in ``namespace``; returns
        the jobs that had objects of it."""
        touched = self.replace((), namespace)
        self.absent = True
        return touched

    def jobs(self) -> set[JobKey]:
        """Every job that has objects in the cache."""
        return set(self._by_job)


def held_uid(obj: Mapping[str, Any]) -> str:
    """An object's uid ("" when it has none)."""
    return str(meta(obj).get("uid") or "")


def fresher_body(
    watched: Mapping[str, Any] | None, written: Mapping[str, Any] | None
) -> Mapping[str, Any] | None:
    """The copy of a GuardedTrainingJob a reconcile step may act on: ``watched`` (kopf's, fed by its
    watch) unless ``written`` (what the operator's own last status write returned) is newer; None when
    it cannot be told which is newer (then read the job fresh).

    kopf's copy may predate the operator's last write (its watch event is still on the way): acting on
    it would decide again what that write already recorded, e.g. a second restart for one failure.
    """
    if watched is None:
        return None
    if written is None or held_uid(written) != held_uid(watched):
        return watched
    watched_version, written_version = version_of(watched), version_of(written)
    if meta(watched).get("resourceVersion") == meta(written).get("resourceVersion"):
        return watched
    if watched_version is None or written_version is None:
        return None
    return watched if watched_version > written_version else written


def write_still_ahead(
    watched: Mapping[str, Any] | None, written: Mapping[str, Any] | None
) -> Mapping[str, Any] | None:
    """What to keep of the operator's own last status write's answer: ``written`` while kopf's copy may
    still predate it (``fresher_body`` picks it, or cannot tell), None once kopf's copy has caught up or
    belongs to another object of that name. A job at rest then holds no second copy of itself: at
    thousands of jobs that copy was a tenth of the operator's memory."""
    if written is None or watched is None:
        return written
    chosen = fresher_body(watched, written)
    return written if chosen is None or chosen is written else None

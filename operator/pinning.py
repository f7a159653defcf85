"""The spec a job runs with: the fields pinned when it starts, the changes refused while it runs, and
the world size re-pinned at a new attempt. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainguard.core.spec import GuardedTrainingJobSpec

#: Spec fields pinned when a job starts (see ``spec_change``); every other field may change at once.
IMMUTABLE_FIELDS = ("replicas", "nprocPerNode", "template", "checkpoint", "backend")
#: Pinned fields a change of which is accepted and takes effect at the next gang restart (the world
#: size: checkpoints resume under another one); the others are fixed for the life of the job.
RESIZABLE_FIELDS = ("replicas", "nprocPerNode")


def without_nulls(value: Any) -> Any:
    """``value`` without null object members, at any depth (inside lists too), as the API server stores
    it: a JSON merge patch (how the status is written) drops them everywhere."""
    if isinstance(value, Mapping):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def pin(spec: GuardedTrainingJobSpec) -> dict[str, Any]:
    """The immutable part of a spec (``IMMUTABLE_FIELDS``) in its wire form, without nulls (as
    it reads back from the status it is stored in)."""
    wire = spec.model_dump(by_alias=True, mode="json")
    return {key: without_nulls(wire[key]) for key in IMMUTABLE_FIELDS}


def changed_paths(old: Any, new: Any, prefix: str) -> list[str]:
    """Dotted paths where ``new`` differs from ``old``; objects are compared key by key, lists whole."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        paths: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            paths += changed_paths(old.get(key), new.get(key), f"{prefix}.{key}")
        return paths
    return [] if old == new else [prefix]


def spec_change(
    pinned: Mapping[str, Any], spec: GuardedTrainingJobSpec
) -> tuple[GuardedTrainingJobSpec, list[str]]:
    """The spec to act on, and the refused changes: the current spec with the pinned immutable fields.

    Accepted while the job runs: ``recovery`` (the next decisions use it), ``dataQuality`` (at once),
    ``health`` and ``guard`` (the operator's polling at once; the pods at the next attempt, as pods
    cannot change), ``replicas`` and ``nprocPerNode`` (pinned per attempt: the next gang restart re-pins
    them, see ``repin_world``; the checkpoint resumes under the new world size, its shards resharded and
    its data position carried in samples). Refused: ``template`` (a new image or command mid-run would
    resume checkpoints with different code) and ``checkpoint`` (a new claim or path would start over
    from nothing while the old checkpoints are orphaned) and ``backend`` (the attempts' objects are of
    one kind for the job's life).
    """
    # Both sides without nulls: a pin stored before nulls were dropped compares equal to its spec too. A
    # field pinned by nothing (a job pinned before the field existed) keeps the spec's value.
    current = pin(spec)
    pinned = {key: pinned.get(key, current[key]) for key in IMMUTABLE_FIELDS}
    resizable = tuple(f"spec.{key}" for key in RESIZABLE_FIELDS)
    refused = [
        path
        for path in changed_paths(without_nulls(pinned), current, "spec")
        if path not in resizable and not path.startswith(tuple(f"{r}." for r in resizable))
    ]
    effective = GuardedTrainingJobSpec.model_validate(
        {**spec.model_dump(by_alias=True, mode="json"), **pinned}
    )
    return effective, refused


def repin_world(pinned: Mapping[str, Any], spec: GuardedTrainingJobSpec) -> tuple[dict[str, Any], list[str]]:
    """The pin for a new attempt: ``pinned`` with the spec's ``replicas`` and ``nprocPerNode`` (the next
    gang runs at the world size asked for now), and the fields that changed, as ``spec.FIELD old -> new``."""
    current = pin(spec)
    changes = [
        f"spec.{key} {pinned.get(key)} -> {current[key]}"
        for key in RESIZABLE_FIELDS
        if key in pinned and pinned[key] != current[key]
    ]
    return {**pinned, **{key: current[key] for key in RESIZABLE_FIELDS}}, changes

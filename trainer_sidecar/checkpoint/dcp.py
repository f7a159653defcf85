"""Moving a model and its optimizer between trainguard checkpoints and torch.distributed.checkpoint (DCP).

A DCP checkpoint here holds ``{"model": {NAME: tensor}, "optimizer": {"state": {NAME: {KEY: value}},
"param_groups": [{..., "params": [NAME, ...]}]}}``: the model's state dict, and the optimizer's keyed by
parameter name (the form of ``torch.distributed.checkpoint.state_dict.get_state_dict``, which
torchtitan- and torchtune-style loops save and load). The names come from the checkpoint's
``param_names`` (the model's name of each optimizer parameter, in the optimizer's order).

``export_dcp`` reads a trainguard checkpoint (every tensor whole, in this one process: an offline tool)
and writes it with DCP. ``import_dcp`` reads a DCP checkpoint into a new trainguard checkpoint of one
writer, which a job of any world size resumes (its shards re-cut on load). DCP's metadata file is a
pickle, which can run code when it is read: ``import_dcp`` refuses unless told
``i_trust_this_pickle=True`` (``trainguard checkpoint import-dcp --i-trust-this-pickle``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from trainer_sidecar.checkpoint.errors import CheckpointError
from trainer_sidecar.checkpoint.store import CheckpointStore
from trainer_sidecar.counters import GuardCounters
from trainer_sidecar.settings import GuardThresholds
from trainer_sidecar.status import CheckpointRef

PICKLE_WARNING = (
    "a DCP checkpoint's metadata (.metadata) and any non-tensor value in it are pickles, and reading a "
    "pickle can run code: import only a checkpoint you trust, saying so with i_trust_this_pickle=True "
    "(trainguard checkpoint import-dcp --i-trust-this-pickle)"
)


def to_dcp_form(state: dict[str, Any]) -> dict[str, Any]:
    """A trainguard checkpoint's model and optimizer state, the optimizer keyed by parameter name."""
    names = state.get("param_names")
    optimizer = state.get("optimizer")
    if not isinstance(names, list) or not isinstance(optimizer, dict) or None in names:
        raise CheckpointError("the checkpoint does not name every optimizer parameter (param_names)")
    groups = []
    for group in optimizer.get("param_groups", []):
        groups.append({**group, "params": [names[index] for index in group["params"]]})
    per_name = {names[index]: dict(entry) for index, entry in optimizer.get("state", {}).items()}
    return {"model": dict(state["model"]), "optimizer": {"state": per_name, "param_groups": groups}}


def from_dcp_form(loaded: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``to_dcp_form``: optimizer state keyed by position, and ``param_names``."""
    optimizer = loaded["optimizer"]
    names = [name for group in optimizer["param_groups"] for name in group["params"]]
    index = {name: position for position, name in enumerate(names)}
    groups, start = [], 0
    for group in optimizer["param_groups"]:
        count = len(group["params"])
        groups.append({**group, "params": list(range(start, start + count))})
        start += count
    state = {index[name]: entry for name, entry in optimizer.get("state", {}).items()}
    return {
        "model": loaded["model"],
        "optimizer": {"state": state, "param_groups": groups},
        "param_names": names,
    }


def export_dcp(store: CheckpointStore, step: int | None, destination: Path) -> int:
    """Write checkpoint ``step`` of ``store`` (its newest valid one when None) to ``destination`` as a DCP
    checkpoint (see the module's docstring); returns the step written. Raises CheckpointError when there
    is no such checkpoint or it does not name its optimizer's parameters."""
    chosen = store.newest_valid() if step is None else step
    if chosen is None:
        raise CheckpointError(f"{store.root}: no valid checkpoint to export")
    verdict = store.verify(chosen)
    if not verdict.valid:
        raise CheckpointError(f"{store.root}: checkpoint {chosen} is not valid: {verdict.reason}")
    state = store.load(chosen)
    dcp_save(to_dcp_form(state), checkpoint_id=str(destination), no_dist=True)
    return chosen


def _empty_like_saved(source: Path) -> dict[str, Any]:
    """A state dict holding, for every tensor the DCP checkpoint has, an empty tensor of its shape and
    dtype (and a placeholder for every other value), nested as saved. Reads the pickled metadata."""
    metadata = FileSystemReader(str(source)).read_metadata()
    paths: dict[str, Any] = dict(metadata.planner_data or {})
    nested: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        path = paths.get(key, (key,))
        node = nested
        for part in path[:-1]:
            node = node.setdefault(part, {})
        if isinstance(entry, TensorStorageMetadata):
            node[path[-1]] = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            node[path[-1]] = None
    listed: dict[str, Any] = _lists(nested)
    return listed


def _lists(node: Any) -> Any:
    """``node`` with every dict keyed by the integers 0..n-1 (a list, as DCP flattens one) a list again."""
    if not isinstance(node, dict):
        return node
    if node and set(node) == set(range(len(node))):
        return [_lists(node[index]) for index in range(len(node))]
    return {key: _lists(value) for key, value in node.items()}


def import_dcp(
    source: Path, store: CheckpointStore, step: int, *, i_trust_this_pickle: bool = False
) -> CheckpointRef | None:
    """Read the DCP checkpoint at ``source`` (saved in the form of the module's docstring) and write it as
    checkpoint ``step`` of ``store`` (a store of one rank); a job started on that directory resumes it.
    Refuses with CheckpointError unless ``i_trust_this_pickle`` (see ``PICKLE_WARNING``)."""
    if not i_trust_this_pickle:
        raise CheckpointError(f"{source}: not imported: {PICKLE_WARNING}")
    if store.world_size != 1:
        raise CheckpointError("a DCP checkpoint is imported by a store of one rank")
    try:
        loaded = _empty_like_saved(source)
        dcp_load(loaded, checkpoint_id=str(source), no_dist=True)
        state = from_dcp_form(loaded)
    except (OSError, KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{source}: not a DCP checkpoint of a model and its optimizer: {exc}") from exc
    counters = GuardCounters(max_grad_norm=GuardThresholds().max_grad_norm, step=step)
    state.update(guardian=counters.to_state(), scheduler=None, scaler=None)
    return store.save(step, state, {"loss": None, "state_finite": True, "clean": True})

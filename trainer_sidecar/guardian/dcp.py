"""Moving a model and its optimizer between trainguard checkpoints and torch.distributed.checkpoint (DCP).

``export_dcp`` writes ``{"model": {NAME: tensor}, "optimizer": {"state": {NAME: {KEY: value}},
"param_groups": [{..., "params": [NAME, ...]}]}}``: the model's state dict, and the optimizer's keyed by
parameter name (the form of ``torch.distributed.checkpoint.state_dict.get_state_dict``). The names come
from the checkpoint's ``param_names`` (the model's name of each optimizer parameter, in the optimizer's
order). It reads every tensor whole, in this one process: an offline tool.

``import_dcp`` also reads what torchtitan-style loops save: the optimizer state flattened
(``get_optimizer_state_dict`` with ``flatten_optimizer_state_dict=True``: ``state.NAME.KEY`` and
``param_groups.NAME.KEY`` entries), the model under ``model`` or at the top level beside the other
states, and the step from ``train_state.step``. Only the model, the optimizer and that step are read;
other states (a data loader's, a scheduler's, pickled loss histories) are left in the file. It writes
a new trainguard checkpoint of one writer, which a job of any world size resumes (its shards re-cut on
load). DCP's metadata file is a pickle, which can run code when it is read: ``import_dcp`` refuses
unless told ``i_trust_this_pickle=True`` (``trainguard checkpoint import-dcp --i-trust-this-pickle``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from trainer_sidecar.checkpoint.errors import CheckpointError
from trainer_sidecar.checkpoint.store import CheckpointStore
from trainer_sidecar.contract.settings import GuardThresholds
from trainer_sidecar.guardian.counters import GuardCounters

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
    is no such checkpoint or it does not name its optimizer's parameters, and when ``destination`` is
    anything but a new or empty folder (nothing there is overwritten)."""
    chosen = store.newest_valid() if step is None else step
    if chosen is None:
        raise CheckpointError(f"{store.root}: no valid checkpoint to export")
    verdict = store.verify(chosen)
    if not verdict.valid:
        raise CheckpointError(f"{store.root}: checkpoint {chosen} is not valid: {verdict.reason}")
    if destination.is_symlink() or (destination.exists() and not _empty_dir(destination)):
        raise CheckpointError(f"{destination}: exists and is not an empty folder: export to a new one")
    state = store.load(chosen)
    try:
        dcp_save(to_dcp_form(state), checkpoint_id=str(destination), no_dist=True)
    except OSError as exc:
        raise CheckpointError(f"{destination}: not written: {exc}") from exc
    except CheckpointException as exc:  # a BaseException: it would pass every ``except Exception``
        raise CheckpointError(f"{destination}: not written: {_dcp_failure(exc)}") from exc
    return chosen


def _dcp_failure(exc: CheckpointException) -> str:
    """DCP's failure in one line per rank (its own text carries whole tracebacks)."""
    failures = exc.failures or {}
    if not failures:
        return str(exc.args[0]) if exc.args else "DCP failed"
    parts = []
    for rank, wrapped in sorted(failures.items()):
        error = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        parts.append(f"rank {rank}: {type(error).__name__}: {error}")
    return "; ".join(parts)


def _empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


#: States a torchtitan-style checkpoint keeps beside the model and optimizer (not imported, bar the step).
_OTHER_STATES = ("train_state", "lr_scheduler", "dataloader")


def _saved_skeleton(source: Path) -> dict[str, Any]:
    """For every entry of the DCP checkpoint, nested as saved: an empty tensor of its shape and dtype, or
    None for a value that is not a tensor. Reads the pickled metadata."""
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


def _what_to_read(saved: dict[str, Any], source: Path) -> dict[str, Any]:
    """The part of ``_saved_skeleton`` to load: the model (nested or at the top level), the optimizer,
    and ``train_state.step``. CheckpointError when there is no model or no optimizer state."""
    wanted: dict[str, Any] = {}
    if isinstance(saved.get("model"), dict):
        wanted["model"] = saved["model"]
    else:  # torchtitan flattens the model's entries into the top level
        wanted.update({key: value for key, value in saved.items() if isinstance(value, torch.Tensor)})
    if not wanted:
        raise CheckpointError(
            f"{source}: no model weights found (neither under 'model' nor at the top level)"
        )
    if not isinstance(saved.get("optimizer"), dict):
        raise CheckpointError(
            f"{source}: holds no optimizer state (a weights-only export?): a job resumes a model and its "
            "optimizer; load weights alone with the model's load_state_dict"
        )
    wanted["optimizer"] = saved["optimizer"]
    train_state = saved.get("train_state")
    if isinstance(train_state, dict) and isinstance(train_state.get("step"), torch.Tensor):
        wanted["train_state"] = {"step": train_state["step"]}
    return wanted


def _unflattened_optimizer(optimizer: dict[str, Any], param_order: list[str]) -> dict[str, Any]:
    """``{"state": {NAME: {KEY: value}}, "param_groups": [...]}`` from either form (see the module's
    docstring). The flattened form keeps each parameter's hyperparameters, not its group: a group is
    rebuilt from the parameters that share every hyperparameter, in the order of ``param_order``, and
    groups in the order of their first parameter (two groups with equal hyperparameters become one, which
    an optimizer that kept them apart refuses to load)."""
    if "param_groups" in optimizer:
        return optimizer
    state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, value in optimizer.items():
        section, _, rest = key.partition(".")
        name, _, field = rest.rpartition(".")
        if section not in ("state", "param_groups") or not name:
            raise ValueError(f"optimizer entry {key!r} is neither state.NAME.KEY nor param_groups.NAME.KEY")
        (state if section == "state" else hyper).setdefault(name, {})[field] = value
    unknown = sorted(set(hyper) - set(param_order))
    if unknown:
        raise ValueError(f"optimizer parameters {unknown[:3]} are not entries of the model")
    groups: list[dict[str, Any]] = []
    for name in (name for name in param_order if name in hyper):
        same = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == hyper[name]), None)
        if same is not None:
            same["params"].append(name)
        else:
            groups.append({**hyper[name], "params": [name]})
    return {"state": state, "param_groups": groups}


def _lists(node: Any) -> Any:
    """``node`` with every dict keyed by the integers 0..n-1 (a list, as DCP flattens one) a list again."""
    if not isinstance(node, dict):
        return node
    if node and set(node) == set(range(len(node))):
        return [_lists(node[index]) for index in range(len(node))]
    return {key: _lists(value) for key, value in node.items()}


def read_dcp(
    source: Path, step: int | None, *, i_trust_this_pickle: bool = False
) -> tuple[int, dict[str, Any]]:
    """Read the DCP checkpoint at ``source`` (in one of the forms of the module's docstring) as the step
    and state of a trainguard checkpoint, writing nothing anywhere. ``step`` None takes the checkpoint's
    ``train_state.step``.

    Refuses with CheckpointError unless ``i_trust_this_pickle`` (see ``PICKLE_WARNING``; then nothing is
    read), and when the checkpoint does not load (DCP's own failures included) or lacks a model, an
    optimizer state or (``step`` None) a step."""
    if not i_trust_this_pickle:
        raise CheckpointError(f"{source}: not imported: {PICKLE_WARNING}")
    try:
        loaded = _what_to_read(_saved_skeleton(source), source)
        dcp_load(loaded, checkpoint_id=str(source), no_dist=True)
        if "model" in loaded:
            model = loaded["model"]
        else:
            model = {key: value for key, value in loaded.items() if key not in ("optimizer", *_OTHER_STATES)}
        optimizer = _unflattened_optimizer(loaded["optimizer"], list(model))
        state = from_dcp_form({"model": model, "optimizer": optimizer})
    except CheckpointError:
        raise
    except CheckpointException as exc:  # a BaseException: it would pass ``except Exception``
        raise CheckpointError(f"{source}: not a readable DCP checkpoint: {_dcp_failure(exc)}") from exc
    except Exception as exc:  # unpickling a damaged or foreign file can raise any exception at all
        raise CheckpointError(
            f"{source}: not a DCP checkpoint of a model and its optimizer: {exc!r}"
        ) from exc
    if step is None:
        saved_step = loaded.get("train_state", {}).get("step")
        if saved_step is None:
            raise CheckpointError(f"{source}: has no train_state.step: say which step it is (--step)")
        step = int(saved_step)
    counters = GuardCounters(max_grad_norm=GuardThresholds().max_grad_norm, step=step)
    state.update(guardian=counters.to_state(), scheduler=None, scaler=None)
    return step, state


def write_imported(store: CheckpointStore, step: int, state: dict[str, Any]) -> int:
    """Write what ``read_dcp`` read as checkpoint ``step`` of ``store`` (a store of one rank); returns the
    step. CheckpointError for a store of more ranks."""
    if store.world_size != 1:
        raise CheckpointError("a DCP checkpoint is imported by a store of one rank")
    store.save(step, state, {"loss": None, "state_finite": True, "clean": True})
    return step


def import_dcp(
    source: Path, store: CheckpointStore, step: int | None, *, i_trust_this_pickle: bool = False
) -> int:
    """``read_dcp`` then ``write_imported``: a job started on the store's directory resumes the DCP
    checkpoint. Every refusal comes before anything is written (see both)."""
    if store.world_size != 1:
        raise CheckpointError("a DCP checkpoint is imported by a store of one rank")
    found, state = read_dcp(source, step, i_trust_this_pickle=i_trust_this_pickle)
    return write_imported(store, found, state)

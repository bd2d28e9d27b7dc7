"""save / load: the state of a model (and optimizer, RNG, user extras) through DCP, sharded as it sits.

Layout of a checkpoint (DCP keys, flattened with dots):

- ``model.<key>``: every key of the original module's ``state_dict()``;
- ``optim.state.<parameter name>.<state name>`` and ``optim.param_groups`` (parameter names in
  ``params``): ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``'s layout;
- ``rng.rank<r>``: torch's CPU RNG state of rank ``r`` (and ``rng_cuda.rank<r>`` on CUDA);
- ``extra``: the user's ``extra``, pickled (``pickle.loads`` it after ``dcp_to_torch_save``);
- ``scaler.<key>``: ``scaler.state_dict()`` of a ``GradScaler`` passed as ``scaler=`` (the same on every rank:
  dynshard's scaler agrees on ``found_inf`` over all ranks), absent when none was passed or it is disabled.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..runtime.sharding import get_tag, stored_piece
from ..runtime.state_dict import _strip, unwrap_compiled
from . import io
from .planner import FileSystemWriter, LoadPlanner, SavePlanner
from .state import describe

_PRE_HOOK_ATTR = "_dynshard_checkpoint_cut_hook"
_SCALER = "scaler"


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    # a load before the first compiled step, where dynshard has not created the process group yet: this
    # rank's RNG state is still its own (torchrun's RANK), not rank 0's
    return int(os.environ.get("RANK", "0"))


def _model_state(model: torch.nn.Module) -> dict[str, Any]:
    module = unwrap_compiled(model)
    return {_strip(k): describe(v) if isinstance(v, torch.Tensor) else v
            for k, v in module.state_dict(keep_vars=True).items()}


def _aliases(model: torch.nn.Module) -> dict[str, str]:
    """Flattened checkpoint keys of tensors an earlier key of the state dict holds too (a tied embedding and
    LM head: ``model.lm_head.weight`` -> ``model.wte.weight``): written once (see :mod:`.planner`)."""
    first: dict[int, str] = {}
    aliases = {}
    for key, value in unwrap_compiled(model).state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            if id(value) in first:
                aliases[f"model.{_strip(key)}"] = f"model.{first[id(value)]}"
            else:
                first[id(value)] = _strip(key)
    return aliases


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): _strip(n) for n, p in unwrap_compiled(model).named_parameters()}


def _groups(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[dict[str, Any]]:
    groups = []
    for group in optimizer.param_groups:
        try:
            params = [names[id(p)] for p in group["params"]]
        except KeyError:
            raise ValueError("dynshard.checkpoint: the optimizer holds a parameter that is not the model's") from None
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    return groups


def _optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    names = _param_names(model)
    state = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param in optimizer.state:
                tag = get_tag(param)
                state[names[id(param)]] = {k: describe(v, tag) if isinstance(v, torch.Tensor) else v
                                           for k, v in optimizer.state[param].items()}
    return {"state": state, "param_groups": _groups(optimizer, names)}


def _rng_state() -> dict[str, torch.Tensor]:
    rank = _rank()
    state = {f"rng.rank{rank}": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[f"rng_cuda.rank{rank}"] = torch.cuda.get_rng_state()
    return state


def save(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: Any = None, *, scaler: Any = None) -> str:
    """Write this rank's pieces of ``model`` (and ``optimizer``) to the DCP checkpoint ``path``, atomically.

    Every rank calls it. Each rank writes only what it stores (tp shards, ZeRO rows without padding);
    pieces that several ranks hold are written once. ``extra`` (any picklable object, the same on every
    rank) comes back from :func:`load`. ``scaler`` (``dynshard.GradScaler`` or anything with torch's
    ``GradScaler.state_dict()``) saves the loss scale and its growth tracker, which :func:`load` restores
    into the scaler it is given. Returns ``path``.
    """
    state: dict[str, Any] = {"model": _model_state(model), "extra": pickle.dumps(extra)}
    if optimizer is not None:
        state["optim"] = _optimizer_state(model, optimizer)
    scaler_state = dict(scaler.state_dict()) if scaler is not None else {}
    if scaler_state:          # a disabled scaler has none (torch's GradScaler.state_dict() returns {})
        state[_SCALER] = scaler_state
    state.update(_rng_state())
    tmp = io.temporary_dir(path)
    aliases = _aliases(model)
    dcp.save(state, storage_writer=FileSystemWriter(tmp, aliases), planner=SavePlanner(aliases))
    io.publish(tmp, path)
    return path


def _load_placeholders(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, metadata: Any
                       ) -> tuple[dict[str, Any], dict[int, tuple[torch.Tensor, dict[str, Any]]]]:
    """The state dict to load into (model tensors in place) and, per parameter, the optimizer state
    tensors loaded into (created where the optimizer has none yet). Raises ValueError, before anything
    is read, where the checkpoint does not hold what ``model`` or ``optimizer`` needs."""
    state: dict[str, Any] = {"model": _model_state(model), "extra": b""}
    _check_model(path, state["model"], metadata)
    created: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
    if optimizer is not None:
        names = _param_names(model)
        by_name = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
        saved = _saved_optimizer_state(metadata)
        _check_optimizer(path, optimizer, by_name, saved, metadata)
        optim_state = {}
        for name, entries in saved.items():
            param = by_name[name]
            if _not_held(param):     # pipeline: another rank's stage; this rank keeps no state for it
                continue
            current = dict(optimizer.state.get(param, {}))
            for key, md in entries.items():
                if key in current:
                    continue
                if isinstance(md, TensorStorageMetadata):
                    tag = get_tag(param)
                    global_shape = tag.global_shape if tag is not None else param.shape
                    if tuple(md.size) == tuple(global_shape):
                        current[key] = torch.zeros_like(param.detach(), dtype=md.properties.dtype)
                    else:
                        current[key] = torch.zeros(md.size, dtype=md.properties.dtype)
                else:
                    current[key] = None
            created[id(param)] = (param, current)
            tag = get_tag(param)
            optim_state[name] = {k: describe(v, tag) if isinstance(v, torch.Tensor) else v
                                 for k, v in current.items()}
        state["optim"] = {"state": optim_state, "param_groups": _groups(optimizer, names)}
    rank_keys = [f"rng.rank{_rank()}", f"rng_cuda.rank{_rank()}"]
    for key in rank_keys:
        md = metadata.state_dict_metadata.get(key)
        if isinstance(md, TensorStorageMetadata):
            state[key] = torch.zeros(md.size, dtype=md.properties.dtype)
    return state, created


def _saved_optimizer_state(metadata: Any) -> dict[str, dict[str, Any]]:
    """Parameter name -> state name -> DCP's metadata of that saved optimizer state."""
    saved: dict[str, dict[str, Any]] = {}
    for key, path in metadata.planner_data.items():
        if len(path) == 4 and path[0] == "optim" and path[1] == "state":
            saved.setdefault(path[2], {})[path[3]] = metadata.state_dict_metadata[key]
    return saved


def _some(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def _check_model(path: str, model_state: dict[str, Any], metadata: Any) -> None:
    saved = {p[1] for p in metadata.planner_data.values() if len(p) >= 2 and p[0] == "model"}
    missing = [key for key in model_state if key not in saved]
    if not missing:
        return
    instead = sorted(saved - set(model_state))
    raise ValueError(f"dynshard.checkpoint: {path} holds no {_some(missing)} of this model"
                     + (f" (it holds {_some(instead)} instead)" if instead else "")
                     + ": load it into the model it was saved from (the same modules and names), or export it "
                     "with torch.distributed.checkpoint.format_utils.dcp_to_torch_save and load what matches "
                     "with load_state_dict(strict=False)")


def _optimizer_mismatch(path: str, optimizer: torch.optim.Optimizer, what: str) -> ValueError:
    return ValueError(f"dynshard.checkpoint: {path} does not match this {type(optimizer).__name__}: {what}. Build "
                      "the optimizer the checkpoint was saved with (the same class, options and parameters), or "
                      "call load(path, model) without the optimizer to load only the weights")


def _check_optimizer(path: str, optimizer: torch.optim.Optimizer, by_name: dict[str, torch.Tensor],
                     saved: dict[str, dict[str, Any]], metadata: Any) -> None:
    """Every rank raises the same error: not-held (pipeline) parameters are checked too."""
    foreign = [name for name in saved if name not in by_name]
    if foreign:
        raise _optimizer_mismatch(path, optimizer, f"the checkpoint has optimizer state for {_some(foreign)}, "
                                  "which this optimizer does not hold")
    stateless = [p for name, p in by_name.items() if name in saved and not optimizer.state.get(p)]
    first_step = (_first_step_keys(optimizer, stateless) if stateless else None) or {}
    mismatched = []
    for name, param in by_name.items():
        if name not in saved:        # the saving optimizer had none yet (no step, or no gradient)
            continue
        wanted = set(optimizer.state[param]) if optimizer.state.get(param) else first_step.get(id(param), set())
        missing = sorted(wanted - set(saved[name]))
        if missing:
            mismatched.append(f"parameter {name} needs optimizer state {', '.join(missing)}, but the checkpoint "
                              f"holds {', '.join(sorted(saved[name]))} for it")
    if mismatched:
        more = f" (and {len(mismatched) - 1} more parameters)" if len(mismatched) > 1 else ""
        raise _optimizer_mismatch(path, optimizer, mismatched[0] + more)
    _check_param_groups(path, optimizer, metadata)


def _check_param_groups(path: str, optimizer: torch.optim.Optimizer, metadata: Any) -> None:
    saved: dict[int, set[str]] = {}
    for p in metadata.planner_data.values():
        if len(p) >= 4 and p[0] == "optim" and p[1] == "param_groups":
            saved.setdefault(p[2], set()).add(p[3])
    if not saved:
        raise _optimizer_mismatch(path, optimizer, "the checkpoint holds no optimizer (it was saved without one)")
    if len(saved) != len(optimizer.param_groups):
        raise _optimizer_mismatch(path, optimizer, f"it has {len(optimizer.param_groups)} parameter groups, the "
                                  f"checkpoint {len(saved)}")
    for i, group in enumerate(optimizer.param_groups):
        options = sorted(saved[i] - {"params"})
        missing = sorted(set(group) - {"params"} - set(options))
        if missing:
            raise _optimizer_mismatch(path, optimizer, f"its parameter group {i} has options {', '.join(missing)}, "
                                      f"which the checkpoint's group lacks (it has {', '.join(options)})")


def _first_step_keys(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict[int, set[str]] | None:
    """The state names ``optimizer`` will create for each of ``params`` (by id) at its first step, or None
    when that cannot be found. A torch optimizer has no other way to tell than stepping: a new one of its
    class and options steps once over one-element stand-ins with zero gradients."""
    wanted = {id(p) for p in params}
    stand_ins: dict[int, torch.Tensor] = {}
    groups = []
    for group in optimizer.param_groups:
        mine = [stand_ins.setdefault(id(p), _stand_in(p)) for p in group["params"] if id(p) in wanted]
        if mine:
            options = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            groups.append({**options, "params": mine})
    try:
        probe = type(optimizer)(groups)
        probe.step()
    except Exception:       # the check only words an error better: an optimizer we cannot imitate loads unchecked
        return None
    return {key: set(probe.state.get(t, {})) for key, t in stand_ins.items()}


def _stand_in(param: torch.Tensor) -> torch.Tensor:
    """A one-element tensor with ``param``'s number of dimensions (its global one: a pipeline rank holds an
    empty tensor in place of another stage's parameter), dtype, device and gradient."""
    tag = get_tag(param)
    ndim = len(tag.global_shape) if tag is not None else param.dim()
    device = "cpu" if param.is_meta else param.device
    stand_in = torch.zeros((1,) * ndim, dtype=param.dtype, device=device, requires_grad=param.requires_grad)
    if param.requires_grad:
        stand_in.grad = torch.zeros_like(stand_in)
    return stand_in


def _not_held(param: torch.Tensor) -> bool:
    tag = get_tag(param)
    return tag is not None and tag.not_held


def _cut_whole_state_at_first_step(optimizer: torch.optim.Optimizer) -> None:
    """Optimizer state loaded before the first compiled step is whole; the first step has made each
    parameter this rank's piece, so before the optimizer steps, cut its state the same way (no
    communication: every rank holds the whole state), and drop the state of parameters another pipeline
    rank holds (a plain optimizer never creates any for them)."""
    if getattr(optimizer, _PRE_HOOK_ATTR, None) is not None:
        return

    def cut(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        pending = False
        for param, entries in list(opt.state.items()):
            tag = get_tag(param)
            if tag is not None and tag.not_held:     # another pipeline rank's: no state here, as without a load
                del opt.state[param]
                continue
            for key, value in list(entries.items()):
                if not isinstance(value, torch.Tensor) or value.shape == param.shape:
                    continue
                if tag is not None and tag.is_split and value.shape == tag.global_shape:
                    entries[key] = stored_piece(value, tag).clone()
                elif tag is None and value.dim():
                    pending = True
        if not pending:
            getattr(opt, _PRE_HOOK_ATTR).remove()
            setattr(opt, _PRE_HOOK_ATTR, None)

    setattr(optimizer, _PRE_HOOK_ATTR, optimizer.register_step_pre_hook(cut))


def _scaler_placeholder(path: str, metadata: Any, scaler: Any) -> dict[str, Any] | None:
    """The saved scaler's keys to load into, or None when there is nothing to restore."""
    if scaler is None:
        return None
    keys = [p[1] for p in metadata.planner_data.values() if len(p) == 2 and p[0] == _SCALER]
    if not keys:
        if getattr(scaler, "is_enabled", lambda: True)():
            raise ValueError(f"dynshard.checkpoint: {path} holds no GradScaler state (it was saved without "
                             "scaler=, or with a disabled scaler); load it without scaler= to keep this "
                             "scaler's own state")
        return None
    return {key: None for key in keys}


def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         scaler: Any = None) -> Any:
    """Load the checkpoint ``path`` (written by :func:`save` under any plan and world size) into
    ``model`` and ``optimizer`` in place, and restore this rank's RNG state if it was saved. Works before
    the first compiled step (whole tensors) and after (this rank's pieces). ``scaler`` gets the
    ``GradScaler`` state saved with ``save(..., scaler=)`` (``load_state_dict``). Returns ``extra``.

    A ``path`` that does not exist because a save over it was killed midway reads the checkpoint that
    save moved aside. Raises ValueError on every rank, before reading any tensor, when the checkpoint
    lacks a key of ``model``'s state dict, or state or options ``optimizer`` needs (another optimizer
    class, other options or other parameters)."""
    path = io.resolve(path)
    reader = dcp.FileSystemReader(path)
    metadata = reader.read_metadata()
    state, created = _load_placeholders(path, model, optimizer, metadata)
    scaler_state = _scaler_placeholder(path, metadata, scaler)
    if scaler_state is not None:
        state[_SCALER] = scaler_state
    dcp.load(state, storage_reader=reader, planner=LoadPlanner())
    if scaler_state is not None:
        scaler.load_state_dict(state[_SCALER])
    if optimizer is not None:
        loaded = state["optim"]
        for param, entries in created.values():
            optimizer.state[param] = entries
        for group, saved in zip(optimizer.param_groups, loaded["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if any(get_tag(p) is None for p, _ in created.values()):
            _cut_whole_state_at_first_step(optimizer)
    rng = state.get(f"rng.rank{_rank()}")
    if rng is not None:
        torch.set_rng_state(rng)
    rng_cuda = state.get(f"rng_cuda.rank{_rank()}")
    if rng_cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng_cuda)
    return pickle.loads(state["extra"])

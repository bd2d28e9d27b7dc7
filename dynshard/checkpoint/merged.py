"""nnScaler's state-dict helpers: merged (full) and deduplicated per-rank state dicts, broadcast_weights.

    # every rank
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f"ckpt/rank{rank}.pt")
    # later, anywhere (no job, no process group)
    ranks = [torch.load(f"ckpt/rank{r}.pt") for r in range(world)]
    full_model, full_optim = merge_state_dicts([r["model"] for r in ranks], [r["optim"] for r in ranks])
    plain_model.load_state_dict(full_model)          # the original module, strict
    torch.optim.AdamW(plain_model.parameters()).load_state_dict(full_optim)
    # or back into a running parallel job, under any plan
    load_merged_state_dicts(compiled, full_model, opt, full_optim)

Per-rank state dicts can be merged offline because each says where its tensors sit
(:mod:`.rank_state`: a ``dynshard_rank_state`` entry in the model state dict's ``_metadata``, and a key
of that name in the optimizer's). Optimizers must be Adam-like: every state tensor is either of its
parameter's shape (stored as the parameter is) or a scalar (``step``). Pipeline stages are not covered.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from ..runtime.sharding import get_tag, stored_piece
from ..runtime.state_dict import _strip, relocate_state_dict, unwrap_compiled
from .rank_state import (MARK, OPTIM_KEY, TensorInfo, entries_of, hook_module, hook_optimizer, indexed_params,
                         info_of, rank_and_world)

Piece = tuple[tuple[int, ...], int]


# -- merge (offline) -------------------------------------------------------------------------------------

def _model_entries(state_dict: Mapping[str, Any]) -> tuple[int | None, dict[str, TensorInfo]]:
    """(rank, {key: info}) of one rank's model state dict."""
    rank, infos = None, {}
    for prefix, entry in entries_of(state_dict):
        rank = entry["rank"]
        infos.update({prefix + name: TensorInfo.from_dict(d) for name, d in entry["tensors"].items()})
    return rank, infos


def _plain_metadata(state_dict: Mapping[str, Any]) -> collections.OrderedDict:
    """The state dict's ``_metadata`` (module versions) as the original module's: ``_orig_mod`` out of the
    module names, our entries left out."""
    metadata = collections.OrderedDict()
    for name, meta in (getattr(state_dict, "_metadata", None) or {}).items():
        name = _strip(f"{name}.")[:-1]
        meta = {k: v for k, v in meta.items() if k != MARK} if isinstance(meta, Mapping) else meta
        if name not in metadata or meta:        # the compiled wrapper's root says less than the module's
            metadata[name] = meta
    return metadata


def _ranked(entries: list[tuple[int | None, Any]], what: str) -> list[tuple[int, Any]]:
    ranks = [rank for rank, _ in entries]
    if all(rank is None for rank in ranks):
        raise ValueError(f"dynshard: none of the {what} state dicts says where its tensors sit: pass what "
                         f"{what}.state_dict() returned on each rank after the model's first step (as it is: the "
                         "model's says it in its _metadata, which a dict rebuilt from its items loses)")
    if any(rank is None for rank in ranks) or len(set(ranks)) != len(ranks):
        raise ValueError(f"dynshard: the {what} state dicts must be one per rank, each from its own rank "
                         f"(their ranks: {ranks})")
    return sorted(entries, key=lambda e: e[0])


def _merge_tensor(name: str, info: TensorInfo | None, holders: list[tuple[int, Any]]) -> Any:
    """The whole value of ``name`` from the (rank, value) pairs of the ranks that hold it (rank order)."""
    first = holders[0][1]
    if info is None or not info.is_split or not isinstance(first, torch.Tensor) or not first.dim():
        return first                       # whole on every rank, or a scalar (an optimizer's step)
    expected = info.stored_shape()
    if tuple(first.shape) == info.shape and info.shape != expected:
        return first                       # whole (e.g. optimizer state loaded before the first step)
    stored: dict[Piece, torch.Tensor] = {}
    for rank, value in holders:
        if tuple(value.shape) != expected:
            raise ValueError(f"dynshard: {name} of rank {rank} has shape {tuple(value.shape)}, but it is "
                             f"stored as {expected}; only state of the parameter's shape, or scalars, merge")
        stored.setdefault(info.piece(rank), value.detach())
    missing = [p for p in info.pieces() if p not in stored]
    if missing:
        raise ValueError(f"dynshard: no state dict holds the piece of {name} that rank(s) "
                         f"{[info.owner(p) for p in missing]} store")
    return info.assemble(stored)


def _merge_model(state_dicts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    ranked = _ranked([(_model_entries(sd)[0], sd) for sd in state_dicts], "model")
    infos: dict[str, TensorInfo] = {}
    keys: dict[str, None] = {}
    for _, sd in ranked:
        for key, info in _model_entries(sd)[1].items():
            infos.setdefault(key, info)
        keys.update(dict.fromkeys(sd))
    merged = collections.OrderedDict()
    for key in keys:
        holders = [(rank, sd[key]) for rank, sd in ranked if key in sd]
        merged[_strip(key)] = _merge_tensor(key, infos.get(key), holders)
    merged._metadata = _plain_metadata(ranked[0][1])
    return merged


def _merge_optimizer(state_dicts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    entries = [(sd[OPTIM_KEY]["rank"] if OPTIM_KEY in sd else None, sd) for sd in state_dicts]
    if all(rank is None for rank, _ in entries) and not any(sd["state"] for sd in state_dicts):
        base = state_dicts[0]
        return {"state": {}, "param_groups": [dict(g) for g in base["param_groups"]]}
    ranked = _ranked(entries, "optimizer")
    infos: dict[int, TensorInfo] = {}
    for _, sd in ranked:
        for index, d in sd[OPTIM_KEY]["params"].items():
            infos.setdefault(int(index), TensorInfo.from_dict(d))
    indices = sorted({index for _, sd in ranked for index in sd["state"]})
    state = {}
    for index in indices:
        holders = [(rank, sd["state"][index]) for rank, sd in ranked if index in sd["state"]]
        entries_of = {}
        for key in holders[0][1]:
            values = [(rank, s[key]) for rank, s in holders if key in s]
            entries_of[key] = _merge_tensor(f"optimizer state {key!r} of parameter {index}",
                                            infos.get(index), values)
        state[index] = entries_of
    return {"state": state, "param_groups": [dict(g) for g in ranked[0][1]["param_groups"]]}


def merge_state_dicts(model_state_dicts: Sequence[Mapping[str, Any]],
                      optimizer_state_dicts: Sequence[Mapping[str, Any]] | None = None
                      ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One full state dict from each rank's ``model.state_dict()`` (and ``optimizer.state_dict()``).

    Works offline: no job, no process group (each per-rank state dict says where its tensors sit, see
    :mod:`.rank_state`). The model's is keyed as the original module's ``state_dict()`` (``_orig_mod.``
    removed) with whole tensors, so the plain model loads it with ``strict=True``; the optimizer's is in
    ``torch.optim.Optimizer.state_dict()``'s format (parameter indices, ``param_groups``) with whole state
    tensors, so the same optimizer over the plain model's parameters loads it. Pieces that several ranks
    hold are taken from the lowest rank; deduplicated state dicts (:func:`deduped_state_dict`) of every
    rank merge too. Tensors stay where ``torch.load`` put them (``map_location`` to choose). Pass each
    model state dict as ``state_dict()`` returned it (an ``OrderedDict``, as ``torch.save``/``torch.load``
    keep it): where its tensors sit is in its ``_metadata``.
    """
    model = _merge_model(model_state_dicts)
    optim = _merge_optimizer(optimizer_state_dicts) if optimizer_state_dicts is not None else None
    return model, optim


# -- load merged ----------------------------------------------------------------------------------------

def _own_keys(module: torch.nn.Module) -> dict[str, str]:
    """The module's state-dict keys by the original module's key (``_orig_mod.`` removed)."""
    return {_strip(k): k for k in module.state_dict(keep_vars=True)}


def _load_full_optimizer(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    from .api import _cut_whole_state_at_first_step

    state, whole = {}, False
    for index, param in indexed_params(optimizer, state_dict["param_groups"]):
        if index not in state_dict["state"]:
            continue
        tag = get_tag(param)
        entries = {}
        for key, value in state_dict["state"][index].items():
            if isinstance(value, torch.Tensor):
                if value.dim() and tag is not None and tag.is_split and tuple(value.shape) == tuple(tag.global_shape):
                    value = stored_piece(value, tag)
                elif value.dim() and tag is None:
                    whole = True
                value = value.clone()      # the optimizer would update the caller's tensors in place
            entries[key] = value
        state[index] = entries
    optimizer.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
    if whole:
        _cut_whole_state_at_first_step(optimizer)


def load_merged_state_dicts(model: torch.nn.Module, model_state_dict: Mapping[str, Any],
                            optimizer: torch.optim.Optimizer | None = None,
                            optimizer_state_dict: Mapping[str, Any] | None = None) -> None:
    """Load a merged (full) state dict into a running parallel ``model`` (and ``optimizer``): each rank
    keeps its pieces, under whatever plan it runs (no communication). Every rank passes the same full
    state dicts. Before the first step the tensors are whole and loaded whole (the first step cuts them)."""
    module = unwrap_compiled(model)
    hook_module(module)
    keys = _own_keys(module)
    relocated = relocate_state_dict(module, model_state_dict)
    loaded = collections.OrderedDict((keys.get(k, k), v) for k, v in relocated.items())
    metadata = getattr(model_state_dict, "_metadata", None)
    if metadata is not None and all(k == _strip(k) for k in keys.values()):
        loaded._metadata = metadata        # module versions, named as the original module's submodules
    module.load_state_dict(loaded, strict=True)
    if optimizer is not None and optimizer_state_dict is not None:
        _load_full_optimizer(optimizer, optimizer_state_dict)


# -- deduplicated per-rank state dicts ------------------------------------------------------------------

def _owner(info: TensorInfo | None, rank: int) -> int:
    return info.owner(info.piece(rank)) if info is not None else 0


def deduped_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
                       ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """This rank's ``model.state_dict()`` (and ``optimizer.state_dict()``) without what a lower rank
    holds too: each piece is kept by the lowest rank storing it (the first data-parallel unit, the first
    ZeRO group, tp coordinate 0 for tensors replicated inside a unit); untagged tensors by rank 0.
    Non-tensor entries (modules' extra state), the metadata and the optimizer's ``param_groups`` stay on
    every rank. Load it back under the same plan with :func:`load_deduped_state_dict`; every rank's
    together also merge with :func:`merge_state_dicts`."""
    module = unwrap_compiled(model)
    hook_module(module)
    rank, _ = rank_and_world()
    state_dict = model.state_dict()
    live = model.state_dict(keep_vars=True)
    for key in list(state_dict):
        tensor = live.get(key)
        if isinstance(tensor, torch.Tensor) and _owner(info_of(tensor), rank) != rank:
            del state_dict[key]
    optim_state = None
    if optimizer is not None:
        hook_optimizer(optimizer)
        full = optimizer.state_dict()
        owners = {index: _owner(info_of(p), rank) for index, p in indexed_params(optimizer, full["param_groups"])}
        optim_state = {**full, "state": {i: s for i, s in full["state"].items() if owners.get(i, 0) == rank}}
    return state_dict, optim_state


def _raise_everywhere(problems: list[str]) -> None:
    """Every rank raises if any rank found a problem (before collectives that would otherwise hang)."""
    everyone = [problems]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, problems)
    found = [f"rank {r}: {p}" for r, ps in enumerate(everyone) for p in ps]
    if found:
        raise ValueError("dynshard: " + "; ".join(found[:10]) + (" ..." if len(found) > 10 else ""))


@functools.lru_cache(maxsize=None)
def _groups(classes: tuple[tuple[int, ...], ...], world: Any) -> dict[int, Any]:
    """A process group per class of ranks (the default group when one class holds every rank). Created
    on every rank, in the same order (collective); cached per default group."""
    if len(classes) == 1:
        return {rank: None for rank in classes[0]}
    groups = {}
    for ranks in classes:
        group = dist.new_group(list(ranks))
        groups.update({rank: group for rank in ranks})
    return groups


def _broadcast(tensor: torch.Tensor, classes: list[list[int]], rank: int) -> None:
    """Every class of ranks gets its first rank's values of ``tensor``, in place."""
    if all(len(c) == 1 for c in classes):
        return
    group = _groups(tuple(tuple(c) for c in classes), dist.group.WORLD)[rank]
    mine = next(c for c in classes if rank in c)
    if len(mine) > 1:
        with torch.no_grad():
            dist.broadcast(tensor.data, group=group, group_src=0)


def _classes(info: TensorInfo | None, world: int) -> list[list[int]]:
    return info.replica_classes() if info is not None else [list(range(world))]


def load_deduped_state_dict(model: torch.nn.Module, model_state_dict: Mapping[str, Any],
                            optimizer: torch.optim.Optimizer | None = None,
                            optimizer_state_dict: Mapping[str, Any] | None = None) -> None:
    """Load what :func:`deduped_state_dict` returned on this rank, under the same plan and after the
    model's first step: each rank loads what it kept and the owners broadcast the rest to the ranks
    storing the same pieces. Every rank calls it."""
    module = unwrap_compiled(model)
    rank, world = rank_and_world()
    live = {_strip(k): v for k, v in module.state_dict(keep_vars=True).items()}
    given = {_strip(k): v for k, v in model_state_dict.items()}
    problems = [f"{k} is not the model's" for k in given if k not in live]
    for key, tensor in live.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        value = given.get(key)
        if value is None and _owner(info_of(tensor), rank) == rank:
            problems.append(f"{key} is missing (this rank keeps it)")
        elif value is not None and tuple(value.shape) != tuple(tensor.shape):
            problems.append(f"{key} has shape {tuple(value.shape)}, this rank stores {tuple(tensor.shape)}")
    optim_plan = _optimizer_plan(optimizer, optimizer_state_dict, rank, problems) if optimizer is not None \
        and optimizer_state_dict is not None else None
    _raise_everywhere(problems)
    done: set[int] = set()
    with torch.no_grad():
        for key, tensor in live.items():
            if not isinstance(tensor, torch.Tensor) or id(tensor) in done:
                continue
            done.add(id(tensor))
            if key in given:
                tensor.copy_(given[key])
            _broadcast(tensor, _classes(info_of(tensor), world), rank)
    others = {k: v for k, v in given.items() if not isinstance(live.get(k), torch.Tensor)}
    if others:                       # modules' own extra state: every rank kept it
        keys = _own_keys(module)
        module.load_state_dict({keys[k]: v for k, v in others.items()}, strict=False)
    if optim_plan is not None:
        _load_deduped_optimizer(optimizer, optimizer_state_dict, optim_plan, rank, world)


def _describe(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        if value.dim():
            return ("tensor", tuple(value.shape), str(value.dtype).removeprefix("torch."))
        return ("scalar", value.item(), str(value.dtype).removeprefix("torch."), str(value.device))
    return ("value", value)


def _optimizer_plan(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any], rank: int,
                    problems: list[str]) -> dict[int, dict[str, tuple]]:
    """The state every rank will hold after loading, per parameter index: what its owner kept
    (shapes and dtypes of tensors, values of scalars), agreed by all ranks."""
    params = dict(indexed_params(optimizer, state_dict["param_groups"]))
    mine = {i: {k: _describe(v) for k, v in s.items()} for i, s in state_dict["state"].items()}
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    plan = {}
    for index in sorted({i for described in everyone for i in described}):
        if index not in params:
            problems.append(f"optimizer state for parameter {index}, which the optimizer does not hold")
            continue
        owner = _owner(info_of(params[index]), rank)
        if index not in everyone[owner]:
            problems.append(f"optimizer state of parameter {index} is missing on rank {owner}, which keeps it")
            continue
        plan[index] = everyone[owner][index]
    return plan


def _load_deduped_optimizer(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any],
                            plan: dict[int, dict[str, tuple]], rank: int, world: int) -> None:
    params = dict(indexed_params(optimizer, state_dict["param_groups"]))
    state = {}
    for index, described in plan.items():
        param = params[index]
        given = state_dict["state"].get(index, {})
        classes = _classes(info_of(param), world)
        entries = {}
        for key in sorted(described):
            kind, *rest = described[key]
            if kind == "tensor":
                value = given.get(key)
                if value is None:
                    value = torch.empty(rest[0], dtype=getattr(torch, rest[1]), device=param.device)
                else:
                    value = value.detach().to(param.device).clone()
                _broadcast(value, classes, rank)
            elif kind == "scalar":
                value = torch.tensor(rest[0], dtype=getattr(torch, rest[1]), device=rest[2])
            else:
                value = rest[0]
            entries[key] = value
        state[index] = entries
    optimizer.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})


# -- broadcast_weights ----------------------------------------------------------------------------------

def broadcast_weights(module: torch.nn.Module, stride: int) -> None:
    """nnScaler's ``broadcast_weights``: ranks ``r, r + stride, r + 2 * stride, ...`` get the parameters
    and buffers of rank ``r`` (``r < stride``), in place; with ``stride = plan_ngpus`` every unit gets the
    first unit's weights. Every rank calls it. A tensor that rank ``r + k * stride`` stores another piece
    of than rank ``r`` (ZeRO rows, or tp shards when ``stride`` is not a multiple of ``plan_ngpus``)
    cannot be copied: that is an error, raised on every rank before anything is sent."""
    module = unwrap_compiled(module)
    rank, world = rank_and_world()
    if stride < 1:
        raise ValueError(f"dynshard: broadcast_weights needs a stride of at least 1, not {stride}")
    if stride >= world:
        return
    classes = [list(range(first, world, stride)) for first in range(stride)]
    tensors, seen = [], set()
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors.append((name, tensor))
    problems = []
    for name, tensor in tensors:
        info = info_of(tensor)
        if info is not None and any(info.piece(r) != info.piece(r % stride) for r in range(world)):
            problems.append(f"{name}: ranks {stride} apart store different pieces of it; broadcast_weights "
                            f"copies whole stored tensors (choose a stride that keeps them, or load instead)")
    if problems:         # the same on every rank: tags agree
        raise ValueError("dynshard: " + "; ".join(problems))
    for _, tensor in tensors:
        _broadcast(tensor, classes, rank)

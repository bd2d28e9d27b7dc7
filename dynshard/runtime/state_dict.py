"""TorchShard's state helpers: full tensors from shards, and shards from full tensors."""

from __future__ import annotations

from typing import Mapping

import torch

from .sharding import full_tensor, get_tag, stored_piece

_COMPILED_PREFIX = "_orig_mod."


def unwrap_compiled(module: torch.nn.Module) -> torch.nn.Module:
    """The user's module behind ``torch.compile``'s wrapper (or the module itself)."""
    return getattr(module, "_orig_mod", module)


def _strip(key: str) -> str:
    return key.replace(_COMPILED_PREFIX, "")


def collect_state_dict(module: torch.nn.Module, state_dict: Mapping[str, torch.Tensor] | None = None,
                       prefix: str = "") -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors on every rank, keyed as the original module's ``state_dict()``.

    ``state_dict`` defaults to ``module.state_dict(prefix=prefix, keep_vars=True)``; a state dict taken
    earlier from the same module works too (its tensors carry their shard tags). Every rank must call
    this: sharded tensors are gathered with collectives.
    """
    module = unwrap_compiled(module)
    source = module.state_dict(prefix=prefix, keep_vars=True) if state_dict is None else state_dict
    return {_strip(key): full_tensor(value) if isinstance(value, torch.Tensor) else value
            for key, value in source.items()}


def relocate_state_dict(module: torch.nn.Module, full_state_dict: Mapping[str, torch.Tensor],
                        prefix: str = "") -> dict[str, torch.Tensor]:
    """This rank's shards of ``full_state_dict``, ready for ``module.load_state_dict``.

    Keys are those of the original module (a ``_orig_mod.`` prefix is accepted and removed).
    """
    module = unwrap_compiled(module)
    own = {_strip(k): v for k, v in module.state_dict(prefix=prefix, keep_vars=True).items()}
    relocated = {}
    for key, value in full_state_dict.items():
        key = _strip(key)
        target = own.get(key)
        tag = get_tag(target) if isinstance(target, torch.Tensor) else None
        if tag is not None and isinstance(value, torch.Tensor):
            if tuple(value.shape) != tuple(tag.global_shape):
                raise ValueError(f"dynshard: {key} has shape {tuple(value.shape)} but the model's full "
                                 f"tensor is {tuple(tag.global_shape)}")
            value = stored_piece(value, tag)
        relocated[key] = value
    return relocated


def _split(value) -> bool:
    tag = get_tag(value) if isinstance(value, torch.Tensor) else None
    return tag is not None and tag.is_split


def holds_split_tensors(state: Mapping) -> bool:
    """Whether a state dict (a module's, or an optimizer's ``state``) holds this rank's pieces of any tensor."""
    return any(_split(v) for v in state.values())


def gather_state_dict(module: torch.nn.Module, state_dict: Mapping[str, torch.Tensor] | None = None, *,
                      dst: int = 0, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """Full tensors on rank ``dst`` alone, keyed as the original module's ``state_dict()`` (``{}`` on the other
    ranks), gathered one tensor at a time: no rank ever holds the whole model beyond ``dst``'s copy, which
    ``cpu_offload`` keeps in host memory (torch's ``get_model_state_dict(full_state_dict=True,
    cpu_offload=True)``). Every rank must call it. A tensor two keys hold (a tied LM head) is gathered once
    and stays one tensor under both keys."""
    import torch.distributed as dist

    module = unwrap_compiled(module)
    source = module.state_dict(keep_vars=True) if state_dict is None else state_dict
    here = not dist.is_initialized() or dist.get_rank() == dst
    gathered: dict[int, torch.Tensor] = {}
    full = {}
    for key, value in source.items():
        if isinstance(value, torch.Tensor):
            if id(value) not in gathered:
                whole = full_tensor(value)
                gathered[id(value)] = (whole.cpu() if cpu_offload else whole) if here else None
                del whole
            value = gathered[id(value)]
        if here:
            full[_strip(key)] = value
    return full


def gather_optimizer_state(optimizer: torch.optim.Optimizer, *, dst: int = 0, cpu_offload: bool = True) -> dict:
    """``optimizer.state_dict()`` with every state tensor of a split parameter whole, on rank ``dst`` alone
    (``{}`` elsewhere), one tensor at a time: what a plain optimizer of the one-process model holds, so that
    ``load_state_dict`` of it before the first compiled step resumes (that step cuts it to each rank's piece).
    Every rank must call it, with the same parameters in the same order (as any data-parallel job has). Under
    a pipeline, the state of another stage's parameter comes from the first rank of the unit holding it (a rank
    keeps none for parameters it does not hold, as a plain optimizer never creates any)."""
    import torch.distributed as dist

    from .sharding import unit_full_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    local = optimizer.state_dict()
    here = not dist.is_initialized() or dist.get_rank() == dst

    def whole(value: torch.Tensor, tag) -> torch.Tensor:
        value = unit_full_tensor(value, tag)
        return value.cpu() if cpu_offload else value

    for index, param in enumerate(params):
        tag, entries = get_tag(param), local["state"].get(index)
        if tag is None or tag.owner is None and not tag.is_split:
            continue
        if tag.owner is not None:       # (every rank of the unit: the holders' tags say whole, the others' split)
            entries = _from_stage_owner(entries if tag.owner.held else None, param, tag, whole)
        elif entries is not None:
            entries = {name: whole(value, tag) if _sized_like(value, param) else value
                       for name, value in entries.items()}
        if entries is None:
            local["state"].pop(index, None)
        else:
            local["state"][index] = entries if here else None
    return local if here else {}


def _sized_like(value, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def _from_stage_owner(entries: dict | None, param: torch.Tensor, tag, whole) -> dict | None:
    """A pipeline parameter's whole optimizer state on every rank of its unit, from the unit's first holder
    (the collectives run on the parameter's device; ``whole`` then offloads)."""
    import torch.distributed as dist

    from .sharding import unit_full_tensor

    owner = tag.owner
    full = {name: unit_full_tensor(value, tag) if _sized_like(value, param) else value
            for name, value in entries.items()} if entries is not None else None
    layout = [None if full is None else {name: (tuple(v.shape), v.dtype) if _sized_like(v, v) else v
                                         for name, v in full.items()}]
    dist.broadcast_object_list(layout, src=owner.src, group=owner.group)
    if layout[0] is None:
        return None
    received = {}
    for name, described in layout[0].items():
        if not isinstance(described, tuple):
            received[name] = described
            continue
        shape, dtype = described
        value = full[name] if dist.get_rank() == owner.src else torch.empty(shape, dtype=dtype, device=param.device)
        dist.broadcast(value, src=owner.src, group=owner.group)
        received[name] = whole(value, None)
    return received

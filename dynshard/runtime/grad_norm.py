"""The global gradient norm over tensor-parallel shards, ZeRO rows and data-parallel replicas.

torch's own norm on dynshard's parameters would be wrong: each rank holds shards (tp) or rows (ZeRO) of
the gradients, and replicas of others, so its local norm is neither the global norm nor the same on every
rank. Here each gradient element is counted exactly once: a rank counts a parameter only where it is the
first of the ranks holding the same piece (coordinate 0 on every mesh dimension that replicates it), and one
all-reduce over all ranks sums the pieces. nnScaler divides each replicated norm by its number of replicas
instead; counting owners is exact and does less work.

Every common recipe (transformers' Trainer through accelerate, nanoGPT) clips with torch's function, so
``torch.nn.utils.clip_grad_norm_`` is routed here for dynshard's parameters, and the public
``torch.nn.utils.get_total_norm`` (accelerate's clipping since 1.16: the norm, then ``clip_grads_with_norm_``)
for their gradients (:func:`route_torch_clip_grad_norm`, process-wide); any other call runs torch's own code.
"""

from __future__ import annotations

import functools
import math
from typing import Iterable

import torch
import torch.distributed as dist

from ..compat.clip_grad import check_total_norm
from .accumulation import job_accumulation
from .sharding import get_tag, is_sharded, split_tensors, tagged_tensors

_ROUTED = "_dynshard_routed"
_STALE_REFERENCE = (
    "dynshard: torch's clip_grad_norm_ was called on gradients of parameters dynshard has split across ranks "
    "through a reference taken before dynshard was imported (e.g. `from torch.nn.utils import "
    "clip_grad_norm_` at the top of the script), so it would return this rank's local norm, not the global "
    "one. Call dynshard.clip_grad_norm_(model.parameters(), max_norm), or torch.nn.utils.clip_grad_norm_ "
    "after `import dynshard` (dynshard routes it for its parameters)")


def counted_here(param: torch.Tensor) -> bool:
    """Whether this rank adds ``param``'s gradient to the global norm."""
    tag = get_tag(param)
    if tag is None:     # no dynshard program owns it: the same on every rank once reduced
        return not dist.is_initialized() or dist.get_rank() == 0
    layout = tag.layout
    if tag.owner is not None:   # pipeline: the first stage holding it (a tied weight is held twice)
        if not tag.owner.held or dist.get_rank() != tag.owner.src:
            return False
    if not is_sharded(tag.placements) and layout.tp_rank != 0:
        return False
    if tag.zero is None:
        return layout.dp_rank == 0
    return layout.dp_rank // tag.zero.group_size == 0      # the first zero group holds every row once


def unique_parameters(parameters: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    seen, unique = set(), []
    for param in parameters:
        if id(param) not in seen:
            seen.add(id(param))
            unique.append(param)
    return unique


def global_grad_norm(parameters: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients as if the model were on one process; the same tensor on every rank."""
    norm_type = float(norm_type)
    grads = [p.grad for p in parameters if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    owned = [p.grad for p in parameters if p.grad is not None and counted_here(p)]
    if math.isinf(norm_type):
        local = torch.stack([g.detach().abs().max().double() for g in owned]).max() if owned else \
            torch.zeros((), dtype=torch.float64, device=device)
        op = dist.ReduceOp.MAX
    else:
        local = torch.zeros((), dtype=torch.float64, device=device)
        for grad in owned:
            local += torch.linalg.vector_norm(grad.detach(), norm_type, dtype=torch.float64) ** norm_type
        op = dist.ReduceOp.SUM
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local, op=op)
    total = local if math.isinf(norm_type) else local ** (1.0 / norm_type)
    dtype = grads[0].dtype if grads else torch.float32
    return total.to(dtype)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for dynshard's parameters: the global norm over every shard,
    replica and rank (each element counted once), and the same clipping on every rank.

    Every rank must call it. Gradients accumulated under :func:`dynshard.no_sync` are reduced first.
    ``foreach`` is accepted for torch's signature and ignored.
    """
    job_accumulation().flush()
    params = unique_parameters(parameters)
    total = global_grad_norm(params, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"dynshard: the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), "
            "so it cannot be clipped; set error_if_nonfinite=False to skip this check")
    coefficient = torch.clamp(float(max_norm) / (total.double() + 1e-6), max=1.0)
    for param in params:
        if param.grad is not None:
            param.grad.detach().mul_(coefficient.to(device=param.grad.device, dtype=param.grad.dtype))
    return total


def _owns(params: list) -> bool:
    return any(isinstance(p, torch.Tensor) and get_tag(p) is not None for p in params)


def _split_grads(grads: list) -> bool:
    ids = {id(p.grad) for p in split_tensors() if p.grad is not None}
    return any(id(g) in ids for g in grads)


def _grads_norm(grads: list, norm_type: float) -> torch.Tensor | None:
    """The global norm of gradients of dynshard's parameters (None when none of them is one). Every rank
    must call it; gradients accumulated under no_sync are reduced first."""
    by_grad = {id(p.grad): p for p in tagged_tensors() if p.grad is not None}
    params = [by_grad.get(id(g)) for g in grads]
    if all(p is None for p in params):
        return None
    job_accumulation().flush()
    if any(p is None for p in params):
        raise RuntimeError(
            "dynshard: torch.nn.utils.get_total_norm was given gradients of dynshard's parameters together with "
            "other tensors; their global norm is counted over dynshard's ranks: pass dynshard's gradients alone")
    return global_grad_norm(unique_parameters(params), norm_type)


def route_torch_clip_grad_norm() -> None:
    """``torch.nn.utils.clip_grad_norm_`` on dynshard's parameters gives :func:`clip_grad_norm_`'s global
    norm, and ``torch.nn.utils.get_total_norm`` on their gradients the global norm (every rank must call
    them, as with torch's on DTensors); other calls run torch's own code. Both names ``clip_grad_norm_`` is
    reached by are replaced (``torch.nn.utils`` and ``torch.nn.utils.clip_grad``); a reference to torch's
    taken before, which counts with torch's ``_get_total_norm``, refuses split gradients (idempotent)."""
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    if getattr(clip_grad.clip_grad_norm_, _ROUTED, False):
        return
    original = clip_grad.clip_grad_norm_

    @functools.wraps(original)
    def routed_clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if _owns(params):
            return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return original(params, max_norm, norm_type, error_if_nonfinite, foreach)

    setattr(routed_clip_grad_norm_, _ROUTED, True)
    check_total_norm(_refuse_split_grads)
    public_total_norm = utils.get_total_norm

    @functools.wraps(public_total_norm)
    def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        grads = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        total = _grads_norm(grads, norm_type)
        if total is None:
            return public_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"dynshard: the total norm of order {norm_type} of the gradients is non-finite "
                               f"({total.item()}); set error_if_nonfinite=False to skip this check")
        return total

    clip_grad.clip_grad_norm_ = routed_clip_grad_norm_
    utils.clip_grad_norm_ = routed_clip_grad_norm_
    utils.get_total_norm = get_total_norm


def _refuse_split_grads(grads: list) -> None:
    if _split_grads(grads):
        raise RuntimeError(_STALE_REFERENCE)

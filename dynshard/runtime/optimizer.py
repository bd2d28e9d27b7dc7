"""``dynshard.build_optimizer``: nnScaler's optimizer API on a plain torch optimizer.

The optimizer is ``optimizer_fn(params, *args, **kwargs)`` itself (``isinstance(opt, torch.optim.AdamW)``
holds), over the model's trainable parameters. dynshard's parameters are already this rank's shards
(tp) and rows (ZeRO), so its state is 1/N without any wrapper; a plain ``torch.optim`` optimizer works
just as well. What build_optimizer adds, patched onto the instance as nnScaler does:

- ``sync_shard_grad()``: reduce what is still local (gradients accumulated under ``no_sync``, gradients
  reduced outside the graphs for reducer hooks, and the gradients of parameters no dynshard program owns
  when only a submodule is compiled: averaged over all ranks). Idempotent within a step; the step calls it.
- ``scale_grads(factor)``: multiply every gradient (after the sync, as nnScaler requires).
- ``clip_gnorm(max_norm=None) -> Tensor``: the global gradient norm, clipped to ``max_norm`` if given.
- ``register_reducer_pre_hook(fn)`` / ``register_reducer_post_hook(fn)``: ``fn(reducer, grad_bucket)``
  before and after each bucket's reduction, once per step. Registering one moves this optimizer's
  parameters to out-of-graph reduction (the graphs then run their no-sync variant every step), so the
  hooks see real buckets; memory is then ZeRO-1's while hooks are registered.
"""

from __future__ import annotations

import types
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from .accumulation import job_accumulation
from .grad_norm import clip_grad_norm_, global_grad_norm
from .reducer import Hook, PendingGrad, Reducer
from .sharding import get_tag
from .state_dict import unwrap_compiled


class ParallelOptimizer(Protocol):
    """The methods build_optimizer adds (the object is the optimizer class asked for)."""

    def sync_shard_grad(self) -> None: ...
    def scale_grads(self, factor: float) -> None: ...
    def clip_gnorm(self, max_norm: float | None = None) -> torch.Tensor: ...
    def register_reducer_pre_hook(self, fn: Hook) -> None: ...
    def register_reducer_post_hook(self, fn: Hook) -> None: ...


def build_optimizer(model: torch.nn.Module, optimizer_fn: Callable[..., torch.optim.Optimizer], *args,
                    **kwargs) -> torch.optim.Optimizer:
    """An ``optimizer_fn`` optimizer over ``model``'s trainable parameters, with nnScaler's methods."""
    module = unwrap_compiled(model)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = optimizer_fn(params, *args, **kwargs)
    optimizer._dynshard_reducer = Reducer()
    optimizer._dynshard_synced = False
    methods = {"sync_shard_grad": _sync_shard_grad, "scale_grads": _scale_grads, "clip_gnorm": _clip_gnorm,
               "register_reducer_pre_hook": _register_reducer_pre_hook,
               "register_reducer_post_hook": _register_reducer_post_hook}
    for name, method in methods.items():
        setattr(optimizer, name, types.MethodType(method, optimizer))
    original_zero_grad = optimizer.zero_grad

    def zero_grad(self, set_to_none: bool = True):
        job_accumulation().discard(_params(self))
        self._dynshard_synced = False
        return original_zero_grad(set_to_none=set_to_none)

    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
    optimizer.register_step_pre_hook(lambda opt, _args, _kwargs: opt.sync_shard_grad())
    optimizer.register_step_post_hook(lambda opt, _args, _kwargs: setattr(opt, "_dynshard_synced", False))
    return optimizer


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _sync_shard_grad(self) -> None:
    job_accumulation().flush()
    if self._dynshard_synced:
        return
    self._dynshard_synced = True
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    world = dist.get_world_size()
    outside = []       # parameters no dynshard program owns: replicated everywhere, averaged over all ranks
    for param in _params(self):
        if get_tag(param) is None and param.grad is not None:
            local, param.grad = param.grad, None
            outside.append(PendingGrad(param, local, dist.group.WORLD, world))
    if outside:
        self._dynshard_reducer.reduce(outside)


def _scale_grads(self, factor: float) -> None:
    if job_accumulation().pending:
        raise RuntimeError("dynshard: you can only call scale_grads() after gradients are synchronized; "
                           "call optimizer.sync_shard_grad() first")
    for param in _params(self):
        if param.grad is not None:
            param.grad.mul_(factor)


def _clip_gnorm(self, max_norm: float | None = None) -> torch.Tensor:
    self.sync_shard_grad()
    if max_norm is None:
        return global_grad_norm(_params(self))
    return clip_grad_norm_(_params(self), max_norm)


def _register_reducer_pre_hook(self, fn: Hook) -> None:
    self._dynshard_reducer.register_pre_hook(fn)
    job_accumulation().reduce_outside_graphs(_params(self), self._dynshard_reducer)


def _register_reducer_post_hook(self, fn: Hook) -> None:
    self._dynshard_reducer.register_post_hook(fn)
    job_accumulation().reduce_outside_graphs(_params(self), self._dynshard_reducer)

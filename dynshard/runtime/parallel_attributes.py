"""TorchShard's tensor helpers: ``slice``, parallel-dim attributes, and DDP's list of ignored parameters.

TorchShard marks tensors with a "parallel dim" (0: split by rows, 1 or -1: split by columns, None: whole)
and an "order type" (0: a layer's ``[in, out]`` is ``reversed(weight.shape)``, 1: it is ``weight.shape``).
dynshard records where its own tensors sit in a :class:`~dynshard.runtime.sharding.ShardTag`, set when a
compiled program first runs. The two live side by side on a tensor:

- :func:`register_parallel_dim` / :func:`register_parallel_attribute` store the user's values in
  attributes of their own (``_dynshard_parallel_dim``, ``_dynshard_order_type``); they never create or
  change a ShardTag, so dynshard plans, shards and reduces a registered parameter exactly as before.
- :func:`get_parallel_dim` answers from the ShardTag when dynshard has tagged the tensor (what the tensor
  really holds on this rank wins, even over a value registered on it), and otherwise returns what was
  registered (None if nothing was).
- :func:`slice` is TorchShard's: ``torch.split`` into ``num_partitions`` equal chunks, all of them
  returned; no process group is consulted. This rank's piece of a tensor split over its plan unit is
  ``slice(t, plan_ngpus, dim)[dist.get_rank() % plan_ngpus]`` (ranks ``[u * plan_ngpus, (u + 1) * plan_ngpus)``
  form unit ``u``).
- :func:`register_ddp_parameters_to_ignore` lets torch's ``DistributedDataParallel`` wrap a model in which
  only some submodules are compiled with dynshard: DDP must leave alone the tensors dynshard reduces (and
  shards) itself, and, as in TorchShard, those the user registered a parallel dim on. A DDP around a whole
  dynshard model (transformers' Trainer builds one) needs nothing: dynshard releases it (:mod:`.ddp`).
"""

from __future__ import annotations

import torch

from .. import compat
from .ddp import DDPWrapError, dynshard_tensors, named_tensors  # noqa: F401  (importing .ddp watches DDP wraps)
from .sharding import get_tag

PARALLEL_DIM_ATTR = "_dynshard_parallel_dim"
ORDER_TYPE_ATTR = "_dynshard_order_type"
ORDER_TYPES = (0, 1)
DDP_IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"   # read by DistributedDataParallel.__init__


def slice(tensor: torch.Tensor, num_partitions: int, dim: int | None = None,
          contiguous: bool = False) -> tuple[torch.Tensor, ...]:
    """``num_partitions`` equal chunks of ``tensor`` along ``dim`` (the last dimension when None), as
    ``torch.split`` returns them (views); ``contiguous=True`` makes each chunk contiguous."""
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, int) or num_partitions < 1:
        raise ValueError(f"dynshard.slice: num_partitions must be a positive int, got {num_partitions!r}")
    if tensor.dim() == 0:
        raise ValueError("dynshard.slice: cannot slice a 0-dimensional tensor")
    dim = -1 if dim is None else dim
    size = tensor.shape[dim]
    if size % num_partitions:
        raise ValueError(f"dynshard.slice: dimension {dim} of a tensor of shape {tuple(tensor.shape)} "
                         f"(size {size}) does not divide into {num_partitions} parts")
    chunks = torch.split(tensor, size // num_partitions, dim=dim)
    return tuple(chunk.contiguous() for chunk in chunks) if contiguous else tuple(chunks)


def _check_parallel_dim(tensor: torch.Tensor, parallel_dim: int | None) -> None:
    if parallel_dim is None:
        return
    if isinstance(parallel_dim, bool) or not isinstance(parallel_dim, int):
        raise TypeError(f"dynshard: a parallel dim is an int or None, got {parallel_dim!r}")
    if not -tensor.dim() <= parallel_dim < tensor.dim():
        raise ValueError(f"dynshard: parallel dim {parallel_dim} is not a dimension of a tensor of shape "
                         f"{tuple(tensor.shape)}")


def register_parallel_dim(tensor: torch.Tensor, parallel_dim: int | None) -> None:
    """Record (in place) that ``tensor`` is split along ``parallel_dim`` (None: it is whole)."""
    _check_parallel_dim(tensor, parallel_dim)
    setattr(tensor, PARALLEL_DIM_ATTR, parallel_dim)


def register_parallel_attribute(tensor: torch.Tensor, parallel_dim: int | None, order_type: int = 0) -> None:
    """Record (in place) ``tensor``'s parallel dim and its order type (0 or 1), for custom layers."""
    if order_type not in ORDER_TYPES or isinstance(order_type, bool):
        raise ValueError(f"dynshard: order_type must be 0 or 1, got {order_type!r}")
    register_parallel_dim(tensor, parallel_dim)
    setattr(tensor, ORDER_TYPE_ATTR, order_type)


def get_parallel_dim(tensor: torch.Tensor) -> int | None:
    """The dimension along which ``tensor`` is split: dynshard's own placement for a tensor it has tagged,
    else what :func:`register_parallel_dim` recorded, else None."""
    tag = get_tag(tensor)
    if tag is not None:
        return tag.parallel_dim
    return getattr(tensor, PARALLEL_DIM_ATTR, None)


def get_order_type(tensor: torch.Tensor) -> int:
    """The order type :func:`register_parallel_attribute` recorded (TorchShard's default 0 otherwise)."""
    return getattr(tensor, ORDER_TYPE_ATTR, 0)


def register_ddp_parameters_to_ignore(module: torch.nn.Module) -> list[str]:
    """Tell ``DistributedDataParallel`` (constructed after this call, on ``module``) which parameters and
    buffers to leave alone, and return their names (DDP's list on ``module``; names already on it stay).

    Ignored: every tensor of a submodule compiled with dynshard (``torch.compile(sub, backend="dynshard")``
    or ``sub.compile(backend="dynshard")``; found before its first run, when nothing is tagged yet), every
    tensor dynshard has tagged, and every tensor with a parallel dim registered (TorchShard's rule).
    dynshard averages the gradients of its own parameters over data-parallel ranks inside its program
    and shards them over its plan unit, so DDP must neither reduce them again nor broadcast them.
    The tensors are also marked ``_ddp_ignored``, so that Dynamo's DDPOptimizer leaves the graphs of
    dynshard's frames whole when they are compiled inside DDP's forward.
    """
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        raise TypeError("dynshard.register_ddp_parameters_to_ignore: call it on the model before wrapping it "
                        "in DistributedDataParallel (DDP reads the list when it is constructed)")
    named = list(named_tensors(module))
    owned = dynshard_tensors(module)
    ignored = {id(t) for name, t in named if id(t) in owned or getattr(t, PARALLEL_DIM_ATTR, None) is not None}
    names = list(getattr(module, DDP_IGNORE_ATTR, None) or ())
    for name, tensor in named:
        if id(tensor) not in ignored:
            continue
        # DDP names a parameter of the root module ".name" when it builds its reducer, "name" elsewhere
        for alias in (name, "." + name) if "." not in name else (name,):
            if alias not in names:
                names.append(alias)
    compat.ignore_in_ddp(module, names)
    return names

"""DistributedDataParallel's internals dynshard reads or changes, in one place (torch 2.13).

- ``DistributedDataParallel._get_active_ddp_module()``: the DDP instance whose forward is running (set
  around ``self.module(...)``; what Dynamo's DDPOptimizer reads too).
- A DDP constructed with every parameter's all-reduce delayed (``_delay_all_reduce_all_params``) builds no
  reducer: its forward calls ``module.forward`` and nothing else, its backward adds nothing. dynshard puts a
  DDP around a dynshard model into that state (:func:`pass_through`): the reducer, which holds every
  parameter's gradient accumulator (with the parameter's shape at construction) and a gradient bucket as
  big as the model, and DDP's logger, which holds the reducer, are dropped.
- Dynamo compiles a frame reached from DDP's forward through ``DDPOptimizer.compile_fn``, which cuts the
  graph where DDP's buckets would fill (1 MB first, then 25 MB) and hands each piece to the backend as an
  aot_autograd one (dynshard's are not: "fw_metadata must not be None"). Its ``_ddp_ignored`` test reads the
  FakeTensor Dynamo lifted each parameter to, which does not carry the attribute, so marking parameters
  does not keep a graph whole: :func:`keep_graph_whole` lifts the DDPOptimizer's caps for the frame being
  compiled (one bucket: the whole graph goes to the backend as it is).
"""

from __future__ import annotations

import math

import torch
from torch.nn.parallel import DistributedDataParallel

_DELAY_ALL = "_delay_all_reduce_all_params"


def active_ddp() -> DistributedDataParallel | None:
    """The DistributedDataParallel whose forward is calling its module now (None outside one)."""
    return DistributedDataParallel._get_active_ddp_module()


def reduced_parameters(ddp: DistributedDataParallel) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters DDP's reducer averages: its module's, less those it was told to ignore."""
    if is_pass_through(ddp):
        return []
    ignored = ddp.parameters_to_ignore
    return [(name, p) for name, p in ddp.module.named_parameters() if name not in ignored and p.requires_grad]


def is_pass_through(ddp: DistributedDataParallel) -> bool:
    return bool(getattr(ddp, _DELAY_ALL, False)) and not hasattr(ddp, "reducer")


def pass_through(ddp: DistributedDataParallel, ignored: list[str]) -> None:
    """Make ``ddp`` reduce nothing from now on, this forward included: its forward only calls the module."""
    for handle in getattr(ddp, "_accum_grad_hooks", ()):    # the python reducer's (compiled autograd) hooks
        handle.remove()
    ddp._accum_grad_hooks = []
    ddp.parameters_to_ignore = set(ddp.parameters_to_ignore) | set(ignored)
    setattr(ddp, _DELAY_ALL, True)
    ddp.logger = None
    if hasattr(ddp, "reducer"):
        del ddp.reducer      # its destructor removes its autograd hooks and frees its buckets


def mark_ignored(param: torch.nn.Parameter) -> None:
    """Mark ``param`` as DDP's ``register_ddp_parameters_to_ignore`` marks the parameters it is given
    (``_ddp_ignored``, read by DDP's helpers and Dynamo's DDPOptimizer)."""
    param._ddp_ignored = True


def keep_graph_whole(compiler_fn) -> None:
    """``compiler_fn`` (what Dynamo compiles the current frame with): if it is a DDPOptimizer's, make it
    hand the whole graph to the backend (no bucket ever fills)."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    optimizer = getattr(compiler_fn, "__self__", None)
    if isinstance(optimizer, DDPOptimizer):
        optimizer.bucket_bytes_cap = optimizer.first_bucket_cap = math.inf

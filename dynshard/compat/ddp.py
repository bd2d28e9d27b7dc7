"""DistributedDataParallel's internals dynshard reads or changes, in one place (torch 2.13).

- ``DistributedDataParallel._get_active_ddp_module()``: the DDP instance whose forward is running (set
  around ``self.module(...)``; what Dynamo's DDPOptimizer reads too).
- A DDP constructed with every parameter's all-reduce delayed (``_delay_all_reduce_all_params``) builds no
  reducer: its forward calls ``module.forward`` and nothing else, its backward adds nothing. dynshard puts a
  DDP around a dynshard model into that state (:func:`pass_through`): the reducer, which holds every
  parameter's gradient accumulator (with the parameter's shape at construction) and a gradient bucket as
  big as the model, and DDP's logger, which holds the reducer, are dropped.
"""

from __future__ import annotations

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

"""How a parameter enters the per-rank program across data-parallel units, and how its gradient leaves.

One autograd function per parameter, inserted at the top of the program (regional compilation then
moves a repeated block's own into that block), does DDP's and ZeRO's work inside the traced graphs
(aot_autograd records its forward in the forward graph and its backward in the backward graph, so
Inductor buckets and schedules the collectives with the compute):

- replicated over "dp" (zero 0): forward casts to the compute dtype; backward all-reduces the gradient
  in the reduce dtype and averages it (DDP).
- ZeRO rows (zero >= 1): forward casts this rank's rows to the compute dtype *before* gathering them
  (half the bytes in bf16) and returns the whole tp-local tensor; backward reduces the gradient in the
  reduce dtype back to this rank's rows: reduce-scatter (levels 2, 3 and 1 with
  ``zero_use_reduce_scatter``, plus an all-reduce across zero groups), or all-reduce over "dp" and slice
  (level 1, nnScaler's default: bitwise DDP's gradients).

The gradient is averaged over the units by the collective (a mean, as DDP) and cast back to the
parameter's dtype, so the optimizer steps fp32 master shards. In the no-sync variant of a program
(gradient accumulation, :mod:`dynshard.runtime.accumulation`) nothing is communicated: a ZeRO parameter
arrives as a whole replica and every gradient stays local until the accumulation is flushed.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import compat
from ..runtime.zero import ZeroSpec, pad_rows


@dataclasses.dataclass(frozen=True)
class GradSync:
    """What one parameter needs across data-parallel units (group names are the traced ones)."""

    dp_group: str
    zero: ZeroSpec | None = None
    shard_group: str = ""
    replica_group: str | None = None
    rank: int = 0                         # this rank's index in the zero group
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    communicate: bool = True              # False: the no-sync variant, gradients stay local (accumulation)

    def gather(self, stored: torch.Tensor) -> torch.Tensor:
        zero = self.zero
        value = stored if self.compute_dtype is None else stored.to(self.compute_dtype)
        if zero is None:
            return value
        whole = compat.all_gather_rows(value, zero.group_size, self.shard_group)
        return whole.narrow(0, 0, zero.rows)

    def reduce(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        zero = self.zero
        if not self.communicate:
            return grad.to(dtype)
        if self.reduce_dtype is not None:
            grad = grad.to(self.reduce_dtype)
        # averaged by the collective ("avg": NCCL's and gloo's own), not by a division after it, which
        # Inductor would compile as one more kernel per bucket
        if zero is None:
            grad = compat.all_reduce(grad, self.dp_group, "avg")
        elif zero.reduce_scatter:
            grad = compat.reduce_scatter_rows(pad_rows(grad, zero.padded_rows), zero.group_size, self.shard_group,
                                              "avg")
            if self.replica_group is not None:
                grad = compat.all_reduce(grad, self.replica_group, "avg")
        else:
            grad = compat.all_reduce(pad_rows(grad, zero.padded_rows), self.dp_group, "avg")
            grad = grad.narrow(0, self.rank * zero.shard_rows, zero.shard_rows)
        return grad.to(dtype)


class SyncOverDP(torch.autograd.Function):
    """Forward: the parameter as the program computes with it; backward: its reduced gradient."""

    @staticmethod
    def forward(ctx, stored: torch.Tensor, sync: GradSync) -> torch.Tensor:
        ctx.sync, ctx.dtype = sync, stored.dtype
        value = sync.gather(stored)
        return value.view_as(value) if value is stored else value

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.sync.reduce(grad, ctx.dtype), None


def sync_over_dp(stored: torch.Tensor, sync: GradSync) -> torch.Tensor:
    if torch.is_grad_enabled() and stored.requires_grad:
        return SyncOverDP.apply(stored, sync)
    return sync.gather(stored)

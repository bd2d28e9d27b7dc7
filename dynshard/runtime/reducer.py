"""Gradient reduction outside the compiled graphs, in buckets (nnScaler's Reducer).

In-graph reduction is the normal path (the backward graphs all-reduce / reduce-scatter as they go). The
reducer takes over what the graphs left local: gradients accumulated under :func:`dynshard.no_sync`,
gradients of parameters that no dynshard program owns (a model of which only a submodule is compiled),
and every gradient while reducer hooks are registered (hooks see each bucket once per step).

A bucket holds gradients of one dtype and one kind of reduction, up to ``bucket_cap_mb``:

- ``all_reduce``: whole gradients, summed over the data-parallel ranks and averaged;
- ``zero``: ZeRO rows: each gradient padded to whole rows of its group, laid out as
  ``[group_size, rows_per_rank * row_numel]`` so one reduce-scatter leaves each rank its own rows of every
  gradient in the bucket (then an all-reduce across zero groups when ``zero_ngroups > 1``), or (level 1,
  nnScaler's default) one all-reduce over "dp" and a slice.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist

from .zero import ZeroGroups, ZeroSpec, pad_rows

Hook = Callable[["Reducer", torch.Tensor], None]


@dataclasses.dataclass
class PendingGrad:
    """A gradient to reduce into ``param.grad``: ``local`` whole (tp-local) on this rank."""

    param: torch.Tensor
    local: torch.Tensor
    group: dist.ProcessGroup          # all-reduce group ("dp", or WORLD for parameters no plan owns)
    size: int                         # ranks the gradient is averaged over
    zero: ZeroSpec | None = None
    zero_groups: ZeroGroups | None = None

    def bucket_key(self) -> tuple:
        if self.zero is None:
            return ("all_reduce", self.local.dtype, id(self.group), self.size)
        return ("zero", self.local.dtype, id(self.zero_groups), self.zero.reduce_scatter, self.zero.group_size)


class Reducer:
    """Buckets, hooks, and the collectives that reduce pending gradients into ``param.grad``."""

    def __init__(self, bucket_cap_mb: float | None = None):
        self.bucket_cap_bytes = int(bucket_cap_mb * 2 ** 20) if bucket_cap_mb else None
        self.pre_hooks: list[Hook] = []
        self.post_hooks: list[Hook] = []
        self.buckets_reduced = 0

    def register_pre_hook(self, fn: Hook) -> None:
        self.pre_hooks.append(fn)

    def register_post_hook(self, fn: Hook) -> None:
        self.post_hooks.append(fn)

    def reduce(self, pending: list[PendingGrad]) -> None:
        """Reduce every pending gradient and add it to its parameter's ``.grad``; same order on all ranks."""
        for bucket in self._buckets(pending):
            if bucket[0].zero is None:
                self._all_reduce(bucket)
            else:
                self._reduce_rows(bucket)
            self.buckets_reduced += 1

    def _buckets(self, pending: list[PendingGrad]) -> list[list[PendingGrad]]:
        by_key: dict[tuple, list[list[PendingGrad]]] = {}
        for item in pending:
            buckets = by_key.setdefault(item.bucket_key(), [[]])
            size = sum(p.local.numel() * p.local.element_size() for p in buckets[-1])
            if buckets[-1] and self.bucket_cap_bytes and size + item.local.numel() * item.local.element_size() \
                    > self.bucket_cap_bytes:
                buckets.append([])
            buckets[-1].append(item)
        return [bucket for buckets in by_key.values() for bucket in buckets]

    def _hooks(self, hooks: list[Hook], flat: torch.Tensor) -> None:
        for hook in hooks:
            hook(self, flat)

    def _all_reduce(self, bucket: list[PendingGrad]) -> None:
        flat = torch.cat([p.local.reshape(-1) for p in bucket])
        self._hooks(self.pre_hooks, flat)
        dist.all_reduce(flat, group=bucket[0].group)
        flat /= bucket[0].size
        self._hooks(self.post_hooks, flat)
        offset = 0
        for item in bucket:
            n = item.local.numel()
            _accumulate(item.param, flat[offset:offset + n].view_as(item.local))
            offset += n

    def _reduce_rows(self, bucket: list[PendingGrad]) -> None:
        first = bucket[0]
        size, groups = first.zero.group_size, first.zero_groups
        rows = [pad_rows(p.local, p.zero.padded_rows).reshape(size, -1) for p in bucket]
        widths = [r.shape[1] for r in rows]
        flat = torch.cat(rows, dim=1).reshape(-1)
        self._hooks(self.pre_hooks, flat)
        dp_size = first.size
        if first.zero.reduce_scatter:
            mine = flat.new_empty(flat.numel() // size)
            dist.reduce_scatter_single(mine, flat, group=groups.shard)
            if groups.replicas is not None:
                dist.all_reduce(mine, group=groups.replicas)
        else:
            dist.all_reduce(flat, group=groups.dp)
            mine = flat.view(size, -1)[groups.rank]
        mine = mine / dp_size
        self._hooks(self.post_hooks, mine)
        offset = 0
        for item, width in zip(bucket, widths):
            shard = mine[offset:offset + width].view((item.zero.shard_rows, *item.local.shape[1:]))
            _accumulate(item.param, shard)
            offset += width


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad.clone()
    else:
        param.grad.add_(grad)

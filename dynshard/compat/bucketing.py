"""Inductor's all-gather bucketing (``torch._inductor.fx_passes.bucketing``, "custom_ops" mode) with dynshard's
merge: ranks whose programs are the same read one cache entry (see :func:`gather_buckets_copied_out`)."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from .counted_patch import CountedPatch
from .ops import _c10d


def gather_buckets_copied_out() -> contextlib.AbstractContextManager:
    """Inductor's all-gather bucketing (``bucketing.all_gather_merge_fn_to_trace_custom_ops``), with two
    changes:

    - the bucket does not depend on this rank's place in the group. Inductor's merge gathers in place
      (the input is the output's chunk at the rank's offset), with the rank a constant of the generated
      code, which Inductor's FX graph cache does not key: ranks whose programs are the same (a
      data-parallel group, or any ranks once :mod:`dynshard.backend.compiler.shared_compiles` names groups
      the same) read one entry, and an in-place gather from another rank's chunk is undefined under NCCL.
      Here the shards are packed into a buffer of their own (Inductor's packing op, as for a group of one)
      and gathered out of place: the same copies, one more shard-sized buffer;
    - each bucket's copy-out is one ``dynshard::copy_out_gathered`` call instead of one generated kernel
      per parameter (see compat/gathered_bucket.py), where the bucket has one dtype.

    Counted (:mod:`.counted_patch`): a compile on another thread must not get Inductor's merge back while
    this one still traces buckets, or a rank's entry would hold its rank."""
    return _RANK_FREE_GATHERS.applied()


def _bucketing_module():
    from torch._inductor.fx_passes import bucketing

    return bucketing


def _rank_free_merge(inductor_merge: Callable) -> Callable:
    from .gathered_bucket import copy_out

    bucketing = _bucketing_module()

    def merge(ag_ins, group_name, group_size: int, dtype, out_dtypes, rank: int):
        packed = torch.ops.bucketing._pre_bucket_all_gather(     # a group of one: [p0 p1 ...], no rank
            ag_ins, 1, dtype, [bucketing._ALL_DTYPES.index(d) for d in out_dtypes], 0,
            bucketing._compute_foreach_groups(ag_ins, out_dtypes))
        gathered = torch.ops.c10d_functional.wait_tensor(
            _c10d.all_gather_into_tensor.default(packed, group_size, group_name))
        if all(out_dtype == dtype for out_dtype in out_dtypes) and all(a.dim() > 0 for a in ag_ins):
            return copy_out(gathered, group_size, [a.shape for a in ag_ins])
        # Inductor's own unpacking (several dtypes in one buffer, or 0-dim shards)
        sizes = [a.numel() * out_dtype.itemsize // dtype.itemsize for a, out_dtype in zip(ag_ins, out_dtypes)]
        rows = torch.split_with_sizes(gathered.reshape(group_size, -1), sizes, dim=1)
        return [row.view(out_dtype).reshape((a.shape[0] * group_size, *a.shape[1:]) if a.dim() else (group_size,))
                for row, a, out_dtype in zip(rows, ag_ins, out_dtypes)]
    return merge


_RANK_FREE_GATHERS = CountedPatch(_bucketing_module, "all_gather_merge_fn_to_trace_custom_ops", _rank_free_merge)

"""Inductor's all-gather bucketing ("custom_ops" mode) with dynshard's merge, in every dynshard compile: ranks
whose programs are the same read one cache entry, and a bucket is copied out by one call."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ...compat import bucketing


def gather_buckets_copied_out() -> contextlib.AbstractContextManager:
    """Inductor's all-gather bucketing (its merge, :func:`dynshard.compat.bucketing.gather_merge_patch`), with
    two changes:

    - the bucket does not depend on this rank's place in the group. Inductor's merge gathers in place
      (the input is the output's chunk at the rank's offset), with the rank a constant of the generated
      code, which Inductor's FX graph cache does not key: ranks whose programs are the same (a
      data-parallel group, or any ranks once :mod:`.shared_compiles` names groups the same) read one
      entry, and an in-place gather from another rank's chunk is undefined under NCCL. Here the shards
      are packed into a buffer of their own (Inductor's packing op, as for a group of one) and gathered
      out of place: the same copies, one more shard-sized buffer;
    - each bucket's copy-out is one ``dynshard::copy_out_gathered`` call instead of one generated kernel
      per parameter (see runtime/gathered_bucket.py), where the bucket has one dtype.

    Counted (:mod:`dynshard.compat.counted_patch`): a compile on another thread must not get Inductor's
    merge back while this one still traces buckets, or a rank's entry would hold its rank."""
    return _RANK_FREE_GATHERS.applied()


def _rank_free_merge(inductor_merge: Callable) -> Callable:
    from ...runtime.gathered_bucket import copy_out     # (registers dynshard::copy_out_gathered: at first use)

    def merge(ag_ins, group_name, group_size: int, dtype, out_dtypes, rank: int):
        gathered = bucketing.all_gather_packed(ag_ins, group_size, group_name, dtype, out_dtypes)
        if all(out_dtype == dtype for out_dtype in out_dtypes) and all(a.dim() > 0 for a in ag_ins):
            return copy_out(gathered, group_size, [a.shape for a in ag_ins])
        # Inductor's own unpacking (several dtypes in one buffer, or 0-dim shards)
        sizes = [a.numel() * out_dtype.itemsize // dtype.itemsize for a, out_dtype in zip(ag_ins, out_dtypes)]
        rows = torch.split_with_sizes(gathered.reshape(group_size, -1), sizes, dim=1)
        return [row.view(out_dtype).reshape((a.shape[0] * group_size, *a.shape[1:]) if a.dim() else (group_size,))
                for row, a, out_dtype in zip(rows, ag_ins, out_dtypes)]
    return merge


_RANK_FREE_GATHERS = bucketing.gather_merge_patch(_rank_free_merge)

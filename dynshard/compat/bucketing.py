"""Inductor's all-gather bucketing (``torch._inductor.fx_passes.bucketing``, "custom_ops" mode): its merge
function and its packing of a bucket's shards, as :mod:`dynshard.backend.compiler.gather_merge` replaces and
calls them."""

from __future__ import annotations

from typing import Callable

import torch

from .counted_patch import CountedPatch
from .ops import _c10d


def _bucketing_module():
    from torch._inductor.fx_passes import bucketing

    return bucketing


def gather_merge_patch(replace: Callable[[Callable], Callable]) -> CountedPatch:
    """``bucketing.all_gather_merge_fn_to_trace_custom_ops`` (how a bucket of all-gathers is traced:
    ``merge(ag_ins, group_name, group_size, dtype, out_dtypes, rank)``) replaced by ``replace(inductor's)``
    while the patch is applied."""
    return CountedPatch(_bucketing_module, "all_gather_merge_fn_to_trace_custom_ops", replace)


def all_gather_packed(ag_ins: list[torch.Tensor], group_size: int, group_name: str, dtype: torch.dtype,
                      out_dtypes: list[torch.dtype]) -> torch.Tensor:
    """The shards packed into one buffer as Inductor packs a bucket for a group of one (``bucketing.
    _pre_bucket_all_gather``: [p0 p1 ...], no rank in it), gathered out of place and waited for."""
    bucketing = _bucketing_module()
    packed = torch.ops.bucketing._pre_bucket_all_gather(
        ag_ins, 1, dtype, [bucketing._ALL_DTYPES.index(d) for d in out_dtypes], 0,
        bucketing._compute_foreach_groups(ag_ins, out_dtypes))
    return torch.ops.c10d_functional.wait_tensor(_c10d.all_gather_into_tensor.default(packed, group_size, group_name))

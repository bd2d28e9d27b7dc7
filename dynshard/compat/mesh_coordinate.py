"""A rank's index in a process group, read when the program runs (``dynshard::mesh_coordinate``).

DTensor's vocabulary-parallel embedding and cross-entropy mask the indices that fall outside this rank's
rows of the table (``_MaskPartial``): ``ids - offset`` and a range test, with ``offset = coordinate *
rows`` computed while tracing, a Python int. Inductor bakes it into the generated kernel, so the ranks of
a tp group generate kernels that differ in that constant alone, and each coordinate built its own copy of
every C++ library holding one (:mod:`dynshard.backend.compiler.kernel_batches`). Read from a tensor the
program computes, the offset becomes a kernel argument: every coordinate generates the same code and the
ranks share each library. :func:`.mask_partial.mask_offsets_read_at_run_time` routes DTensor's masking through it while
dynshard traces (the op's only user: it lives beside it, in compat).
"""

from __future__ import annotations

import torch

from .ops import group_rank


@torch.library.custom_op("dynshard::mesh_coordinate", mutates_args=())
def mesh_coordinate(like: torch.Tensor, group_name: str) -> torch.Tensor:
    """This rank's index in the process group named ``group_name``: a 0-dim int64 tensor on ``like``'s
    device (a fill, no copy from the host)."""
    return torch.full((), group_rank(group_name), dtype=torch.int64, device=like.device)


@mesh_coordinate.register_fake
def _(like, group_name):
    return like.new_empty((), dtype=torch.int64)

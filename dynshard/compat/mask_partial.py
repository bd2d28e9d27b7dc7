"""DTensor's ``_MaskPartial`` (the vocabulary-parallel embedding's and cross-entropy's index masking) with
the shard's offset read when the program runs (:mod:`dynshard.runtime.mesh_coordinate`), while dynshard
traces a rank's program.

torch 2.13's ``_MaskPartial._partition_value`` takes the offset from ``mesh._sym_get_coordinate``: a
Python int unless ``torch.distributed.config.compile_on_one_rank`` is set and the trace has a ShapeEnv
(dynshard's has none, see ``compat.new_fake_mode``). The replacement computes the same mask and masked
indices from ``dynshard::mesh_coordinate`` (torch's ``Shard.local_shard_size_and_offset``: shards of
``ceil(size / n)`` rows, the last ones shorter or empty), so the code Inductor generates is the same on
every coordinate.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.distributed.tensor.placement_types import _MaskPartial


def _partition_value(self, tensor: torch.Tensor, mesh, mesh_dim: int) -> torch.Tensor:
    if not mesh._is_current_rank_part_of_mesh():
        raise AssertionError("rank is not part of mesh")
    if self.offset_shape is None:
        raise AssertionError("offset_shape needs to be set for _MaskPartial")
    size, parts = self.offset_shape[self.offset_dim], mesh.size(mesh_dim)
    rows = -(-size // parts)
    coordinate = torch.ops.dynshard.mesh_coordinate(tensor, mesh.get_group(mesh_dim).group_name)
    start = coordinate * rows
    end = start + rows
    if size % parts:
        start, end = start.clamp(max=size), end.clamp(max=size)
    mask = (tensor < start) | (tensor >= end)
    masked = tensor.clone() - start
    masked[mask] = 0
    self.mask_buffer.materialize_mask(mask)
    return masked


@contextlib.contextmanager
def mask_offsets_read_at_run_time() -> Iterator[None]:
    """Within: ``_MaskPartial`` masks with the offset read at run time (restored on exit)."""
    from ..runtime import mesh_coordinate  # noqa: F401  (registers dynshard::mesh_coordinate)

    original = _MaskPartial.__dict__["_partition_value"]
    _MaskPartial._partition_value = _partition_value
    try:
        yield
    finally:
        _MaskPartial._partition_value = original

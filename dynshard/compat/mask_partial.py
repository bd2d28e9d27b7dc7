"""DTensor's ``_MaskPartial`` (the vocabulary-parallel embedding's and cross-entropy's index masking) with
the shard's offset read when the program runs (:mod:`.mesh_coordinate`), while dynshard
traces a rank's program.

torch 2.13's ``_MaskPartial._partition_value`` takes the offset from ``mesh._sym_get_coordinate``: a
Python int unless ``torch.distributed.config.compile_on_one_rank`` is set and the trace has a ShapeEnv
(dynshard's has none, see ``compat.new_fake_mode``). The replacement computes the same mask and masked
indices from ``dynshard::mesh_coordinate`` (torch's ``Shard.local_shard_size_and_offset``: shards of
``ceil(size / n)`` rows, the last ones shorter or empty), so the code Inductor generates is the same on
every coordinate. It keeps torch's own where the rank in the dimension's process group is not the mesh
coordinate (a mesh whose rows are not ascending: ``new_group`` sorts its ranks) or the mesh has no
process groups.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.distributed.tensor.placement_types import _MaskPartial

from .counted_patch import CountedPatch

_TORCH_PARTITION_VALUE = _MaskPartial.__dict__["_partition_value"]


def _group_ranked_by_coordinate(mesh, mesh_dim: int) -> str | None:
    """The name of the process group of ``mesh_dim`` when this rank's index in it is its mesh coordinate."""
    try:
        group = mesh.get_group(mesh_dim)
    except RuntimeError:        # a mesh without process groups (``_init_backend=False``)
        return None
    coordinate = mesh.get_coordinate()
    try:
        rank = torch.distributed.get_rank(group)
    except ValueError:          # a group no longer registered (a mesh of an earlier job, or a planning mesh)
        return None
    if coordinate is None or rank != coordinate[mesh_dim]:
        return None
    return group.group_name


def _partition_value(self, tensor: torch.Tensor, mesh, mesh_dim: int) -> torch.Tensor:
    group_name = _group_ranked_by_coordinate(mesh, mesh_dim)
    if group_name is None or self.offset_shape is None:
        return _TORCH_PARTITION_VALUE(self, tensor, mesh, mesh_dim)
    size, parts = self.offset_shape[self.offset_dim], mesh.size(mesh_dim)
    rows = -(-size // parts)
    # (in the indices' dtype: torch subtracts a Python int, which keeps int32 indices int32)
    start = (torch.ops.dynshard.mesh_coordinate(tensor, group_name) * rows).to(tensor.dtype)
    end = start + rows
    if size % parts:
        start, end = start.clamp(max=size), end.clamp(max=size)
    mask = (tensor < start) | (tensor >= end)
    masked = tensor.clone() - start
    masked[mask] = 0
    self.mask_buffer.materialize_mask(mask)
    return masked


def is_mask_partial(placement) -> bool:
    """Whether ``placement`` is a masked partial sum (a lookup in a row-split table): its mask has the shape of
    the indices, so it is reduced before any reshape of the value."""
    return isinstance(placement, _MaskPartial)


_PATCH = CountedPatch(lambda: _MaskPartial, "_partition_value", lambda torch_partition_value: _partition_value)


@contextlib.contextmanager
def mask_offsets_read_at_run_time() -> Iterator[None]:
    """Within: ``_MaskPartial`` masks with the offset read at run time (torch's restored when the last
    context open, on any thread, exits)."""
    from . import mesh_coordinate  # noqa: F401  (registers dynshard::mesh_coordinate)

    with _PATCH.applied():
        yield

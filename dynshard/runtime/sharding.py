"""Parameters as this rank's shards, tagged with where they sit (TorchShard's "parallel dim" model).

After the first run of a compiled program every parameter it uses holds only this rank's shard in place
(same ``nn.Parameter`` object, so optimizers and ``state_dict()`` keep working) and carries a
:class:`ShardTag` with its global shape and placements on the mesh.

Dynamo must still trace the user's code with global shapes (``x.view(B, T, H, C // H)`` after a
column-split linear only works on the global tensor). So while Dynamo compiles a frame, every sharded
tensor temporarily holds a zero-memory stand-in of its global shape (:func:`present_global_shapes`),
and gets its shard back when the compile ends; Dynamo's guards on these tensors are dropped by the
backend, so the local shapes at run time never trigger a re-trace.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .mesh import Layout

TAG_ATTR = "_dynshard_tag"
SHARDS = (Shard, _StridedShard)   # _StridedShard is not a Shard subclass in torch 2.13
_SHARDED: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()
_LOCAL_DATA: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def placements_for(layout: Layout, by_dim: Mapping[str, Placement]) -> tuple[Placement, ...]:
    """Placements on ``layout.tp_mesh`` from a {mesh dim: placement} map; missing dims are replicated."""
    return tuple(by_dim.get(name, Replicate()) for name in layout.placement_dims)


def describe_placements(layout: Layout, placements: tuple[Placement, ...]) -> str:
    if not placements:
        return "Replicate()"
    return ", ".join(f"{dim}={p}" for dim, p in zip(layout.placement_dims, placements))


@dataclasses.dataclass
class ShardTag:
    fqn: str
    global_shape: torch.Size
    global_stride: tuple[int, ...]
    placements: tuple[Placement, ...]
    layout: Layout
    plans: list = dataclasses.field(default_factory=list)  # weakrefs to the CompiledPlans using it

    def add_plan(self, plan: Any) -> None:
        if not any(ref() is plan for ref in self.plans):
            self.plans.append(weakref.ref(plan))

    @property
    def parallel_dim(self) -> int | None:
        if not self.placements:
            return None
        placement = self.placements[0]
        return placement.dim if isinstance(placement, SHARDS) else None


def get_tag(tensor: torch.Tensor) -> ShardTag | None:
    return getattr(tensor, TAG_ATTR, None)


def get_parallel_dim(tensor: torch.Tensor) -> int | None:
    """The dimension along which this tensor is split inside its plan unit, or None if it is whole."""
    tag = get_tag(tensor)
    return tag.parallel_dim if tag is not None else None


def _blocks(placement: Placement) -> int:
    """How many blocks a strided shard holds a piece of (1 for a plain shard)."""
    return getattr(placement, "split_factor", 1)


def check_divisible(name: str, shape: torch.Size, layout: Layout, placements: tuple[Placement, ...]) -> None:
    for dim_name, placement in zip(layout.placement_dims, placements):
        if isinstance(placement, SHARDS):
            size, parts = shape[placement.dim], layout.size(dim_name) * _blocks(placement)
            if size % parts:
                raise ValueError(
                    f"dynshard: dimension {placement.dim} of {name} (size {size}) does not divide into "
                    f"{parts} parts along mesh dimension {dim_name!r}; choose a placement on another "
                    f"dimension, replicate it, or change plan_ngpus")


def local_shape(shape: torch.Size, layout: Layout, placements: tuple[Placement, ...]) -> torch.Size:
    dims = list(shape)
    for dim_name, placement in zip(layout.placement_dims, placements):
        if isinstance(placement, SHARDS):
            dims[placement.dim] //= layout.size(dim_name)
    return torch.Size(dims)


def local_shard(full: torch.Tensor, layout: Layout, placements: tuple[Placement, ...]) -> torch.Tensor:
    """This rank's piece of ``full`` (no communication: every rank holds the full tensor)."""
    piece = full
    for dim_name, placement in zip(layout.placement_dims, placements):
        if isinstance(placement, SHARDS):
            parts, coordinate = layout.size(dim_name), layout.coordinate(dim_name)
            piece = torch.cat([block.chunk(parts, dim=placement.dim)[coordinate]
                               for block in piece.chunk(_blocks(placement), dim=placement.dim)], placement.dim)
    return piece.contiguous()


def shard_in_place(tensor: torch.Tensor, fqn: str, layout: Layout,
                   placements: tuple[Placement, ...]) -> ShardTag:
    """Make ``tensor`` hold this rank's shard, and tag it. Ranks first agree on rank 0's values."""
    existing = get_tag(tensor)
    if existing is not None:
        return existing
    if dist.is_initialized() and not tensor.is_meta:
        with torch.no_grad():
            dist.broadcast(tensor.data, src=0)
    global_shape, global_stride = tensor.shape, tensor.stride()
    check_divisible(fqn, global_shape, layout, placements)
    if any(isinstance(p, SHARDS) for p in placements):
        with torch.no_grad():
            tensor.data = local_shard(tensor.data, layout, placements).clone()
    tag = ShardTag(fqn=fqn, global_shape=global_shape, global_stride=tuple(global_stride),
                   placements=placements, layout=layout)
    setattr(tensor, TAG_ATTR, tag)
    if is_sharded(placements):
        _SHARDED.add(tensor)
    return tag


def is_sharded(placements: tuple[Placement, ...]) -> bool:
    return any(isinstance(p, SHARDS) for p in placements)


def present_global_shapes() -> None:
    """Before Dynamo traces: sharded tensors show their global shape (no memory behind it)."""
    for tensor in list(_SHARDED):
        tag = get_tag(tensor)
        if id(tensor) in _LOCAL_DATA or tag is None:
            continue
        _LOCAL_DATA[id(tensor)] = (tensor, tensor.data)
        stand_in = torch.empty((), dtype=tensor.dtype, device=tensor.device).expand(tag.global_shape)
        with torch.no_grad():
            tensor.data = stand_in


def restore_local_shards() -> None:
    """After Dynamo has compiled: sharded tensors hold their shards again."""
    for tensor, local in list(_LOCAL_DATA.values()):
        with torch.no_grad():
            tensor.data = local
    _LOCAL_DATA.clear()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (possibly sharded) local tensor; a collective when it is sharded."""
    tag = get_tag(tensor)
    if tag is None or not is_sharded(tag.placements):
        return tensor.detach()
    dtensor = DTensor.from_local(tensor.detach(), tag.layout.tp_mesh, tag.placements, run_check=False,
                                 shape=tag.global_shape, stride=tag.global_stride)
    return dtensor.full_tensor()

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

from ..compat import StridedShard
from .mesh import Layout
from .zero import ZeroSpec, gather_rows, shard_rows, zero_groups

TAG_ATTR = "_dynshard_tag"
ALIKE_ATTR = "_dynshard_initialized_alike"   # every rank computed the same values (no broadcast needed)
SHARDS = (Shard, StridedShard)   # torch's _StridedShard is not a Shard subclass in torch 2.13
_SHARDED: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()
_TAGGED: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()
_LOCAL_DATA: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def placements_for(layout: Layout, by_dim: Mapping[str, Placement]) -> tuple[Placement, ...]:
    """Placements on ``layout.tp_mesh`` from a {mesh dim: placement} map; missing dims are replicated."""
    return tuple(by_dim.get(name, Replicate()) for name in layout.placement_dims)


def describe_placements(layout: Layout, placements: tuple[Placement, ...]) -> str:
    if not placements:
        return "Replicate()"
    return ", ".join(f"{dim}={p}" for dim, p in zip(layout.placement_dims, placements))


@dataclasses.dataclass(frozen=True)
class StageOwnership:
    """Under a pipeline policy: the stages that read a tensor, and whether this rank runs one of them.
    A rank that does not holds an empty tensor in its place (``collect_state_dict`` fetches it from
    ``src``, the first owning rank of this plan unit, over ``group``, the unit's ranks)."""

    stages: tuple[int, ...]
    src: int
    group: Any
    held: bool

    def describe(self) -> str:
        where = f"pipeline stage{'s' if len(self.stages) > 1 else ''} {', '.join(map(str, self.stages))}"
        return where if self.held else where + " (another rank)"


@dataclasses.dataclass
class ShardTag:
    fqn: str
    global_shape: torch.Size
    global_stride: tuple[int, ...]
    placements: tuple[Placement, ...]
    layout: Layout
    zero: ZeroSpec | None = None   # rows split over the zero group (data-parallel ranks)
    owner: StageOwnership | None = None   # pipeline: the stages that hold it
    plans: list = dataclasses.field(default_factory=list)  # weakrefs to the CompiledPlans using it

    def add_plan(self, plan: Any) -> None:
        if not any(ref() is plan for ref in self.plans):
            self.plans.append(weakref.ref(plan))

    @property
    def is_split(self) -> bool:
        """Whether this rank holds less than the whole tensor (tp shards or ZeRO rows)."""
        return is_sharded(self.placements) or self.zero is not None or self.not_held

    @property
    def not_held(self) -> bool:
        """Under a pipeline policy, this rank runs no stage that reads the tensor (it holds nothing)."""
        return self.owner is not None and not self.owner.held

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


def stored_shape(shape: torch.Size, layout: Layout, placements: tuple[Placement, ...],
                 zero: ZeroSpec | None) -> torch.Size:
    """The shape this rank holds at rest: its tp shard, of which its ZeRO rows."""
    tp_local = local_shape(shape, layout, placements)
    return zero.stored_shape(tp_local) if zero is not None else tp_local


def stored_piece(full: torch.Tensor, tag: ShardTag) -> torch.Tensor:
    """What this rank holds at rest of the whole tensor ``full`` (no communication)."""
    if tag.not_held:
        return full.new_empty(0)
    piece = local_shard(full, tag.layout, tag.placements)
    if tag.zero is not None:
        piece = shard_rows(piece, tag.zero, zero_groups(tag.layout, tag.zero.ngroups).rank)
    return piece


def local_shard(full: torch.Tensor, layout: Layout, placements: tuple[Placement, ...]) -> torch.Tensor:
    """This rank's piece of ``full`` (no communication: every rank holds the full tensor)."""
    piece = full
    for dim_name, placement in zip(layout.placement_dims, placements):
        if isinstance(placement, SHARDS):
            parts, coordinate = layout.size(dim_name), layout.coordinate(dim_name)
            piece = torch.cat([block.chunk(parts, dim=placement.dim)[coordinate]
                               for block in piece.chunk(_blocks(placement), dim=placement.dim)], placement.dim)
    return piece.contiguous()


def mark_initialized_alike(tensor: torch.Tensor) -> None:
    """Every rank computed ``tensor``'s values the same way (a meta-built model initialised on every rank,
    checked by :mod:`.materialize`): :func:`shard_in_place` does not broadcast them."""
    setattr(tensor, ALIKE_ATTR, True)


def shard_in_place(tensor: torch.Tensor, fqn: str, layout: Layout,
                   placements: tuple[Placement, ...], zero: ZeroSpec | None = None) -> ShardTag:
    """Make ``tensor`` hold what this rank stores of it, and tag it. Ranks first agree on rank 0's values
    (a broadcast), unless every rank initialised them alike (:func:`mark_initialized_alike`); a meta
    tensor, which has no values, is tagged as it is."""
    existing = get_tag(tensor)
    if existing is not None:
        return existing
    if dist.is_initialized() and not tensor.is_meta and not getattr(tensor, ALIKE_ATTR, False):
        with torch.no_grad():
            dist.broadcast(tensor.data, src=0)
    global_shape, global_stride = tensor.shape, tensor.stride()
    check_divisible(fqn, global_shape, layout, placements)
    tag = ShardTag(fqn=fqn, global_shape=global_shape, global_stride=tuple(global_stride),
                   placements=placements, layout=layout, zero=zero)
    if tag.is_split:
        with torch.no_grad():
            tensor.data = stored_piece(tensor.data, tag).clone()
        _SHARDED.add(tensor)
    set_tag(tensor, tag)
    return tag


def set_tag(tensor: torch.Tensor, tag: "ShardTag") -> None:
    """Mark ``tensor`` as taken by a dynshard program (:func:`tagged_tensors` lists it)."""
    setattr(tensor, TAG_ATTR, tag)
    _TAGGED.add(tensor)


def tagged_tensors() -> list[torch.Tensor]:
    """Every parameter and buffer a dynshard program has taken (split or whole)."""
    return list(_TAGGED)


def split_tensors() -> list[torch.Tensor]:
    """The tensors that hold only a piece of themselves on this rank (tp shards, ZeRO rows, other stages')."""
    return list(_SHARDED)


def is_sharded(placements: tuple[Placement, ...]) -> bool:
    return any(isinstance(p, SHARDS) for p in placements)


# gradients of sharded tensors whose .data was swapped for a global stand-in: (grad, its local data)
_LOCAL_GRADS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _global_stand_in(like: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A tensor of ``shape`` with ``like``'s dtype and device and no memory behind it (an expanded
    scalar); made outside inference mode, so that a compile under ``torch.inference_mode()`` does not
    turn a parameter into an inference tensor."""
    with torch.inference_mode(False):
        return torch.empty((), dtype=like.dtype, device=like.device).expand(shape)


def present_global_shapes() -> None:
    """Before Dynamo traces a frame dynshard compiles: sharded tensors show their global shape (no
    memory behind it), and so do their gradients (a backward has left local ``.grad`` tensors; Dynamo
    fakes each parameter with its ``.grad``, and refuses a gradient of another shape). The gradient
    tensors stay the same objects (their ``.data`` is swapped), as optimizers and
    ``zero_grad(set_to_none=False)`` expect."""
    for tensor in list(_SHARDED):
        tag = get_tag(tensor)
        if id(tensor) in _LOCAL_DATA or tag is None:
            continue
        grad = tensor.grad if tensor.is_leaf else None
        _LOCAL_DATA[id(tensor)] = (tensor, tensor.data)
        with torch.no_grad():
            tensor.data = _global_stand_in(tensor, tag.global_shape)
            if grad is not None and grad.shape != tag.global_shape:
                _LOCAL_GRADS[id(tensor)] = (grad, grad.data)
                grad.data = _global_stand_in(grad, tag.global_shape)


def restore_local_shards() -> None:
    """After Dynamo has compiled: sharded tensors (and their gradients) hold their shards again."""
    with torch.no_grad():
        for tensor, local in list(_LOCAL_DATA.values()):
            tensor.data = local
        for grad, local in list(_LOCAL_GRADS.values()):
            grad.data = local
    _LOCAL_DATA.clear()
    _LOCAL_GRADS.clear()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (possibly sharded) local tensor; a collective when it is sharded."""
    tag = get_tag(tensor)
    if tag is not None and tag.owner is not None:   # pipeline: from the first rank of a stage holding it
        if tag.owner.held:
            whole = unit_full_tensor(tensor, tag)
            whole = whole.clone() if whole is tensor.detach() else whole
        else:
            whole = torch.empty(tag.global_shape, dtype=tensor.dtype, device=tensor.device)
        dist.broadcast(whole, src=tag.owner.src, group=tag.owner.group)
        return whole
    return unit_full_tensor(tensor, tag)


def unit_full_tensor(tensor: torch.Tensor, tag: ShardTag | None) -> torch.Tensor:
    """The whole tensor from the tp shards and ZeRO rows of the ranks holding it."""
    if tag is None or not (is_sharded(tag.placements) or tag.zero is not None):
        return tensor.detach()
    local = tensor.detach()
    if tag.zero is not None:
        local = gather_rows(local, tag.zero, zero_groups(tag.layout, tag.zero.ngroups))
    if not is_sharded(tag.placements):
        return local.clone()
    dtensor = DTensor.from_local(local, tag.layout.tp_mesh, tag.placements, run_check=False,
                                 shape=tag.global_shape, stride=tag.global_stride)
    return dtensor.full_tensor()

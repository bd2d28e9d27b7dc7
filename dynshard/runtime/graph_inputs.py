"""A captured graph's inputs as every stage of the flow sees them: parameters, buffers and user inputs by
name, with their global (unsharded) metadata (``backend.capture`` describes them from Dynamo's graph)."""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import Placement

from .sharding import ShardTag


@dataclasses.dataclass(frozen=True)
class GraphInput:
    """One placeholder of the captured graph, described by its global (unsharded) metadata."""

    index: int
    name: str            # fully qualified name for parameters and buffers, placeholder name otherwise
    kind: str            # "parameter", "buffer" or "input"
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    tag: ShardTag | None  # set when the tensor already holds its shard (placement is then fixed)
    # a DTensor input (a split value from another program): its placements, fixed, and its mesh's ranks
    placements: tuple[Placement, ...] | None = None
    mesh: tuple[tuple[str, ...], tuple[int, ...]] | None = None

    @property
    def is_state(self) -> bool:
        return self.kind in ("parameter", "buffer")

    @property
    def is_split_value(self) -> bool:
        """A DTensor input: it arrives as this rank's piece, with placements no policy may change."""
        return self.placements is not None

    def token(self) -> str:
        token = f"{self.kind}:{self.name}:{tuple(self.shape)}:{self.stride}:{self.dtype}:{self.requires_grad}"
        return token if self.placements is None else f"{token}:{self.placements}:{self.mesh}"


def mesh_identity(mesh) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """What tells two device meshes apart: their dimension names and global ranks."""
    return tuple(mesh.mesh_dim_names or ()), tuple(mesh.mesh.flatten().tolist())

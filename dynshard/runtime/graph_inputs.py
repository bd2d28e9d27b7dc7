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
    kind: str            # "parameter", "buffer", "input" or "size" (a symbolic size Dynamo passes as an int)
    shape: torch.Size    # global; a symbolic dimension holds the size this compile was traced at (its hint)
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    tag: ShardTag | None  # set when the tensor already holds its shard (placement is then fixed)
    # a DTensor input (a split value from another program): its placements, fixed, and its mesh's ranks
    placements: tuple[Placement, ...] | None = None
    mesh: tuple[tuple[str, ...], tuple[int, ...]] | None = None
    # per dimension, the symbolic size it follows ("d0", "2*d1") or None where it is static; for a "size"
    # input, its own expression: the graph's shape family (the symbols numbered as they first appear)
    symbols: tuple[str | None, ...] | None = None
    value: int | None = None     # a "size" input: the size this compile was traced at

    @property
    def is_state(self) -> bool:
        return self.kind in ("parameter", "buffer")

    @property
    def is_split_value(self) -> bool:
        """A DTensor input: it arrives as this rank's piece, with placements no policy may change."""
        return self.placements is not None

    @property
    def is_symbolic(self) -> bool:
        return self.symbols is not None and any(s is not None for s in self.symbols)

    def family_shape(self) -> tuple:
        """The shape with its symbolic dimensions named, not sized: what every size of the family shares."""
        if self.symbols is None:
            return tuple(self.shape)
        if self.kind == "size":
            return self.symbols
        return tuple(size if symbol is None else symbol for size, symbol in zip(self.shape, self.symbols))

    def token(self) -> str:
        """What decides a plan: a symbolic dimension counts by its symbol, so every size of a family (and
        every rank of a family, whatever its own rows' length) has one token."""
        stride = self.stride if not self.is_symbolic else "symbolic"
        token = f"{self.kind}:{self.name}:{self.family_shape()}:{stride}:{self.dtype}:{self.requires_grad}"
        return token if self.placements is None else f"{token}:{self.placements}:{self.mesh}"


def mesh_identity(mesh) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """What tells two device meshes apart: their dimension names and global ranks."""
    return tuple(mesh.mesh_dim_names or ()), tuple(mesh.mesh.flatten().tolist())


def sizes_of(inputs, args=None) -> tuple:
    """The sizes a call gives a graph's symbolic dimensions (``args``: the call's arguments; None: the sizes the
    graph was traced at), in input order: what tells the programs of one shape family apart."""
    sizes = []
    for inp in inputs:
        if not inp.is_symbolic:
            continue
        if inp.kind == "size":
            sizes.append(int(args[inp.index]) if args is not None else inp.value)
        else:
            shape = args[inp.index].shape if args is not None else inp.shape
            sizes.append(tuple(int(shape[d]) for d, symbol in enumerate(inp.symbols) if symbol is not None))
    return tuple(sizes)


def batch_size_inputs(inputs) -> list[int]:
    """The indices of a symbolic graph's size inputs that are its batch's size: the symbol of dim 0 of a user
    input (what a pipeline divides with the batch it splits into micro-batches)."""
    batch = {inp.symbols[0] for inp in inputs
             if inp.kind == "input" and len(inp.shape) > 0 and inp.symbols and inp.symbols[0] is not None}
    return [inp.index for inp in inputs if inp.kind == "size" and inp.symbols[0] in batch]

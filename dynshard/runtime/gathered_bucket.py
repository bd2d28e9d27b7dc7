"""The copy of every parameter out of one gathered ZeRO bucket, as one call (FSDP2's copy-out).

Inductor buckets the parameter all-gathers of a program (or of an outlined block) into one all-gather
of a flat buffer laid out ``[rank 0: p0 p1 ... | rank 1: p0 p1 ... | ...]``. Each gathered parameter is
then a strided view across the rank rows, and Inductor's own bucketing copies it out with a kernel of
its own per parameter (offsets baked in: one C++ or Triton compile each, the larger part of ZeRO-3's
first-step cost on CPU). ``dynshard::copy_out_gathered`` copies all of a bucket's parameters with
one ``split_with_sizes_copy``, an ATen call Inductor runs as is (a fallback kernel, nothing to
generate), as FSDP2 does outside the graph, in every step of a ZeRO program.
:func:`dynshard.backend.compiler.gather_buckets_copied_out` routes Inductor's bucketing through it.
"""

from __future__ import annotations

import math

import torch


def _shapes(dims: list[int], ndims: list[int]) -> list[list[int]]:
    shapes, start = [], 0
    for n in ndims:
        shapes.append(list(dims[start:start + n]))
        start += n
    return shapes


def _gathered_shape(shape: list[int], group_size: int) -> list[int]:
    return [shape[0] * group_size, *shape[1:]]


@torch.library.custom_op("dynshard::copy_out_gathered", mutates_args=())
def copy_out_gathered(gathered: torch.Tensor, group_size: int, dims: list[int], ndims: list[int]) -> list[torch.Tensor]:
    """``gathered``: the flat all-gather output of a bucket; ``dims``/``ndims``: the input shards' shapes,
    flattened (a schema takes no nested lists). Returns each parameter gathered along dim 0, contiguous."""
    shapes = _shapes(dims, ndims)
    outs = [gathered.new_empty(_gathered_shape(shape, group_size)) for shape in shapes]
    torch.split_with_sizes_copy(gathered.view(group_size, -1), [math.prod(shape) for shape in shapes], dim=1,
                                out=[out.view(group_size, -1) for out in outs])
    return outs


@copy_out_gathered.register_fake
def _(gathered, group_size, dims, ndims):
    return [gathered.new_empty(_gathered_shape(shape, group_size)) for shape in _shapes(dims, ndims)]


def copy_out(gathered: torch.Tensor, group_size: int, shard_shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Each parameter of a gathered bucket whose input shards had ``shard_shapes`` (one dtype)."""
    return list(torch.ops.dynshard.copy_out_gathered(gathered, group_size,
                                                     [d for shape in shard_shapes for d in shape],
                                                     [len(shape) for shape in shard_shapes]))

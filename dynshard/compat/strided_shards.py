"""DTensor's ``_StridedShard`` with a split factor that is one of Dynamo's (backed) symbols.

DTensor's view rule flattens a split dimension into the dimensions before it as a ``_StridedShard`` whose split
factor is their size: ``(B, heads, S, d) -> (B * heads, S, d)``, heads split, is ``_StridedShard(0,
split_factor=B)`` (a 4-D matmul's fold into ``bmm``, as the math attention on CPU does). torch 2.13 takes a
symbolic factor only from an unbacked symbol with a hint override, and splits a whole tensor into such a
placement by chunking it into ``split_factor`` pieces, a count that must be an int (the trace would take the
size at hand for every batch). With a symbolic batch both are lifted here, while inside
:func:`strided_shards_on_symbols`:

- a backed factor is accepted: every rank of a unit reads one batch, so the factor is the same on every rank.
  Two factors are still matched by their expressions only (matching them by their hints asserts them equal
  to the hint, which would specialize the batch);
- the split is a reshape: the dimension viewed as ``(split_factor, ranks, rest)`` and each rank's slice of
  the middle one, the layout ``_StridedShard`` defines, and a rank's size and first offset follow from it,
  where the dimension divides evenly. Else the placement is refused, as torch refuses it (its own split would
  count the pieces at the size at hand).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _is_symbolic(value: object) -> bool:
    return isinstance(value, torch.SymInt) and not value.node.expr.is_number


def _even_group(size, factor, ranks: int) -> int | None:
    """The size of each of ``factor`` groups of ``size``, where they are even and split evenly over ``ranks``."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    group = size // factor
    if isinstance(group, torch.SymInt):
        if not group.node.expr.is_number:
            return None
        group = int(group)
    return group if guard_or_false(group * factor == size) and group % ranks == 0 else None


def _refuse_uneven(group: int | None, placement, size) -> int:
    if group is None:
        raise NotImplementedError(f"dynshard: {placement} of a dimension of {size} on symbolic sizes: its groups "
                                  "do not split evenly")
    return group


@contextlib.contextmanager
def strided_shards_on_symbols() -> Iterator[None]:
    import torch.distributed.tensor._ops._view_ops as view_ops
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.distributed.tensor.placement_types import _StridedShardOffsetMode
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, guarding_hint_or_throw

    explicit_hint, matched_hint = view_ops._explicit_unbacked_hint, view_ops._split_factor_hint
    split_tensor, size_and_offset = _StridedShard._split_tensor, _StridedShard.local_shard_size_and_offset

    def backed_hint(value: object) -> int | None:
        hint = explicit_hint(value)
        if hint is None and _is_symbolic(value) and not free_unbacked_symbols(value.node.expr):
            return int(guarding_hint_or_throw(value))     # (read without a guard)
        return hint

    def matched_by_expression(value: object) -> int | None:
        return int(value) if isinstance(value, int) else explicit_hint(value)

    def split_by_reshape(self, tensor: torch.Tensor, num_chunks: int, *, with_padding: bool = True,
                         contiguous: bool = True):
        factor = self.split_factor
        if not _is_symbolic(factor):
            return split_tensor(self, tensor, num_chunks, with_padding=with_padding, contiguous=contiguous)
        group = _refuse_uneven(_even_group(tensor.size(self.dim), factor, num_chunks), self, tensor.size(self.dim))
        groups = tensor.unflatten(self.dim, (factor, num_chunks, group // num_chunks))
        shards = [groups.select(self.dim + 1, index).flatten(self.dim, self.dim + 1) for index in range(num_chunks)]
        if contiguous:
            shards = [shard.contiguous() for shard in shards]
        return shards, [0] * num_chunks if with_padding else []

    def size_and_first_offset(self, curr_local_size, num_chunks: int, rank, offset_mode=_StridedShardOffsetMode.FIRST):
        factor, mode = self.split_factor, _StridedShardOffsetMode(offset_mode)
        if not _is_symbolic(factor):
            return size_and_offset(self, curr_local_size, num_chunks, rank, offset_mode)
        group = _refuse_uneven(_even_group(curr_local_size, factor, num_chunks), self, curr_local_size)
        if mode is _StridedShardOffsetMode.ALL or not isinstance(rank, int):
            raise NotImplementedError(f"dynshard: every offset of {self} on symbolic sizes")
        piece = group // num_chunks
        return factor * piece, (rank * piece if mode is _StridedShardOffsetMode.FIRST else None)

    view_ops._explicit_unbacked_hint, view_ops._split_factor_hint = backed_hint, matched_by_expression
    _StridedShard._split_tensor = split_by_reshape
    _StridedShard.local_shard_size_and_offset = size_and_first_offset
    try:
        yield
    finally:
        view_ops._explicit_unbacked_hint, view_ops._split_factor_hint = explicit_hint, matched_hint
        _StridedShard._split_tensor, _StridedShard.local_shard_size_and_offset = split_tensor, size_and_offset

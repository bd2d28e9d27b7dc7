"""What a rank owns, as pieces DCP writes and reads at global offsets.

A tagged parameter (and each optimizer state tensor of its shape) is described by the chunks of the
global tensor this rank stores: its tp shard (one chunk, or one per block of a ``_StridedShard``), and
with ZeRO only the rows of that shard this rank keeps, without the padding rows. Replicas (dp units,
ZeRO groups) describe the same chunks; DCP's save planner writes each chunk once. Untagged tensors are
whole on every rank and go to DCP as plain tensors.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..runtime.sharding import SHARDS, ShardTag, get_tag, stored_shape


@dataclasses.dataclass(frozen=True)
class Chunk:
    offsets: torch.Size        # in the global tensor
    sizes: torch.Size
    local: torch.Tensor        # a view of this rank's stored tensor


class Pieces:
    """This rank's chunks of one global tensor (DCP's checkpointable protocol, see the notes in ``dynshard.compat``)."""

    def __init__(self, global_shape: torch.Size, dtype: torch.dtype, chunks: list[Chunk]):
        self.global_shape = torch.Size(global_shape)
        self.dtype = dtype
        self.chunks = chunks

    def size(self) -> torch.Size:      # DCP compares it with the saved size on load
        return self.global_shape

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        items = []
        for chunk in self.chunks:
            items.append(WriteItem(
                index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=chunk.offsets, sizes=chunk.sizes),
                    properties=TensorProperties.create_from_tensor(chunk.local), size=self.global_shape)))
        return items

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=c.offsets, sizes=c.sizes) for c in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        offsets = torch.Size(index.offset)
        for chunk in self.chunks:
            if chunk.offsets == offsets:
                return chunk.local
        raise ValueError(f"dynshard: no piece of {index.fqn} at {tuple(offsets)} on this rank")

    def __repr__(self) -> str:
        chunks = ", ".join(f"{tuple(c.offsets)}+{tuple(c.sizes)}" for c in self.chunks)
        return f"Pieces({tuple(self.global_shape)}: {chunks})"


def _tp_segments(tag: ShardTag, dim: int) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of the tp-local tensor along ``dim`` (as ``local_shard``)."""
    size = tag.global_shape[dim]
    segments = [(0, 0, size)]
    for dim_name, placement in zip(tag.layout.placement_dims, tag.placements):
        if not isinstance(placement, SHARDS) or placement.dim != dim:
            continue
        if len(segments) != 1 or segments[0][2] != size:
            raise NotImplementedError(f"dynshard.checkpoint: {tag.fqn} is split twice along dim {dim}")
        parts, coordinate = tag.layout.size(dim_name), tag.layout.coordinate(dim_name)
        blocks = getattr(placement, "split_factor", 1)
        block = size // blocks
        length = block // parts
        segments = [(b * length, b * block + coordinate * length, length) for b in range(blocks)]
    return segments


def _zero_rows(tag: ShardTag, segments: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Dim-0 segments of the stored rows: this rank's rows of the tp shard, padding rows left out."""
    spec = tag.zero
    rank = tag.layout.dp_rank % spec.group_size
    lo = rank * spec.shard_rows
    hi = min(lo + spec.shard_rows, spec.rows)
    rows = []
    for local, global_, length in segments:
        start, end = max(local, lo), min(local + length, hi)
        if start < end:
            rows.append((start - lo, global_ + start - local, end - start))
    return rows


def chunks_of(stored: torch.Tensor, tag: ShardTag) -> list[Chunk]:
    """The chunks of the global tensor that ``stored`` (a tensor this rank holds at rest under ``tag``,
    a parameter or an optimizer state of its shape) holds, with views of ``stored`` for each."""
    per_dim = [_tp_segments(tag, dim) for dim in range(len(tag.global_shape))]
    if tag.zero is not None:
        per_dim[0] = _zero_rows(tag, per_dim[0])
    chunks = []
    for combination in itertools.product(*per_dim):
        local = stored
        for dim, (start, _, length) in enumerate(combination):
            local = local.narrow(dim, start, length)
        chunks.append(Chunk(offsets=torch.Size(g for _, g, _ in combination),
                            sizes=torch.Size(n for _, _, n in combination), local=local))
    return chunks


def describe(value: torch.Tensor, tag: ShardTag | None = None) -> torch.Tensor | Pieces:
    """What DCP gets for ``value``: a plain tensor if it is whole, else this rank's pieces of it. ``tag``
    (default: ``value``'s own) tells where ``value`` sits; an optimizer state passes its parameter's."""
    tag = tag if tag is not None else get_tag(value)
    value = value.detach()
    if tag is None or not tag.is_split:
        return value
    if tag.not_held:       # pipeline: another rank's stage holds it; this rank writes and reads nothing of it
        # a scalar state (Adam's step) keeps its own (scalar) size, which DCP checks against the saved one;
        # this rank's copy is not written: it stops counting once the stages own their parameters
        return Pieces(value.shape if value.dim() == 0 else tag.global_shape, value.dtype, [])
    stored = stored_shape(tag.global_shape, tag.layout, tag.placements, tag.zero)
    if value.shape != stored:
        if value.dim() and value.shape != tag.global_shape:
            # e.g. a factored optimizer state: its pieces differ per rank and have no global layout here
            raise NotImplementedError(f"dynshard.checkpoint: a tensor of shape {tuple(value.shape)} sits with "
                                      f"{tag.fqn}, stored as {tuple(stored)}; only state of the parameter's "
                                      "shape, or scalars, can be saved")
        return value       # whole (loaded before the first step) or a scalar (Adam's step)
    return Pieces(tag.global_shape, value.dtype, chunks_of(value, tag))

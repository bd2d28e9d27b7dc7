"""Attention over a sequence split across a unit's ranks (context parallelism), exact.

A plan that splits the sequence (the ``tp`` policy's ``context_parallel``) runs every token-wise op on the
rank's own tokens by DTensor's strategies: a value split along the sequence is a ``Shard`` of it, and a
whole operand it meets (positions, a rotary table, shifted labels, a mask) is sliced locally. Attention is
the one op that mixes tokens, and no DTensor strategy splits it along the sequence (torch's own context
parallelism registers one only inside its context, for the CUDA kernels). dynshard runs it as Llama 3 does
("The Llama 3 Herd of Models", section 3.3.2):

- the keys and values all-gathered over the ranks that split the sequence (under grouped-query attention
  the small operand), each rank's queries against them; the gather's backward reduce-scatters the keys' and
  values' gradients to the ranks that hold them;
- under a causal mask, the work balanced: seen as ``2C`` chunks, the sequence's chunks ``r`` and
  ``2C - 1 - r`` are rank r's to compute, so that every rank computes the same number of query-key blocks.
  The values stay where ``Shard`` puts them (rank r holds chunks ``2r`` and ``2r + 1``): only the queries
  of a chunk travel to the rank computing them, and its outputs back (an all-to-all each way). Query chunk
  ``j`` attends to the keys of chunks ``0..j`` under a lower-right causal mask.

Why not permute the sequence itself, as torchtitan's head-tail load balancer does: every value entering the
split region (positions made by ``arange``, labels shifted by the model's loss, masks, rotary tables) would
have to be permuted alike inside the program, where ``Shard`` everywhere else means contiguous chunks; a
loss that shifts its labels after the permutation is silently wrong. The exchange costs one chunk of
queries and one of outputs per rank and layer (and the same in the backward), beside the K/V gather.

The propagation (:func:`abstract_attention`) gives the op's outputs the queries' placements and records the
collectives; the per-rank program runs :func:`attention_fn`'s function in the op's place.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import compat
from ..runtime.mesh import Layout
from .propagation import Collective

_aten = torch.ops.aten
SEQUENCE_DIM = 2        # of (batch, heads, sequence, head_dim)
_FLASH_CPU = _aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
ATTENTION_OPS = (_FLASH_CPU,
                 _aten._scaled_dot_product_flash_attention.default,
                 _aten._scaled_dot_product_efficient_attention.default)


@dataclasses.dataclass(frozen=True)
class Attention:
    """An attention op's arguments, by meaning."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    is_causal: bool
    scale: float | None
    dropout_p: float
    mask: torch.Tensor | None       # an explicit mask or bias, (.., T, T) broadcast over batch and heads


def attention_arguments(target, args: tuple, kwargs: dict) -> Attention:
    schema = target._schema.arguments
    bound = {a.name: a.default_value for a in schema if a.has_default_value()}
    bound.update(zip((a.name for a in schema), args))
    bound.update(kwargs)
    mask = bound.get("attn_mask", bound.get("attn_bias"))
    return Attention(bound["query"], bound["key"], bound["value"], bool(bound.get("is_causal", False)),
                     bound.get("scale"), float(bound.get("dropout_p", 0.0)), mask)


def sequence_split_dims(placements) -> list[int]:
    """The mesh dimensions (indices) along which a (batch, heads, sequence, head_dim) value is split along its
    sequence."""
    return [i for i, p in enumerate(placements) if type(p) is Shard and p.dim == SEQUENCE_DIM]


def splits_sequence(target, args: tuple, kwargs: dict) -> bool:
    """Whether an attention op's queries arrive split along the sequence (context parallelism)."""
    if target not in ATTENTION_OPS:
        return False
    query = attention_arguments(target, args, kwargs).query
    return isinstance(query, DTensor) and bool(sequence_split_dims(query.placements))


def check_attention(attention: Attention, where: str) -> None:
    if attention.dropout_p:
        raise NotImplementedError(
            f"dynshard: context parallelism takes attention without dropout; this one has dropout_p="
            f"{attention.dropout_p} ({where}): set the model's attention dropout to 0, or leave context_parallel unset")
    if attention.mask is not None and (attention.is_causal or attention.mask.dim() < 2):
        raise NotImplementedError(f"dynshard: context parallelism takes a mask of (.., queries, keys) without "
                                  f"is_causal ({where})")


def abstract_attention(node_name: str, target, args: tuple, kwargs: dict, layout: Layout, where: str
                       ) -> tuple[tuple, list[Collective]]:
    """The op's outputs on fake DTensors (split like the queries) and the collectives it costs."""
    attention = attention_arguments(target, args, kwargs)
    check_attention(attention, where)
    query = attention.query
    dims = sequence_split_dims(query.placements)
    collectives = []
    operands = []
    for operand in (attention.key, attention.value):
        gathered = _gathered_placements(operand, dims)
        for dim in dims:
            if type(operand.placements[dim]) is Shard:
                collectives.append(Collective(node_name, "all_gather", layout.placement_dims[dim],
                                              _local_bytes(operand, gathered)))
        operands.append(_empty_like(operand, _local_shape(operand, gathered)))
    if attention.is_causal:
        for _ in range(2):      # one chunk of queries there, one of outputs back
            collectives.extend(Collective(node_name, "all_to_all", layout.placement_dims[dim],
                                          _local_bytes(query, query.placements) // 2) for dim in dims)
    local_query = _empty_like(query, _local_shape(query, query.placements))
    rest, options = list(args[3:]), dict(kwargs)
    if attention.mask is not None:      # (the mask's rows of this rank's queries: a local slice)
        mask = attention.mask
        if isinstance(mask, DTensor) and any(p != Replicate() for p in mask.placements):
            collectives.append(Collective(node_name, "all_gather", layout.placement_dims[dims[0]],
                                          math.prod(mask.shape) * mask.dtype.itemsize, mirrored=False))
        local_mask = _empty_like(mask, _mask_rows_shape(mask, local_query.shape[SEQUENCE_DIM]))
        if "attn_mask" in options or "attn_bias" in options:
            options["attn_mask" if "attn_mask" in options else "attn_bias"] = local_mask
        else:
            rest[0] = local_mask        # (the efficient kernel's attn_bias is positional)
    local = target(local_query, *operands, *rest, **options)
    mesh = layout.tp_mesh
    outputs = tuple(
        DTensor.from_local(out, mesh, query.placements, run_check=False, shape=_global_shape(out, query),
                           stride=_stride_like(out, _global_shape(out, query)))
        if isinstance(out, torch.Tensor) and out.dim() >= 3 else out for out in local)
    return outputs, collectives


def attention_fn(layout: Layout, target):
    """The per-rank program's attention in place of ``target`` (an op of :data:`ATTENTION_OPS`): DTensors in,
    the op's outputs out, the output split like the queries (the others None: nothing reads them)."""
    mesh = layout.tp_mesh
    outputs = len(target._schema.returns)

    def context_parallel_attention(*args, **kwargs):
        attention = attention_arguments(target, args, kwargs)
        query = attention.query
        dims = sequence_split_dims(query.placements)
        assert len(dims) == 1, (query.placements, attention.key.placements)
        (dim,) = dims
        group = mesh.get_group(dim)
        ranks, rank = group.size(), mesh.get_local_rank(dim)
        key, value = (_SequenceGather.apply(t.to_local(), ranks, group.group_name)
                      if type(t.placements[dim]) is Shard else t.to_local() for t in (attention.key, attention.value))
        mask = attention.mask
        if mask is not None:
            if isinstance(mask, DTensor):
                mask = mask.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
            if mask.shape[-2] == query.shape[SEQUENCE_DIM]:     # (whole: this rank's queries' rows of it)
                rows = query.to_local().shape[SEQUENCE_DIM]
                mask = mask.narrow(-2, rank * rows, rows)
        out = attend(query.to_local(), key, value, is_causal=attention.is_causal, scale=attention.scale,
                     ranks=ranks, rank=rank, group_name=group.group_name, mask=mask)
        out = _laid_out_like(out, query.to_local())    # (as the op lays it out: the program's views were traced so)
        out = DTensor.from_local(out, mesh, query.placements, run_check=False, shape=query.shape,
                                 stride=query.stride())
        return (out,) + (None,) * (outputs - 1)
    return context_parallel_attention


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool, scale: float | None,
           ranks: int, rank: int, group_name: str, mask: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's queries (its contiguous chunk of the sequence) against the whole keys and values. ``mask``:
    its rows for these queries (an explicit mask: every rank computes its whole rows, the same work)."""
    grouped = key.shape[1] != query.shape[1]    # grouped-query attention's shared heads
    if grouped and query.device.type != "cpu":  # (the CPU flash op takes them as they are, forward and backward)
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        grouped = False
    if not is_causal:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=grouped)
    chunk = query.shape[SEQUENCE_DIM] // 2
    chunks = BalancedChunks(ranks, rank)
    queries = _Exchange.apply(_in_order(query, chunks.sending_order), chunks.sent, chunks.received, group_name)
    outputs = []
    for i, j in enumerate(chunks.computed):
        q = queries.narrow(SEQUENCE_DIM, i * chunk, chunk)
        own_key, own_value = (t.narrow(SEQUENCE_DIM, j * chunk, chunk) for t in (key, value))
        if j == 0:
            outputs.append(F.scaled_dot_product_attention(q, own_key, own_value, is_causal=True, scale=scale,
                                                          enable_gqa=grouped))
        elif query.device.type == "cpu":
            earlier_key, earlier_value = (t.narrow(SEQUENCE_DIM, 0, j * chunk) for t in (key, value))
            outputs.append(_EarlierAndOwnChunk.apply(q, earlier_key, earlier_value, own_key, own_value, scale))
        else:       # (a mask of the chunk's rows: kept for the backward, chunk x keys elements)
            keys = (j + 1) * chunk
            mask = torch.ones(chunk, keys, dtype=torch.bool, device=query.device).tril(diagonal=j * chunk)
            outputs.append(F.scaled_dot_product_attention(q, key.narrow(SEQUENCE_DIM, 0, keys),
                                                          value.narrow(SEQUENCE_DIM, 0, keys), attn_mask=mask,
                                                          scale=scale))
    back = _Exchange.apply(torch.cat(outputs, SEQUENCE_DIM), chunks.received, chunks.sent, group_name)
    return _in_order(back, chunks.sending_order)     # (its own inverse: a permutation of two)


def _in_order(local: torch.Tensor, order: tuple[int, int]) -> torch.Tensor:
    """The rank's two chunks in ``order`` (positions among the two)."""
    if order == (0, 1):
        return local
    return torch.cat(local.chunk(2, SEQUENCE_DIM)[::-1], SEQUENCE_DIM)


@dataclasses.dataclass(frozen=True)
class BalancedChunks:
    """Which chunks of ``2 * ranks`` rank ``rank`` computes (``computed``: ``rank`` and ``2 * ranks - 1 - rank``,
    in the order they arrive) and how many chunks an all-to-all moves to and from each rank (``sent``,
    ``received``: rank ``rank`` holds chunks ``2 * rank`` and ``2 * rank + 1``)."""

    ranks: int
    rank: int

    def worker(self, chunk: int) -> int:
        return chunk if chunk < self.ranks else 2 * self.ranks - 1 - chunk

    @property
    def sending_order(self) -> tuple[int, int]:
        """The rank's own two chunks (positions 0, 1) in the order of the ranks that compute them."""
        own = (2 * self.rank, 2 * self.rank + 1)
        return tuple(sorted((0, 1), key=lambda i: (self.worker(own[i]), i)))

    @property
    def computed(self) -> tuple[int, ...]:
        return tuple(j for source in range(self.ranks) for j in (2 * source, 2 * source + 1)
                     if self.worker(j) == self.rank)

    @property
    def sent(self) -> tuple[int, ...]:
        own = (2 * self.rank, 2 * self.rank + 1)
        return tuple(sum(self.worker(j) == d for j in own) for d in range(self.ranks))

    @property
    def received(self) -> tuple[int, ...]:
        return tuple(sum(1 for j in (2 * s, 2 * s + 1) if self.worker(j) == self.rank) for s in range(self.ranks))


class _EarlierAndOwnChunk(torch.autograd.Function):
    """A chunk of queries against the keys of the chunks before it (every one visible) and of its own chunk
    (causal), as one softmax, with no mask: two flash attentions, their outputs merged by their log-sum-exps
    in fp32. The backward runs each part's flash backward against the merged output and log-sum-exp, which
    makes each part's gradient the whole softmax's (ring attention's rule). A mask of the chunk's rows instead
    would be kept for the backward: chunk x keys floats a chunk, more than the rank's activations at long
    sequences."""

    @staticmethod
    def forward(ctx, query, earlier_key, earlier_value, own_key, own_value, scale):
        earlier, earlier_lse = _FLASH_CPU(query, earlier_key, earlier_value, 0.0, False, scale=scale)
        own, own_lse = _FLASH_CPU(query, own_key, own_value, 0.0, True, scale=scale)
        lse = torch.logaddexp(earlier_lse, own_lse)
        merged = torch.promote_types(query.dtype, torch.float32)       # (fp32 at least)
        out = (earlier.to(merged) * (earlier_lse - lse).exp().unsqueeze(-1).to(merged) +
               own.to(merged) * (own_lse - lse).exp().unsqueeze(-1).to(merged)).to(query.dtype)
        ctx.save_for_backward(query, earlier_key, earlier_value, own_key, own_value, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        query, earlier_key, earlier_value, own_key, own_value, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq_earlier, d_earlier_key, d_earlier_value = _FLASH_CPU_BACKWARD(
            grad, query, earlier_key, earlier_value, out, lse, 0.0, False, scale=ctx.scale)
        dq_own, d_own_key, d_own_value = _FLASH_CPU_BACKWARD(grad, query, own_key, own_value, out, lse, 0.0, True,
                                                             scale=ctx.scale)
        return dq_earlier + dq_own, d_earlier_key, d_earlier_value, d_own_key, d_own_value, None


class _SequenceGather(torch.autograd.Function):
    """All-gather along the sequence; the backward reduce-scatters the gradient (each rank's queries add to
    every key's gradient) back to the rank holding each key."""

    @staticmethod
    def forward(ctx, local, ranks: int, group_name: str):
        ctx.ranks, ctx.group_name = ranks, group_name
        rows = local.movedim(SEQUENCE_DIM, 0)
        return compat.all_gather_rows(rows, ranks, group_name).movedim(0, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        rows = grad.movedim(SEQUENCE_DIM, 0)
        return compat.reduce_scatter_rows(rows, ctx.ranks, ctx.group_name).movedim(0, SEQUENCE_DIM), None, None


class _Exchange(torch.autograd.Function):
    """Chunks of the sequence moved between ranks: ``sent[d]`` chunks to rank ``d`` (in order), ``received[s]``
    from rank ``s``; the backward moves the gradients back."""

    @staticmethod
    def forward(ctx, local, sent: tuple[int, ...], received: tuple[int, ...], group_name: str):
        ctx.sent, ctx.received, ctx.group_name = sent, received, group_name
        return _exchange(local, sent, received, group_name)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.received, ctx.sent, ctx.group_name), None, None, None


def _exchange(local: torch.Tensor, sent, received, group_name: str) -> torch.Tensor:
    chunk = local.shape[SEQUENCE_DIM] // sum(sent)
    rows = local.movedim(SEQUENCE_DIM, 0)
    out = compat.all_to_all_rows(rows, [n * chunk for n in received], [n * chunk for n in sent], group_name)
    return out.movedim(0, SEQUENCE_DIM)


def _gathered_placements(operand: DTensor, dims: list[int]) -> tuple:
    return tuple(Replicate() if i in dims else p for i, p in enumerate(operand.placements))


def _local_shape(tensor: DTensor, placements) -> torch.Size:
    """(Context parallelism splits evenly: the policy checks the sizes.)"""
    shape = list(tensor.shape)
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            shape[p.dim] //= tensor.device_mesh.size(i)
    return torch.Size(shape)


def _local_bytes(tensor: DTensor, placements) -> int:
    return math.prod(_local_shape(tensor, placements)) * tensor.dtype.itemsize


def _empty_like(tensor: DTensor, shape: torch.Size) -> torch.Tensor:
    return torch.empty_strided(shape, _stride_like(tensor, shape), dtype=tensor.dtype, device=tensor.device)


def _laid_out_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` with its dimensions in memory in the order of ``like``'s (the attention kernels lay their
    output out as the query)."""
    order = sorted(range(like.dim()), key=lambda d: (-like.stride(d), -d))
    inverse = sorted(range(like.dim()), key=order.__getitem__)
    return value.permute(order).contiguous().permute(inverse)


def _mask_rows_shape(mask: torch.Tensor, rows: int) -> torch.Size:
    shape = list(mask.shape)
    shape[-2] = rows if shape[-2] != 1 else 1
    return torch.Size(shape)


def _stride_like(local: torch.Tensor, shape: torch.Size) -> tuple[int, ...]:
    """The strides of a tensor of ``shape`` laid out in the order of ``local``'s dimensions."""
    order = sorted(range(local.dim()), key=lambda d: (local.stride(d), d))
    stride, step = [0] * local.dim(), 1
    for d in order:
        stride[d] = step
        step *= shape[d]
    return tuple(stride)


def _global_shape(local: torch.Tensor, query: DTensor) -> torch.Size:
    shape = list(local.shape)
    shape[SEQUENCE_DIM] = query.shape[SEQUENCE_DIM]
    for i, p in enumerate(query.placements):
        if type(p) is Shard and p.dim != SEQUENCE_DIM and p.dim < len(shape):
            shape[p.dim] *= query.device_mesh.size(i)
    return torch.Size(shape)

"""The decompositions the passes trace with: each op DTensor cannot shard lowered to ATen ops it can."""

from __future__ import annotations

import torch

from .. import compat
from . import cpu_attention

_DECOMPOSITIONS: dict | None = None


def sharding_decompositions(masked_attention_whole: bool = False) -> dict:
    """ATen decompositions for the ops DTensor cannot shard (e.g. CPU flash attention with a mask), so that
    tracing lowers them to ops it can; ops DTensor shards directly are kept whole. ``masked_attention_whole``:
    attention with a mask too (context parallelism runs it whole, :mod:`.context_parallel_attention`)."""
    table = _decompositions()
    if masked_attention_whole:
        return {op: fn for op, fn in table.items() if op is not cpu_attention.FORWARD}
    return table


def _decompositions() -> dict:
    global _DECOMPOSITIONS
    if _DECOMPOSITIONS is None:
        decompositions = {op: fn for op, fn in compat.core_aten_decompositions().items()
                          if isinstance(op, compat.OpOverload) and not compat.has_sharding_strategy(op, direct_only=True)}
        # native_batch_norm updates its running statistics in place without saying so in its schema;
        # decomposed, the update becomes a visible (functionalized) copy into the buffer
        batch_norm = torch.ops.aten.native_batch_norm.default
        if compat.decomposition(batch_norm) is not None:
            decompositions[batch_norm] = compat.decomposition(batch_norm)
        attention = cpu_attention.FORWARD
        if compat.decomposition(attention) is not None:
            decompositions[attention] = cpu_attention.decomposed_only_with_a_mask(compat.decomposition(attention))
        _DECOMPOSITIONS = decompositions
    return _DECOMPOSITIONS


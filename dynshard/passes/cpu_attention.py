"""CPU flash attention kept whole under DTensor.

``F.scaled_dot_product_attention`` on CPU runs ``aten._scaled_dot_product_flash_attention_for_cpu``, for
which DTensor has no strategy (it has the CUDA kernels'). Decomposed, it becomes the math attention with the
causal mask built as a tensor, and its output is laid out as the CUDA kernel's, so every rank of a unit paid
for the masked kernel (which cannot skip the masked half of the scores as ``is_causal`` does, once Inductor
fuses the pattern back) and for three copies of the output per layer that a single process never makes.

So the op (and its backward) is kept whole and DTensor is given the strategies of its CUDA sibling
(``compat.register_sharding``, an experimental torch API): everything whole,
heads split (tensor parallelism), or batch split (data parallelism inside a unit); the scores of one head
and one sequence never span ranks. With an explicit ``attn_mask`` (whose broadcast dimensions would need a
placement of their own) it is still decomposed (:func:`decomposed_only_with_a_mask`). torch's
FLOP counter has no formula for the op either, so the SDPA formulas are registered for it and its backward
(``torch.utils.flop_counter.register_flop_formula``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from .. import compat

_aten = torch.ops.aten
FORWARD = _aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_REGISTERED: list[bool] = []


def register_cpu_attention() -> None:
    """DTensor's strategies and the FLOP formulas of the CPU flash attention ops (once per process)."""
    if _REGISTERED:
        return
    from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

    compat.register_sharding(FORWARD, _strategies)
    compat.register_sharding(BACKWARD, _backward_strategies)

    @register_flop_formula(FORWARD.overloadpacket)
    def forward_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    @register_flop_formula(BACKWARD.overloadpacket)
    def backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    _REGISTERED.append(True)


def _strategies(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """(output, logsumexp) and (query, key, value) placements: whole, heads split, batch split."""
    return [([p] * 2, [p] * 3) for p in (Replicate(), Shard(1), Shard(0))]


def _backward_strategies(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                         scale=None):
    """(grad_query, grad_key, grad_value) and (grad_out, query, key, value, out, logsumexp) placements."""
    return [([p] * 3, [p] * 6) for p in (Replicate(), Shard(1), Shard(0))]


def decomposed_only_with_a_mask(decomposition):
    """The op's decomposition, applied only when it is given an ``attn_mask`` (else the op stays whole); its
    output made contiguous, as the CPU kernel returns it (the decomposition lays it out as the CUDA kernel
    does, and user code that ``view``s after a transpose relies on the kernel's strides)."""
    def run(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        if attn_mask is None:
            return NotImplemented
        output, *rest = decomposition(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        return (output.contiguous(), *rest)
    return run


register_cpu_attention()    # (at import: FLOP counts must not depend on whether a compile ran first)

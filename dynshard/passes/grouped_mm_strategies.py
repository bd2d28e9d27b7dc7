"""DTensor sharding strategies for transformers' opaque grouped matmul of mixture-of-experts layers.

transformers 5 runs ``experts_implementation="grouped_mm"`` through ``torch.ops.transformers.
grouped_mm_fallback(input [S, K], weight [E, K, N], offs [E]) -> [S, N]`` when ``torch._grouped_mm``
cannot be compiled (weights other than bf16 under torch.compile): rows ``offs[e-1]:offs[e]`` of ``input``
times ``weight[e]``; its backward is the custom op ``grouped_mm_fallback_backward(input, weight, offs,
grad_output) -> (grad_input, grad_weight)``. DTensor knows neither, so without these strategies the
experts would run replicated. The strategies are the expert-tensor-parallel ones (per expert, a matmul
split along N or along the contracted K; the rows, grouped by expert through ``offs``, are never split):

- input whole, weight split along N  -> output split along its columns (a column-parallel expert);
- input split along K, weight split along K -> output a partial sum (a row-parallel expert);
- everything whole -> whole.

DTensor's own ``aten._grouped_mm`` (bf16) already has these. Registration goes through
``compat.register_sharding`` (an experimental torch API), once per process, and only once transformers
has registered the ops.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from .. import compat

_REGISTERED: set = set()


def register_grouped_mm_strategies() -> bool:
    """Register the strategies of transformers' grouped matmul ops, if they exist (idempotent)."""
    try:
        forward = torch.ops.transformers.grouped_mm_fallback.default
        backward = torch.ops.transformers.grouped_mm_fallback_backward.default
    except (AttributeError, RuntimeError):
        return False
    if forward in _REGISTERED:
        return True
    compat.register_sharding(forward, grouped_mm_strategies)
    compat.register_sharding(backward, grouped_mm_backward_strategies)
    _REGISTERED.update({forward, backward})
    return True


def grouped_mm_strategies(input, weight, offs):
    """(output placements, input placements) pairs for ``grouped_mm_fallback(input, weight, offs)``."""
    whole = Replicate()
    return [
        ([whole], [whole, whole, whole]),
        ([Shard(1)], [whole, Shard(2), whole]),            # column-parallel experts
        ([Partial()], [Shard(1), Shard(1), whole]),        # row-parallel experts
    ]


def grouped_mm_backward_strategies(input, weight, offs, grad_output):
    """For ``grouped_mm_fallback_backward(input, weight, offs, grad_output) -> (grad_input,
    grad_weight)``: the gradients of the forward's three strategies."""
    whole = Replicate()
    return [
        ([whole, whole], [whole, whole, whole, whole]),
        ([Partial(), Shard(2)], [whole, Shard(2), whole, Shard(1)]),     # column-parallel experts
        ([Shard(1), Shard(1)], [Shard(1), Shard(1), whole, whole]),      # row-parallel experts
    ]

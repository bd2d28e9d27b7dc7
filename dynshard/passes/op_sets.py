"""ATen op families the passes and policies recognise in a graph."""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

# matmul -> index of its first matrix operand (addmm's first argument is the bias)
MATMUL_OPERANDS = {aten.mm.default: 0, aten.bmm.default: 0, aten.addmm.default: 1}

# ops that only re-view (or copy) one tensor: a value keeps its identity through them
VIEW_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
            aten.expand.default}

# dtype casts (mixed precision casts parameters to the compute dtype before their first use)
CASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}

# ops that give a tensor another shape over the same elements
RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}

TRANSPOSE_OPS = {aten.t.default, aten.transpose.int, aten.permute.default}

# matmuls over a batch dimension (attention's [B*H, T, D] after its heads are folded into the batch)
BATCHED_MATMULS = {aten.bmm.default}

# ops of one tensor that act on each element alone, or only re-view it, keeping its shape: slicing
# their input gives the slice of their output (an expand to the same shape, a scale, a cast, a copy)
SLICE_COMMUTING = {aten.clone.default, aten.expand.default, aten.alias.default, aten.mul.Scalar,
                   aten.div.Scalar, *CASTS}


def view_root(node):
    """The value ``node`` is a view (or copy) of."""
    while isinstance(node, fx.Node) and node.target in VIEW_OPS:
        node = node.args[0]
    return node


def as_view(target, value, shape):
    """``aten.reshape`` of a value it can view, as ``aten.view``: what tracing decomposes it into. DTensor's
    rule for ``reshape`` itself gathers a split dimension flattened behind another (a sequence split of
    ``(B, T, C)`` viewed as ``(B * T, C)``, which ``view`` keeps as a ``_StridedShard``), and some tracers
    (``invoke_subgraph``'s schema) hand DTensor the undecomposed op."""
    if target is not aten.reshape.default or not isinstance(value, torch.Tensor):
        return target
    try:        # (on the global shape and strides; a DTensor's own view would dispatch to DTensor)
        torch.empty_strided(value.shape, value.stride(), device="meta").view(shape)
    except (RuntimeError, ValueError, TypeError):     # (TypeError: a symbolic size not bound here)
        return target
    return aten.view.default

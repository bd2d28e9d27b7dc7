"""Attention written out as matmuls (transformers' ``eager`` attention) becomes the one attention op.

``attn_implementation="eager"`` (transformers' ``eager_attention_forward``, the Llama family's and most
others') computes attention as its formula::

    weights = softmax(q @ k.transpose(2, 3) * scale + mask, dim=-1, dtype=float32).to(q.dtype)
    out = dropout(weights, p) @ v

The graph then holds the ``(B, H, T, T)`` scores and weights, and keeps them for the backward: per layer,
``T / head_dim`` times the queries' bytes. No policy could split it along the sequence either (context
parallelism needs attention as one op to gather the keys and values), and DTensor's placements of the
matmuls over a split sequence failed to plan. Where nothing but the formula reads its intermediate values
(the weights are not returned: ``output_attentions`` off) and its dropout draws nothing (``p`` 0, or not
training: the fused op would draw other numbers), the chain becomes
``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)``: the same formula (softmax in fp32
as the fused kernels accumulate), computed by the kernel every other attention uses; the later passes then
treat it as any attention (a causal mask made from sizes runs as ``is_causal``, repeated key/value heads fold
into ``enable_gqa``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .context import PassContext
from .torch_attention import ATTENTION, erase_unread, traced_size

_MATMULS = (torch.matmul, operator.matmul)
_SOFTMAX = (F.softmax, torch.softmax)


def fold_eager_attention(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        found = _eager_attention(node)
        if found is None:
            continue
        query, key, value, mask, scale = found
        with graph.inserting_before(node):
            attention = graph.call_function(ATTENTION, (query, key, value),
                                            {"attn_mask": mask, "dropout_p": 0.0, "is_causal": False, "scale": scale})
        attention.meta.update(node.meta)
        node.replace_all_uses_with(attention)
        erase_unread(graph, node)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm


def _eager_attention(out: fx.Node):
    """``(q, k, v, mask, scale)`` where ``out`` is ``dropout(softmax(q @ k^T * scale + mask)) @ v`` of 4-D values,
    its intermediate values read by nothing else (else None)."""
    if not _calls(out, _MATMULS) or len(out.args) != 2:
        return None
    weights, value = _only_read(out.args[0]), out.args[1]
    if _calls(weights, (F.dropout,)):
        p, training = _dropout_arguments(weights)
        if p != 0.0 and training:
            return None
        weights = _only_read(weights.args[0])
    if isinstance(weights, fx.Node) and weights.op == "call_method" and weights.target == "to":
        weights = _only_read(weights.args[0])
    if not _calls(weights, _SOFTMAX) or not _softmax_over_last(weights):
        return None
    scores = _only_read(weights.args[0])
    mask = None
    if _calls(scores, (operator.add,)) and isinstance(scores.args[1], fx.Node):
        scores, mask = _only_read(scores.args[0]), scores.args[1]
    if not _calls(scores, (operator.mul,)) or not isinstance(scores.args[1], float):
        return None
    product, scale = _only_read(scores.args[0]), scores.args[1]
    if not _calls(product, _MATMULS) or len(product.args) != 2:
        return None
    query, transposed = product.args
    if not (isinstance(transposed, fx.Node) and transposed.op == "call_method" and transposed.target == "transpose"
            and tuple(transposed.args[1:]) in ((2, 3), (-2, -1), (-1, -2), (3, 2)) and len(transposed.users) == 1):
        return None
    key = transposed.args[0]
    if any(traced_size(t, 3) is None or traced_size(t, 4) is not None for t in (query, key, value)):
        return None             # (4-D values only: batch, heads, sequence, head dim)
    return query, key, value, mask, scale


def _calls(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _only_read(node):
    """``node`` if the formula is its one reader (else None, which matches nothing)."""
    return node if isinstance(node, fx.Node) and len(node.users) == 1 else None


def _dropout_arguments(node: fx.Node) -> tuple[float, bool]:
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    if not isinstance(p, (int, float)) or not isinstance(training, bool):
        return 1.0, True        # (read at run time: taken as drawing)
    return float(p), training


def _softmax_over_last(node: fx.Node) -> bool:
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    dtype = node.kwargs.get("dtype", node.args[3] if len(node.args) > 3 else None)
    return dim in (-1, 3) and dtype in (None, torch.float32)

"""Grouped-query attention on its own key/value heads: ``repeat_kv`` before attention folded into ``enable_gqa``.

transformers' sdpa attention repeats the key and value heads to the query heads (``repeat_kv``: an
``expand`` and a ``reshape``, which copies) whenever it passes a mask, as it does while traced with
``use_cache=False`` (:mod:`.causal_masks` may then find the mask causal and drop it, after the repeat was
traced). Attention then keeps the repeated copies for the backward (``Hq / Hkv`` times the keys and values),
and context parallelism gathers them (the same factor on the wire, where Llama 3 gathers the grouped heads).

Where attention has no mask, and its keys and values are both ``repeat_kv`` of the same factor to the
queries' heads, it takes the grouped heads with ``enable_gqa=True``, which computes the same thing: query
head ``h`` against key/value head ``h // (Hq / Hkv)``, what ``repeat_kv``'s adjacent copies give it. The
fused kernels take grouped heads as they are (the CPU flash op, CUDA's flash and efficient kernels).

Tensor parallelism splits attention by heads: folded, the key/value heads must divide over the unit's ranks
as the queries' do. A layout whose unit does not divide them keeps the repeat (the queries split, the
repeated keys and values with them), except under context parallelism, which splits no heads.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from .context import PassContext
from .lower_to_aten import splits_sequence
from .torch_attention import argument, erase_unread, is_attention, set_argument, traced_size

_NEW_AXIS = (slice(None), slice(None), None, slice(None), slice(None))     # x[:, :, None, :, :]


def fold_repeated_kv(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    heads_split_over = 1 if splits_sequence(ctx.config) else ctx.layout.tp_size
    changed = False
    for node in list(gm.graph.nodes):
        if not is_attention(node) or argument(node, "attn_mask") is not None or argument(node, "enable_gqa"):
            continue
        query, key, value = (argument(node, name) for name in ("query", "key", "value"))
        sources = [_repeated_from(operand) for operand in (key, value)]
        if None in sources or sources[0][1] != sources[1][1]:
            continue
        (key_source, _), (value_source, _) = sources
        kv_heads, query_heads = traced_size(key_source, 1), traced_size(query, 1)
        if kv_heads is None or query_heads is None or kv_heads == query_heads or kv_heads % heads_split_over:
            continue
        set_argument(node, "key", key_source)
        set_argument(node, "value", value_source)
        set_argument(node, "enable_gqa", True)
        for repeated in (key, value):
            erase_unread(gm.graph, repeated)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _repeated_from(node) -> tuple[fx.Node, int] | None:
    """``(x, n)`` where ``node`` is transformers' ``repeat_kv(x, n)``:
    ``x[:, :, None, :, :].expand(b, h, n, t, d).reshape(b, h * n, t, d)``."""
    if not _is_method(node, "reshape"):
        return None
    expand = node.args[0]
    if not _is_method(expand, "expand") or len(expand.args) != 6:
        return None
    indexed = expand.args[0]
    if not (isinstance(indexed, fx.Node) and indexed.op == "call_function" and indexed.target is operator.getitem
            and tuple(indexed.args[1]) == _NEW_AXIS and isinstance(indexed.args[0], fx.Node)):
        return None
    if any(len(n.users) != 1 for n in (indexed, expand)):
        return None
    return indexed.args[0], expand.args[3]


def _is_method(node, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == name

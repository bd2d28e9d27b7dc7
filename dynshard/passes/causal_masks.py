"""Attention masks that are the causal mask, recognized: ``attn_mask=M`` becomes ``is_causal=True``.

transformers builds its attention mask as a tensor whenever it cannot prove, while traced, that it may skip
it (Llama and its kin with ``use_cache=False``: the mask also separates packed documents, found from the
position ids, which under Dynamo are a traced ``arange``). The graph then carries a ``(B, 1, T, T)``
boolean mask made from ``arange``s and comparisons, and attention takes it as ``attn_mask``. That costs
every policy: the mask is built each step, a fused kernel must read it instead of skipping the masked half
of the scores, attention's backward keeps it, tensor parallelism decomposes the masked op into the math
attention (whose ``T x T`` scores it saves per head), and context parallelism sends and keeps its rows.

When the mask's value depends on nothing but sizes (no parameter, buffer or user input among the nodes it is
computed from), it is the same on every step, so this pass computes it once, here, and compares it with
the causal mask: where it equals it (allowed exactly at and below the diagonal of a square ``(T, T)``, for
every batch row and head it broadcasts to; a boolean mask, or a float one of ``0`` and ``-inf`` or the
dtype's lowest value, which softmax turns into exact zeros), the op takes ``is_causal=True`` and no mask.
The mask's nodes are then dead and go. The math is the same (the masked scores' weights were exactly zero);
only the kernel that computes it changes.

A mask computed from symbolic sizes is recognized only when the program is built for one size (the sizes are
then values); a mask read from an input (a padding ``attention_mask`` from the collator) is left as it is.
Masks too large to compute at plan time (``_MAX_ELEMENTS``) are left, and logged.
"""

from __future__ import annotations

import logging
import math
import re

import torch
import torch.fx as fx

from .context import PassContext
from .torch_attention import argument, erase_unread, is_attention, set_argument, traced_size

log = logging.getLogger("dynshard")

_MAX_ELEMENTS = 1 << 31                               # a mask larger than this is not computed at plan time
_RANDOM = re.compile(r"rand|dropout|bernoulli|normal|uniform|multinomial|exponential|poisson", re.IGNORECASE)


def recognize_causal_masks(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    sizes = _size_values(gm, ctx)
    verdicts: dict[fx.Node, bool] = {}      # mask node -> whether it is the causal mask (one mask serves every layer)
    changed = False
    for node in list(gm.graph.nodes):
        if not is_attention(node):
            continue
        mask = argument(node, "attn_mask")
        if not isinstance(mask, fx.Node) or argument(node, "is_causal"):
            continue
        if mask not in verdicts:
            verdicts[mask] = _is_causal_mask(gm, mask, sizes, traced_size(argument(node, "query"), 2),
                                             traced_size(argument(node, "key"), 2))
        if verdicts[mask]:
            set_argument(node, "attn_mask", None)
            set_argument(node, "is_causal", True)
            changed = True
    if changed:
        for mask, causal in verdicts.items():
            if causal:
                erase_unread(gm.graph, mask)
        gm.graph.lint()
        gm.recompile()
        log.info("dynshard: %d attention mask(s) recognized as causal: attention runs with is_causal=True",
                 sum(verdicts.values()))
    return gm


def _size_values(gm: fx.GraphModule, ctx: PassContext) -> dict[fx.Node, int]:
    """The placeholders that are sizes, with the size this program is for (none when it serves every size)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if ctx.on_symbols or len(placeholders) != len(ctx.inputs):
        return {}
    return {node: int(inp.value) for node, inp in zip(placeholders, ctx.inputs) if inp.kind == "size"}


def _is_causal_mask(gm: fx.GraphModule, mask: fx.Node, sizes: dict[fx.Node, int], queries, keys) -> bool:
    nodes = _ancestors(mask)
    readers_ok = all(n in sizes for n in nodes if n.op == "placeholder")
    random = any(_RANDOM.search(str(getattr(n.target, "__name__", n.target))) for n in nodes if n.op != "placeholder")
    example = mask.meta.get("example_value")
    queries, keys = _concrete(queries, sizes), _concrete(keys, sizes)
    if not readers_ok or random or queries is None or queries != keys or not isinstance(example, torch.Tensor):
        return False
    shape = [_concrete(s, sizes) for s in example.shape]
    if None in shape or math.prod(shape) > _MAX_ELEMENTS:
        log.info("dynshard: attention mask %s of shape %s is too large to recognize at plan time; it is kept",
                 mask.name, tuple(example.shape))
        return False
    value = _evaluate(gm, nodes, mask, sizes)
    return isinstance(value, torch.Tensor) and _equals_causal(value, queries)


def _ancestors(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node it is computed from, in graph order."""
    seen, stack = {node}, [node]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                stack.append(arg)
    return [n for n in node.graph.nodes if n in seen]


def _evaluate(gm: fx.GraphModule, nodes: list[fx.Node], mask: fx.Node, sizes: dict[fx.Node, int]):
    """The mask's value: its nodes run on real tensors (sizes bound to this program's; a meta device, as
    offline planning traces, computed on the CPU instead)."""
    interpreter = fx.Interpreter(gm)
    with torch.no_grad():
        for node in nodes:
            if node.op == "placeholder":
                interpreter.env[node] = sizes[node]
                continue
            node_args, node_kwargs = interpreter.fetch_args_kwargs_from_env(node)
            node_args, node_kwargs = _off_meta(node_args), _off_meta(node_kwargs)
            try:
                interpreter.env[node] = getattr(interpreter, node.op)(node.target, node_args, node_kwargs)
            except Exception as error:      # a mask this cannot compute is left as it is
                log.debug("dynshard: attention mask %s not computed at plan time (%s: %s)", mask.name,
                          type(error).__name__, error)
                return None
    return interpreter.env[mask]


def _off_meta(value):
    if isinstance(value, torch.device) and value.type == "meta" or value == "meta":
        return torch.device("cpu")
    if isinstance(value, (list, tuple)):
        return type(value)(_off_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _off_meta(v) for k, v in value.items()}
    return value


def _equals_causal(mask: torch.Tensor, length: int) -> bool:
    if mask.dim() < 2 or mask.shape[-2:] != (length, length):
        return False
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == allowed).all())
    if not mask.dtype.is_floating_point:
        return False
    masked = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
    return bool(((mask == 0) == allowed).all() and (masked == ~allowed).all())


def _concrete(size, sizes: dict[fx.Node, int]) -> int | None:
    """A size of the traced graph as a number: a symbolic one from the values of the size inputs (None when
    it reads a symbol that no size input binds)."""
    if size is None or not isinstance(size, torch.SymInt):
        return None if size is None else int(size)
    values = {}
    for node, value in sizes.items():
        example = node.meta.get("example_value")
        if isinstance(example, torch.SymInt):
            values[example.node.expr] = value
    expr = size.node.expr
    if not expr.free_symbols <= set(values):
        return None
    return int(expr.xreplace(values))



"""``F.scaled_dot_product_attention`` in a Dynamo graph (torch-level ops): its arguments by name, and the
nodes an edit of them leaves unread."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

ATTENTION = F.scaled_dot_product_attention           # (is torch._C._nn.scaled_dot_product_attention)
# its signature: (query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
_POSITIONS = {"query": 0, "key": 1, "value": 2, "attn_mask": 3, "dropout_p": 4, "is_causal": 5, "scale": 6,
              "enable_gqa": 7}


def is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is ATTENTION


def argument(node: fx.Node, name: str):
    if name in node.kwargs:
        return node.kwargs[name]
    position = _POSITIONS[name]
    return node.args[position] if len(node.args) > position else None


def set_argument(node: fx.Node, name: str, value) -> None:
    position = _POSITIONS[name]
    if len(node.args) > position:
        node.update_arg(position, value)
    else:
        node.update_kwarg(name, value)


def traced_size(node, dim: int):
    """Dimension ``dim`` of a traced value's size (None where unknown)."""
    example = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return example.shape[dim] if isinstance(example, torch.Tensor) and example.dim() > dim else None


def erase_unread(graph: fx.Graph, node: fx.Node) -> None:
    """``node`` and the nodes computing it that nothing else reads any more (placeholders stay)."""
    stack, erased = [node], set()
    while stack:
        current = stack.pop()
        if current in erased or current.op == "placeholder" or current.users:
            continue
        inputs = current.all_input_nodes
        graph.erase_node(current)
        erased.add(current)
        stack.extend(inputs)

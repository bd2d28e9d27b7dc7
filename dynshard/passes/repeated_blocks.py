"""The repetitions of a block in a graph, aligned op by op.

A block is the outermost module in a node's ``nn_module_stack`` whose path ends in ``.<int>`` (an entry of a
``ModuleList`` or ``Sequential``: ``blocks.3``). Two blocks are alike when their signatures are equal: the same
op sequence (each op's target, its non-tensor arguments, and where each tensor argument comes from: one of the
block's own ops by position, or the block's i-th input), reading inputs of the same shapes, strides, dtypes
and ``requires_grad`` (and, where given, the same planned placements). Alike blocks line up: op ``i`` of one is
op ``i`` of the other, and its inputs are the other's, in order.

Used by regional compilation (:mod:`.outline_repeated_blocks`: alike blocks share one compiled subgraph) and by
sharding propagation (:mod:`.layer_memo`: a later block computes what an earlier one computed).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx

from .. import compat

BLOCK_PATH = re.compile(r"^(.*)\.(\d+)$")


def value_of(node: Any) -> Any:
    return node.meta.get("val", node.meta.get("example_value")) if isinstance(node, fx.Node) else node


def _block_of(node: fx.Node) -> tuple[str, str] | None:
    for path, cls in (node.meta.get("nn_module_stack") or {}).values():     # outermost first
        if BLOCK_PATH.match(path):
            return path, getattr(cls, "__qualname__", str(cls))
    return None


def _signature(value: Any, node: fx.Node | None = None) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("tensor", compat.sizes_key(value.shape), compat.sizes_key(value.stride()), value.dtype,
                value.device.type, value.requires_grad)
    if value is None and node is not None and node.op == "call_function" and len(node.all_input_nodes) == 1:
        # dynshard's parameter wrapper carries no value: what it wraps, and how
        (arg,) = node.all_input_nodes
        return ("via", _target_key(node), _signature(value_of(arg), arg))
    return ("other", type(value).__name__, value if isinstance(value, (int, float, bool, str)) else None)


def _is_inserted(node: fx.Node) -> bool:
    """A function a dynshard pass inserted (a closure over how it places or communicates)."""
    return node.op == "call_function" and getattr(node.target, "__module__", "").startswith("dynshard")


def _target_key(node: fx.Node) -> str:
    """What a node calls, the same for every block: an inserted closure by its name and what it closes
    over (placements, shapes, gradient reductions), never by its address."""
    target = node.target
    if not _is_inserted(node):
        return str(target)
    cells = []
    for cell in getattr(target, "__closure__", None) or ():
        text = repr(cell.cell_contents)
        cells.append(type(cell.cell_contents).__name__ if " at 0x" in text else text)
    return f"{target.__module__}.{target.__name__}{tuple(cells)}"


class Block:
    """One repetition: its nodes in graph order, what they read from outside, what is read outside."""

    def __init__(self, path: str, cls: str, nodes: list[fx.Node], placements: dict[str, Any]):
        self.path, self.cls, self.nodes = path, cls, nodes
        position = {n: i for i, n in enumerate(nodes)}
        self.inputs: list[fx.Node] = []
        input_index: dict[fx.Node, int] = {}
        ops = []
        for node in nodes:
            refs = []
            for arg in node.all_input_nodes:
                if arg in position:
                    refs.append(("local", position[arg]))
                else:
                    if arg not in input_index:
                        input_index[arg] = len(self.inputs)
                        self.inputs.append(arg)
                    refs.append(("input", input_index[arg]))
            structure = fx.node.map_arg((node.args, node.kwargs), lambda _: "%")
            ops.append((node.op, _target_key(node), repr(structure), tuple(refs), repr(placements.get(node.name))))
        self.signature = (tuple(ops), tuple((_signature(value_of(i), i), repr(placements.get(i.name)))
                                            for i in self.inputs))
        self.used_outside = {position[n] for n in nodes if any(user not in position for user in n.users)}
        self.outlinable = _is_convex(nodes)


def _is_convex(nodes: list[fx.Node]) -> bool:
    """No node of the block reads a value computed outside it from one of its own values."""
    members = set(nodes)
    escaped: set[fx.Node] = set()      # outside nodes that depend on the block
    node = nodes[0]
    while node is not None and node.op != "output":
        if node in members:
            if any(arg in escaped for arg in node.all_input_nodes):
                return False
        elif any(arg in members or arg in escaped for arg in node.all_input_nodes):
            escaped.add(node)
        if node is nodes[-1]:
            return True
        node = node.next
    return True


def find_blocks(graph: fx.Graph, placements: dict[str, Any] | None = None) -> list[Block]:
    """A node a dynshard pass inserted has no module stack. It belongs to the block of the value it
    reads when it sits before that block's last op (a redistribution inside the block); else, when it
    reads a block's value, to the block that reads it, if one block does (a redistribution between
    blocks: the value then crosses the call in the placement its producer gave it, and so does its
    gradient). A parameter's or buffer's wrapper, and what dynshard computes from it alone, belongs to
    the block that alone reads it; else it stays at the top of the program."""
    ops = [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    owner = {n: _block_of(n) for n in ops}
    last = {block[0]: i for i, n in enumerate(ops) if (block := owner[n]) is not None}
    for i, node in enumerate(ops):
        if owner[node] is None and _is_inserted(node):
            reads = [owner[arg] for arg in node.all_input_nodes if owner.get(arg) is not None]
            if reads and last[reads[0][0]] > i:
                owner[node] = reads[0]
    state = set()       # a parameter's or buffer's wrapper, and what dynshard computes from it alone
    for node in ops:
        if owner[node] is None and _is_inserted(node) and (node.meta.get("wraps") in ("parameter", "buffer") or (
                node.all_input_nodes and all(arg in state for arg in node.all_input_nodes))):
            state.add(node)
    for node in reversed(ops):      # (readers first, so that a chain joins the block its last node does)
        if node in state or (owner[node] is None and _is_inserted(node) and
                             any(owner.get(arg) for arg in node.all_input_nodes)):
            readers = {owner.get(user) for user in node.users}
            if len(readers) == 1 and None not in readers:
                owner[node] = readers.pop()
    nodes: dict[str, list[fx.Node]] = defaultdict(list)
    classes: dict[str, str] = {}
    for node in ops:
        if owner[node] is not None:
            nodes[owner[node][0]].append(node)
            classes[owner[node][0]] = owner[node][1]
    return [Block(path, classes[path], members, placements or {}) for path, members in nodes.items()]

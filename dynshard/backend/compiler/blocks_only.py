"""``Config.compile_scope="blocks"``: Inductor compiles the outlined blocks of a graph, and the graph around
their calls runs as its traced ATen ops (torch's regional-compilation recipe: compile only what repeats)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from ... import compat
from ...compat import aot_autograd, inductor


def compile_blocks_only(graph: fx.GraphModule, phase: str, compile_fx_inner: Callable):
    """Each outlined block's partitioned graph (its forward, or its backward) compiled by Inductor once,
    called where ``invoke_subgraph`` called it; the rest of ``graph`` runs as its traced ATen ops, as
    aot_eager runs a graph."""
    compiled: dict[str, str] = {}
    for node in list(graph.graph.nodes):
        if node.target is not compat.invoke_subgraph:
            continue
        name, operands = node.args[0].target, node.args[2:]
        if name not in compiled:
            examples = [a.meta["val"] if isinstance(a, fx.Node) else a for a in operands]
            # the traced program reads them with the strides it was traced with (Inductor marks
            # a forward block's outputs so itself, a backward block's not)
            inductor.outputs_keep_traced_strides(getattr(graph, name))
            # (a compile reports its outputs' strides to the tracing context, where aot_autograd reads
            # the program's: a block's go to a list of their own; the program's outputs keep their traced ones)
            with inductor.own_output_strides():
                block = compile_fx_inner(getattr(graph, name), examples, is_backward=phase == "backward",
                                         is_inference=phase == "inference")
            compiled[name] = f"{name}_compiled"
            graph.add_submodule(compiled[name], _CompiledBlock(block))
        with graph.graph.inserting_before(node):
            call = graph.graph.call_module(compiled[name], tuple(operands))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        subgraph = node.args[0]
        graph.graph.erase_node(node)
        if not subgraph.users:          # the uncompiled subgraph, called no more
            graph.graph.erase_node(subgraph)
            graph.delete_submodule(subgraph.target)
    return aot_autograd.boxed_nop(graph, [])   # (boxed: frees each saved tensor after its last use, as aot_eager)


class _CompiledBlock(torch.nn.Module):
    """An Inductor-compiled graph (boxed: it takes a list) as a module the traced program calls."""

    def __init__(self, compiled: Callable):
        super().__init__()
        self.compiled = compiled

    def forward(self, *args):
        return self.compiled(list(args))

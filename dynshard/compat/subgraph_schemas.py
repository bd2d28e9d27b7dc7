"""``invoke_subgraph``'s schema (``torch._higher_order_ops.invoke_subgraph``'s ``gen_schema``) worked out once per
block and operand signature while dynshard compiles."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .ops import invoke_subgraph
from .symbolic import sizes_key


@contextlib.contextmanager
def block_schemas_memoized() -> Iterator[None]:
    """``invoke_subgraph``'s schema worked out once per block and operand signature. torch 2.13 works it
    out (``gen_schema``: the block traced again, to find input mutations) at every call that needs
    gradients, in aot_autograd's metadata pass and again in its joint trace: on a tp program, where the
    trace goes through DTensor, that was half of aot_autograd's time. A block's schema depends on its
    graph and its operands' types only, so each repeat of the block gets the first call's."""
    if "gen_schema" in vars(invoke_subgraph):      # a compile inside a compile: the outer one's cache
        yield
        return
    from torch._higher_order_ops.invoke_subgraph import FunctionalizeCtxWrapper

    generate = invoke_subgraph.gen_schema
    schemas: dict[tuple, tuple] = {}

    def gen_schema(subgraph, identifier, *operands):
        graph = subgraph.subgraph if isinstance(subgraph, FunctionalizeCtxWrapper) else subgraph
        key = (type(subgraph), id(graph), identifier, *map(_operand_signature, operands))
        if key not in schemas:      # (the graph is kept with its schema: its id stays its own)
            schemas[key] = (graph, generate(subgraph, identifier, *operands))
        return schemas[key][1]

    invoke_subgraph.gen_schema = gen_schema
    try:
        yield
    finally:       # (a second thread's compile may have replaced it, and removed it first: no error)
        vars(invoke_subgraph).pop("gen_schema", None)


def _operand_signature(operand: Any) -> tuple:
    if isinstance(operand, torch.Tensor):
        return (type(operand), operand.dtype, operand.device, sizes_key(operand.shape), sizes_key(operand.stride()),
                operand.requires_grad)
    return (type(operand), repr(operand) if isinstance(operand, (int, torch.SymInt)) else None)

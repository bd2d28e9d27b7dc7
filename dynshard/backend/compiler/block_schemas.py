"""``invoke_subgraph``'s schema worked out once per block and operand signature while dynshard compiles."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ... import compat
from ...compat.subgraph_schemas import gen_schema_replaced, subgraph_graph


@contextlib.contextmanager
def block_schemas_memoized() -> Iterator[None]:
    """``invoke_subgraph``'s schema worked out once per block and operand signature. torch 2.13 works it
    out (``gen_schema``: the block traced again, to find input mutations) at every call that needs
    gradients, in aot_autograd's metadata pass and again in its joint trace: on a tp program, where the
    trace goes through DTensor, that was half of aot_autograd's time. A block's schema depends on its
    graph and its operands' types only, so each repeat of the block gets the first call's."""
    with gen_schema_replaced(_memoized):
        yield


def _memoized(generate):
    schemas: dict[tuple, tuple] = {}

    def gen_schema(subgraph, identifier, *operands):
        graph = subgraph_graph(subgraph)
        key = (type(subgraph), id(graph), identifier, *map(_operand_signature, operands))
        if key not in schemas:      # (the graph is kept with its schema: its id stays its own)
            schemas[key] = (graph, generate(subgraph, identifier, *operands))
        return schemas[key][1]
    return gen_schema


def _operand_signature(operand: Any) -> tuple:
    if isinstance(operand, torch.Tensor):
        return (type(operand), operand.dtype, operand.device, compat.sizes_key(operand.shape),
                compat.sizes_key(operand.stride()), operand.requires_grad)
    return (type(operand), repr(operand) if isinstance(operand, (int, torch.SymInt)) else None)

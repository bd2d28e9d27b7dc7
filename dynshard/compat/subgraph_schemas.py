"""``invoke_subgraph``'s schema (``torch._higher_order_ops.invoke_subgraph``'s ``gen_schema``: the block traced
again, to find input mutations), replaced while dynshard compiles (:mod:`dynshard.backend.compiler.block_schemas`
memoizes it)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from .ops import invoke_subgraph


@contextlib.contextmanager
def gen_schema_replaced(replace: Callable[[Callable], Callable]) -> Iterator[None]:
    """Within, ``invoke_subgraph.gen_schema(subgraph, identifier, *operands)`` is ``replace(torch's)``, set on
    the op; a compile inside a compile keeps the outer one's."""
    if "gen_schema" in vars(invoke_subgraph):
        yield
        return
    invoke_subgraph.gen_schema = replace(invoke_subgraph.gen_schema)
    try:
        yield
    finally:       # (a second thread's compile may have replaced it, and removed it first: no error)
        vars(invoke_subgraph).pop("gen_schema", None)


def subgraph_graph(subgraph):
    """The block's graph module behind ``invoke_subgraph``'s subgraph argument (``FunctionalizeCtxWrapper``
    unwrapped)."""
    from torch._higher_order_ops.invoke_subgraph import FunctionalizeCtxWrapper

    return subgraph.subgraph if isinstance(subgraph, FunctionalizeCtxWrapper) else subgraph

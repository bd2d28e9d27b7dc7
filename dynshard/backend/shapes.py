"""Graphs Dynamo traced with symbolic sizes (``dynamic=True``, ``mark_dynamic``): which programs dynshard
compiles on them, and the error for the rest.

A symbolic graph is planned once, at the sizes it was traced at (its hints), and compiled once on Dynamo's
symbols: one program serves every size its guards admit, with no planning and no compile. Its plan key and
the ranks' agreement count a symbolic dimension by its symbol, so ranks of different data-parallel units
may hold different sizes (each pads its own rows), as DDP allows; only what the collectives carry (the
parameters' gradients and shards) must agree.

Units of one rank (dp, ZeRO 1-3) compile symbolic graphs: their programs split no dimension of a user
input, and the Dynamo graph reaches aot_autograd as it is. A unit of several ranks (tp, sequence parallel,
``data``), a pipeline or a graph lowered for recompute tags traces ATen on FakeTensors of static sizes, so
these plan static shapes and refuse a symbolic graph with :class:`SymbolicShapesError`.
"""

from __future__ import annotations

from typing import Sequence

from ..runtime.graph_inputs import GraphInput
from ..runtime.mesh import Layout


class SymbolicShapesError(TypeError):
    """A symbolic graph under a plan that compiles static shapes only."""


def check_symbolic_shapes(inputs: Sequence[GraphInput], layout: Layout, pipelined: bool, recompute: bool) -> None:
    symbolic = sorted((inp for inp in inputs if inp.is_symbolic), key=lambda inp: inp.kind == "size")
    if not symbolic:
        return
    reason = ("its pipeline splits the batch into micro-batches" if pipelined
              else f"its unit of {layout.plan_ngpus} ranks splits tensors inside one batch" if layout.plan_ngpus > 1
              else "recompute_modules lowers the graph to ATen at static sizes" if recompute else None)
    if reason is None:
        return
    # every unit must then hold the same shape at each step: with one unit a few lengths will do
    units = layout.world_size // layout.plan_ngpus
    fix = ("pad every row to one length (padding='max_length'): the job's units must hold the same shapes at "
           "every step" if units > 1 else "feed a few lengths (a collator's pad_to_multiple_of=64, or "
           "padding='max_length'): each length compiles once")
    first = symbolic[0]       # a tensor's dimensions say more than a size's symbol
    if first.kind == "size":
        what = f"input {first.name} is a symbolic size ({first.symbols[0]})"
    else:
        dims = ", ".join(f"dim {d} ({s})" for d, s in enumerate(first.symbols) if s is not None)
        what = f"input {first.name} has symbolic sizes ({dims} of {list(first.family_shape())})"
    raise SymbolicShapesError(
        f"dynshard: {what}, and this plan "
        f"compiles static shapes only: {reason}. Symbolic sizes are compiled under dp and ZeRO 1-3 (plan_ngpus=1, "
        f"no pipeline, no recompute_modules). Here, compile without dynamic=True / mark_dynamic and {fix}")

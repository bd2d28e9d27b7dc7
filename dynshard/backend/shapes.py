"""Graphs Dynamo traced with symbolic sizes (``dynamic=True``, ``mark_dynamic``): which programs dynshard
compiles on them, and the error for the rest.

A symbolic graph is planned once, at the sizes it was traced at (its hints), and Dynamo keeps one graph for
every size its guards admit. Its plan key and the ranks' agreement count a symbolic dimension by its symbol,
so ranks of different data-parallel units may hold different sizes (each pads its own rows), as DDP allows;
only what the collectives carry (the parameters' gradients and shards) must agree.

- **Units of one rank** (dp, ZeRO 1-3) compile one program on Dynamo's symbols: their programs split no
  dimension of a user input, and the Dynamo graph reaches aot_autograd as it is.
- **Units of several ranks** (tp, sequence parallel, ``data``) compile a static program per size the unit
  meets, from the one plan (:func:`at_sizes`): no planning, no agreement, nothing communicated, only the
  passes and the compile at those sizes (``CompiledPlan.build_sized``). Why not one program on the
  symbols: the placement passes lower the graph to ATen on FakeTensors and ask DTensor's cached propagation
  for every op; both run on concrete sizes, and the per-rank program localises reshape sizes as numbers. A
  program per size costs a compile per length, so pad to a few lengths (``pad_to_multiple_of``); Dynamo
  still traces once, so its recompile limit is never reached. Where the plan splits a dimension the size
  does not divide (sequence parallel's sequence, ``data``'s batch), ``propagate_sharding`` raises before
  the program is compiled, naming the value, the dimension, the size and the fix.
- **Pipelines and recompute tags** (``recompute_modules``) refuse a symbolic graph with
  :class:`SymbolicShapesError`: a pipeline splits the batch into micro-batches of a size it plans, and the
  recompute tags are placed on an ATen graph of static sizes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from ..config.errors import SymbolicShapesError
from ..runtime.graph_inputs import GraphInput
from ..runtime.mesh import Layout

__all__ = ["SymbolicShapesError", "at_sizes", "check_symbolic_shapes"]


def check_symbolic_shapes(inputs: Sequence[GraphInput], layout: Layout, pipelined: bool, recompute: bool) -> None:
    symbolic = sorted((inp for inp in inputs if inp.is_symbolic), key=lambda inp: inp.kind == "size")
    if not symbolic:
        return
    split_values = [inp.name for inp in symbolic if inp.is_split_value]
    reason = ("its pipeline splits the batch into micro-batches" if pipelined
              else "recompute_modules lowers the graph to ATen at static sizes" if recompute
              else f"its unit of {layout.plan_ngpus} ranks receives {split_values[0]} split (a DTensor)"
              if split_values and layout.plan_ngpus > 1 else None)
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
        f"compiles static shapes only: {reason}. Symbolic sizes are compiled without a pipeline and without "
        f"recompute_modules. Here, compile without dynamic=True / mark_dynamic and {fix}")


def at_sizes(inputs: Sequence[GraphInput], args: Sequence[Any]) -> list[GraphInput]:
    """``inputs`` at the sizes of a call's ``args``: a symbolic tensor input takes the call's shape and
    strides, a size input its value; the symbols stay (the plan's shape family)."""
    sized = []
    for inp in inputs:
        if inp.is_symbolic and inp.kind == "size":
            inp = dataclasses.replace(inp, value=int(args[inp.index]))
        elif inp.is_symbolic:
            value = args[inp.index]
            inp = dataclasses.replace(inp, shape=torch.Size(value.shape), stride=tuple(value.stride()))
        sized.append(inp)
    return sized

"""Graphs Dynamo traced with symbolic sizes (``dynamic=True``, ``mark_dynamic``): which programs dynshard
compiles on them, and the error for the rest.

A symbolic graph is planned once, at the sizes it was traced at (its hints), and Dynamo keeps one graph for
every size its guards admit. Its plan key and the ranks' agreement count a symbolic dimension by its symbol,
so ranks of different data-parallel units may hold different sizes (each pads its own rows), as DDP allows;
only what the collectives carry (the parameters' gradients and shards) must agree.

- **Units of one rank** (dp, ZeRO 1-3) compile one program on Dynamo's symbols: their programs split no
  dimension of a user input, and the Dynamo graph reaches aot_autograd as it is.
- **Units of several ranks** (tp, sequence parallel, ``data``, styles) compile one program on Dynamo's symbols
  too (``plan_and_compile.on_symbols``): the plan is made at the hints (the policy, the agreement and the cost
  model see concrete sizes), then the passes run again with it given, on the frame's fake mode and symbols,
  and the program compiles on Dynamo's examples. What that takes: the lowering functionalizes in Python and
  runs composite ops by their Python kernels (C++ kernels read a size as a number: a guard that makes the
  program static), DTensor's propagation is asked uncached where a spec holds a symbol, collective bytes are
  read at the hints, a symbolic input's global shape is read from the local tensor, and torch's proxy tracer
  is mended while inside (``compat.dtensor_symbolic_tracing``). DTensor guards what its placements need (an
  even split of a symbolic dimension: an odd size compiles another graph, planned at it), and takes a
  ``_StridedShard`` whose split factor is a symbol (a symbolic batch flattened with split heads,
  ``compat.strided_shards``). Where an op cannot be placed on symbols, or would run whole there where the plan
  splits it, every rank learns it and compiles a static program per size the unit meets,
  from the one plan (:func:`at_sizes`, ``CompiledPlan.build_sized``), logged; there, where the plan splits a
  dimension the size does not divide, ``propagate_sharding`` raises before the program is compiled, naming
  the value, the dimension, the size and the fix. ``recompute_modules`` alone (no unit of several ranks)
  compiles per size as well: its tags are placed on an ATen graph of static sizes.
- **Pipelines** (pp, hybrid) cut the one symbolic graph once, at its hints, and compile each rank's stages
  per micro-batch shape, as they always have: a call's batch is split along dim 0, and the size inputs that
  are the batch's symbol are divided with it, so the stage graphs run on micro-batches with no re-trace.
  :func:`check_micro_batch_split` refuses a batch symbol Dynamo also gave another dimension.
- **Automatic dynamic shapes** (a size that changed once compiles symbolic) stay on, as torch.compile has them,
  wherever the ranks that compile a frame again at the same step are the ranks that must agree on it: a unit
  compiles its own programs of an agreed family alone (:mod:`.families`), a rank (dp, ZeRO) or a unit of tp
  ranks (they read one batch, so they compile together), dp x tp too. They are turned off at the first
  compile (:func:`limit_automatic_dynamic`) under a pipeline (a stage graph that holds
  its batch size is traced again per micro-batch, which must stay at the traced plan's inputs), and under a
  unit of several ranks whose outputs stay split (``gather_outputs=False``: the graph that receives a split
  value compiles static shapes only, below).
  ``dynamic=True`` or ``mark_dynamic`` gives those jobs their symbolic graph at the first compile.
- **A split value** (a DTensor another program returned) with symbolic sizes, under a unit of several ranks,
  is refused with :class:`SymbolicShapesError` (:func:`check_symbolic_shapes`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Sequence

import torch

from .. import compat
from ..config import Config
from ..config.errors import SymbolicShapesError
from ..passes.lower_to_aten import lowers
from ..runtime.graph_inputs import GraphInput, batch_size_inputs
from ..runtime.mesh import Layout

log = logging.getLogger("dynshard")

__all__ = ["SymbolicShapesError", "at_sizes", "check_micro_batch_split", "check_symbolic_shapes", "compiles_per_size"]


def compiles_per_size(inputs: Sequence[GraphInput], layout: Layout, outline) -> bool:
    """Whether a graph's program may be compiled at each size its unit meets, from its one plan (a symbolic
    graph whose passes lower it to ATen: a unit of several ranks, or recompute), rather than once: under a unit
    of several ranks only where its program on symbols fails (``CompiledProgram.symbolic``)."""
    return any(inp.is_symbolic for inp in inputs) and lowers(layout, outline)


def check_symbolic_shapes(inputs: Sequence[GraphInput], layout: Layout) -> None:
    symbolic = sorted((inp for inp in inputs if inp.is_symbolic), key=lambda inp: inp.kind == "size")
    split_values = [inp.name for inp in symbolic if inp.is_split_value]
    if not split_values or layout.plan_ngpus == 1:
        return
    reason = f"its unit of {layout.plan_ngpus} ranks receives {split_values[0]} split (a DTensor)"
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
        f"compiles static shapes only: {reason}. Here, compile without dynamic=True / mark_dynamic and {fix}")


def check_micro_batch_split(inputs: Sequence[GraphInput], nmicros: int) -> None:
    """A pipeline gives its stages the batch's symbol divided by ``nmicros``: refused where Dynamo gave that
    symbol to another dimension too (duck shaping: dimensions of equal size at the first call share one)."""
    if nmicros == 1:
        return
    batch = {inputs[i].symbols[0] for i in batch_size_inputs(inputs)}
    firsts = {inp.symbols[0]: inp for inp in inputs if inp.kind == "input" and inp.symbols and inp.symbols[0]}
    for inp in inputs:
        for dim, symbol in enumerate(inp.symbols or ()):
            if symbol is None or (dim == 0 and inp.kind == "input") or inp.kind == "size":
                continue
            shared = next((s for s in batch if re.search(rf"\b{s}\b", symbol)), None)
            if shared is not None:
                first = firsts[shared]
                raise SymbolicShapesError(
                    f"dynshard: Dynamo traced the batch of input {first.name} ({shared}, {first.shape[0]} rows) "
                    f"with the same symbol as dim {dim} of {inp.name} ({symbol}): at the first call they were the "
                    f"same size, and Dynamo gives equal sizes one symbol. The pipeline splits the batch into "
                    f"{nmicros} micro-batches and not that dimension, so the graph cannot run on them. Make the "
                    f"first batch's rows differ from its other sizes, or mark the dimensions dynamic one by one "
                    f"(torch._dynamo.mark_dynamic) with torch.fx.experimental._config.use_duck_shape = False")


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


def limit_automatic_dynamic(layout: Layout, config: Config) -> None:
    """Automatic dynamic shapes off for a pipeline, or split outputs under a unit of several ranks (see the
    module's notes)."""
    if not compat.automatic_dynamic_shapes():
        return
    if layout.pp_size > 1:
        why = f"a pipeline of {layout.pp_size} stages traces a graph again per micro-batch, at its plan's inputs"
    elif layout.plan_ngpus > 1 and not config.gather_outputs:
        why = "a graph that receives a split output (gather_outputs=False) compiles static shapes only"
    else:
        return
    log.info("dynshard: automatic dynamic shapes are off: %s; a frame compiles again at each new size (compile "
             "with dynamic=True or mark_dynamic for one symbolic graph)", why)
    compat.keep_shapes_static()

"""Compile the per-rank program (aot_autograd + Inductor or aot_eager) and read back what it runs."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import torch
import torch.fx as fx

from .. import compat
from ..runtime.mesh import Layout


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective in a compiled per-rank graph."""

    phase: str        # "forward", "backward" or "inference"
    kind: str         # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast
    group: str        # mesh dimension ("dp", "tp") or process group name
    bytes: int
    shape: tuple[int, ...]


def collectives_in(graph: fx.GraphModule, phase: str, layout: Layout) -> list[CollectiveRecord]:
    records = []
    for node in graph.graph.nodes:
        kind = compat.COLLECTIVE_KINDS.get(node.target)
        if kind is None:
            continue
        tensors = [v for v in (node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None,
                               node.meta.get("val")) if isinstance(v, torch.Tensor)]
        largest = max(tensors, key=lambda t: t.numel()) if tensors else None
        group_name = node.args[-1] if isinstance(node.args[-1], str) else str(node.kwargs.get("group_name"))
        records.append(CollectiveRecord(
            phase=phase, kind=kind, group=layout.group_dim(group_name),
            bytes=largest.numel() * largest.element_size() if largest is not None else 0,
            shape=tuple(largest.shape) if largest is not None else ()))
    return records


@dataclasses.dataclass
class CompiledProgram:
    run: Any
    collectives: list[CollectiveRecord]
    graphs: dict[str, str]        # phase -> code of the graph handed to the compiler
    seconds: float


def compile_program(gm: fx.GraphModule, local_inputs: Sequence[torch.Tensor], compiler: str, layout: Layout,
                    inference_only: bool = False, freeze: bool = False) -> CompiledProgram:
    program = CompiledProgram(run=None, collectives=[], graphs={}, seconds=0.0)

    def on_graph(graph: fx.GraphModule, phase: str) -> None:
        program.graphs[phase] = graph.code
        program.collectives = [c for c in program.collectives if c.phase != phase]
        program.collectives.extend(collectives_in(graph, phase, layout))

    start = time.perf_counter()
    if inference_only:
        with torch.no_grad():
            program.run = compat.compile_per_rank(gm, local_inputs, compiler, on_graph, freeze=freeze)
    else:
        program.run = compat.compile_per_rank(gm, local_inputs, compiler, on_graph)
    program.seconds = time.perf_counter() - start
    return program

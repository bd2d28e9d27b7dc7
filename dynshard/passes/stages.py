"""A pipeline's graph cut into stages (:mod:`.cut_stages` makes it): each stage's graph, what it reads and
hands on, and how the cut was chosen."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx as fx


@dataclasses.dataclass
class Stage:
    index: int
    module: fx.GraphModule
    graph_inputs: tuple[int, ...]    # placeholder indices of the captured graph it reads (its first inputs)
    received: tuple[str, ...]        # values of earlier stages it reads (its next inputs)
    produced: tuple[str, ...]        # values it returns, in order
    modules: tuple[str, ...] = ()    # the model's top modules (or layers) whose ops it runs, in order


@dataclasses.dataclass
class StageCut:
    """Where a pipeline's graph is cut: the positions among its compute nodes where stages 1.. start, how they
    were chosen, each stage's forward FLOPs; then (once checked against the graph) the node keys the stages
    start at and, per graph input, the stages that read it."""

    cuts: list[int]
    how: str
    flops: list[int]
    starts: list[str] = dataclasses.field(default_factory=list)
    input_stages: list[list[int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StagedGraph:
    stages: list[Stage]
    boundaries: list[tuple[str, ...]]   # boundaries[s]: values stage s hands to stage s + 1
    outputs: list[Any]                  # the graph's outputs: value names (str) or constants
    flops: list[int]                    # forward FLOPs per stage (as measured for the cut)
    how: str                            # how the cuts were chosen ("pipe_split", "pivots ...", ...)

    def describe(self) -> str:
        lines = [f"{len(self.stages)} stages, cut {self.how}"]
        for stage in self.stages:
            ops = sum(1 for n in stage.module.graph.nodes if n.op not in ("placeholder", "output"))
            lines.append(f"  stage {stage.index}: {ops} ops, {self.flops[stage.index]} forward FLOPs, "
                         f"{len(stage.graph_inputs)} graph inputs, sends {len(self.boundaries[stage.index]) if stage.index < len(self.boundaries) else 0}")
        return "\n".join(lines)

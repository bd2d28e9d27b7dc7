"""What runs every step: the compiled per-rank program, called with this rank's local tensors."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.tensor import Placement

from ..backend.capture import GraphInput
from ..backend.compile import CompiledProgram
from .mesh import Layout
from .sharding import shard_in_place


@dataclasses.dataclass(eq=False)
class CompiledPlan:
    """A plan and its compiled program; shared by every Dynamo graph with the same key."""

    key: str
    inputs: list[GraphInput]
    placements: dict[int, tuple[Placement, ...]]
    layout: Layout
    program: CompiledProgram
    propagation: Any
    pass_timings: list[tuple[str, float]]
    inference_only: bool
    hits: int = 0


class ShardedProgram:
    """The callable handed back to Dynamo for one captured graph.

    On its first call it turns the parameters and buffers it uses into this rank's shards, in place
    (the same tensor objects), and tags them; from then on arguments arrive already local.
    """

    def __init__(self, plan: CompiledPlan):
        self.plan = plan
        self._prepared = False

    def __call__(self, *args: Any):
        if not self._prepared:
            self._prepare(args)
        if self.plan.inference_only:
            with torch.no_grad():
                return self.plan.program.run(*args)
        return self.plan.program.run(*args)

    def _prepare(self, args) -> None:
        for inp in self.plan.inputs:
            if inp.is_state:
                tag = shard_in_place(args[inp.index], inp.name, self.plan.layout, self.plan.placements[inp.index])
                tag.add_plan(self.plan)
        self._prepared = True

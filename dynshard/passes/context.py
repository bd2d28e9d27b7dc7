"""What the passes share: the configuration, the world layout, the captured inputs and the plan so far."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.tensor import Placement

from ..backend.capture import GraphInput
from ..config import Config
from ..runtime.mesh import Layout
from ..runtime.sharding import placements_for
from ..runtime.zero import ZeroSpec


@dataclasses.dataclass(frozen=True)
class ActivationPlacement:
    """Where a policy wants an activation: its placements, for the nodes that read it (``readers``, by
    name; None: every reader)."""

    placements: tuple[Placement, ...]
    readers: tuple[str, ...] | None = None


@dataclasses.dataclass
class PassContext:
    config: Config
    layout: Layout
    inputs: list[GraphInput]
    fake_mode: Any
    placements: dict[int, tuple[Placement, ...]] = dataclasses.field(default_factory=dict)
    over_dp: set[int] = dataclasses.field(default_factory=set)   # from a stored plan: inputs ZeRO splits
    zero: dict[int, ZeroSpec] = dataclasses.field(default_factory=dict)   # inputs whose rows ZeRO splits
    sync_grads: bool = True          # False: the no-sync variant (whole replicas in, local gradients out)
    propagation: Any = None          # passes.propagate_sharding.Propagation
    blocked: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)  # input -> (blocks, dim)
    # activations the policy placed: node name -> placements its value is redistributed to where produced
    constraints: dict[str, ActivationPlacement] = dataclasses.field(default_factory=dict)
    split_outputs: dict[int, tuple] = dataclasses.field(default_factory=dict)  # output -> DTensor spec
    timings: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    stage_info: dict[str, Any] = dataclasses.field(default_factory=dict)   # pipeline: how stages were cut
    staged: Any = None               # pipeline: passes.cut_stages.StagedGraph
    outlined: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # blocks compiled once: (class, calls)

    def arrival(self, inp: GraphInput) -> tuple[Placement, ...]:
        """How a graph input arrives at the program on this rank.

        Parameters and buffers arrive as their planned shards (they are sharded in place before the
        first run). User inputs follow the data convention: every rank of a plan unit holds the same
        batch, whole.
        """
        if inp.is_state:
            return inp.tag.placements if inp.tag is not None else self.placements[inp.index]
        return placements_for(self.layout, {})

    def zero_of(self, inp: GraphInput) -> ZeroSpec | None:
        """The ZeRO storage the input arrives in (None: whole; the no-sync variant gets replicas)."""
        return self.zero.get(inp.index) if self.sync_grads else None

"""What the passes share: the configuration, the plan's outline, the world layout, the captured inputs and the
plan so far."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import Placement

from ..compat import FakeMode
from ..config import Config
from ..planning import Plan
from ..planning.outline import mixed_precision_of
from ..planning.plan import MadeFor
from ..runtime.graph_inputs import GraphInput, mesh_identity
from ..runtime.mesh import Layout
from ..runtime.sharding import placements_for
from ..runtime.zero import ZeroSpec
from .op_memo import OpMemo
from .propagation import Propagation
from .stages import StageCut, StagedGraph


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
    fake_mode: FakeMode              # compat.new_fake_mode's, or the frame's Dynamo traced in
    outline: Plan                    # what the program is built from: the given plan, or the config's outline
    placements: dict[int, tuple[Placement, ...]] = dataclasses.field(default_factory=dict)
    over_dp: set[int] = dataclasses.field(default_factory=set)   # from a given plan: inputs ZeRO splits
    zero: dict[int, ZeroSpec] = dataclasses.field(default_factory=dict)   # inputs whose rows ZeRO splits
    stage_program: bool = False      # a pipeline stage's: its outputs are what the next stage reads
    sync_grads: bool = True          # False: the no-sync variant (whole replicas in, local gradients out)
    propagation: Propagation | None = None   # every node's placement, what the plan communicates
    blocked: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)  # input -> (blocks, dim)
    # activations the policy placed: node name -> placements its value is redistributed to where produced
    constraints: dict[str, ActivationPlacement] = dataclasses.field(default_factory=dict)
    # output -> its DTensor spec: placements, global shape and stride
    split_outputs: dict[int, tuple[tuple[Placement, ...], torch.Size, tuple[int, ...]]] = dataclasses.field(
        default_factory=dict)
    timings: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    stage_info: StageCut | None = None       # pipeline: how stages were cut
    staged: StagedGraph | None = None        # pipeline: the graph cut into stages
    outlined: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # blocks compiled once: (class, calls)
    made_for: MadeFor | None = None  # the graph, world and modes the plan is for
    given: Plan | None = None        # a Plan to execute instead of running the policy (loaded, received, stored)
    # places the inputs when no plan is given (policies.place: the policies come after the passes)
    policy: Callable[[fx.GraphModule, PassContext], None] | None = None
    recompute: tuple[str, ...] | None = None   # modules the policy recomputes (None: the outline's)
    plan: Plan | None = None         # the Plan of this program, once placements are assigned
    node_keys: dict[str, str] = dataclasses.field(default_factory=dict)  # node name -> planning.node_keys key
    draws_random: bool = False       # the lowered graph has a random op (dropout): ranks holding it must draw alike
    op_memo: OpMemo | None = None    # DTensor's answers, shared by this mode's propagations

    @property
    def on_symbols(self) -> bool:
        """Whether the passes run on Dynamo's symbolic sizes (one program for every size of the family), not
        on the sizes of one call (see ``backend.symbolic_program``)."""
        return any(isinstance(inp.value, torch.SymInt) or any(isinstance(s, torch.SymInt) for s in inp.shape)
                   for inp in self.inputs if inp.is_symbolic)

    def fake_inputs(self) -> list:
        """The graph's inputs as FakeTensors of their global shapes in ``fake_mode`` (symbolic sizes as the
        values this program is for), on their devices, or on meta under ``trace_strategy="meta"``."""
        meta = self.config.trace_strategy != "fake"
        with self.fake_mode:
            return [inp.value if inp.kind == "size" else torch.empty_strided(
                inp.shape, inp.stride, dtype=inp.dtype, device=torch.device("meta") if meta else inp.device
            ).requires_grad_(inp.requires_grad) for inp in self.inputs]

    @property
    def mixed_precision(self):
        """The outline's mixed precision as torch's ``MixedPrecisionPolicy`` (None: none)."""
        return mixed_precision_of(self.outline)

    def arrival(self, inp: GraphInput) -> tuple[Placement, ...]:
        """How a graph input arrives at the program on this rank.

        Parameters and buffers arrive as their planned shards (they are sharded in place before the
        first run). User inputs follow the data convention: every rank of a plan unit holds the same
        batch, whole. A DTensor input (a split value returned by another program) arrives as this rank's
        piece of it, with its own placements.
        """
        if inp.is_split_value:
            check_split_value(inp, self.layout)
            return inp.placements
        if inp.is_state:
            return inp.tag.placements if inp.tag is not None else self.placements[inp.index]
        return placements_for(self.layout, {})

    def zero_of(self, inp: GraphInput) -> ZeroSpec | None:
        """The ZeRO storage the input arrives in (None: whole; the no-sync variant gets replicas)."""
        return self.zero.get(inp.index) if self.sync_grads else None


def check_split_value(inp: GraphInput, layout: Layout) -> None:
    """A DTensor input must live on the plan unit's mesh (a split output of another dynshard program of the
    same plan unit): its placements are then this program's."""
    mesh = layout.tp_mesh
    if mesh is None or inp.mesh != mesh_identity(mesh) or len(inp.placements) != len(layout.placement_dims):
        where = "ranks that form no plan unit of several ranks" if mesh is None else \
            f"the plan unit's mesh {mesh_identity(mesh)}"
        raise ValueError(
            f"dynshard: graph input {inp.name} is a DTensor on the mesh {inp.mesh} with placements "
            f"{inp.placements}, but this program runs on {where}; dynshard takes DTensors only as the split "
            "outputs of its own programs (Config(gather_outputs=False)): pass .full_tensor() instead")

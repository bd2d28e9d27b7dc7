"""The API a policy uses to place a graph's parameters and inputs inside a plan unit.

A policy is ``policy(plan: PlanBuilder, config: Config) -> None``. It reads the ATen graph
(``plan.graph``), the parameters and buffers (``plan.state``) and user inputs (``plan.user_inputs``), and
chooses, for the "tp" mesh dimension (the ranks of one plan unit), whether each is split along a
dimension (``plan.shard(name, dim)``) or whole on every rank (``plan.replicate(name)``, the default),
where activations are redistributed (``plan.place_activation``) and which modules are recomputed
(``plan.recompute``). ``plan.propagate()`` tells what the current choice costs. What it decides becomes the
program's :class:`dynshard.Plan`. The world's factorisation (``plan_ngpus``, pipeline stages), the ZeRO level
and mixed precision are the plan's outline (``ctx.outline``: the Config's, or a given plan's) before a policy
runs; a planner (``dynshard.planner``) decides those.

Across units (mesh dimension "dp") each unit sees its own batch and gradients are averaged. With
``Config.use_zero`` every trainable parameter's rows are split over its zero group by default; a policy
may keep a parameter whole across units with ``plan.replicate_over_dp(name)`` (or split one with
``plan.shard_over_dp(name)``), e.g. a small one whose padding would cost more than it saves.

The user's pins (``Config.partition_constraints``) are placed before the policy runs and are fixed for it
(``plan.is_fixed``); a policy's choice for a pinned tensor does not replace the pin.
"""

from __future__ import annotations

import logging

import torch.fx as fx
from torch.distributed.tensor import Placement, Replicate, Shard

from ..runtime.graph_inputs import GraphInput
from ..compat import StridedShard
from ..config import Config
from ..config.pins import pin_of, split_dim
from ..passes.assign_placements import zero_specs
from ..passes.context import ActivationPlacement, PassContext
from ..passes.lower_to_aten import lowers
from ..passes.propagate_sharding import propagate
from ..passes.propagation import Propagation
from ..runtime.sharding import check_divisible, placements_for
from ..runtime.zero import ZeroSpec


log = logging.getLogger("dynshard")


class PlanError(ValueError):
    """A policy asked for something the graph or the world cannot do."""


class PlanBuilder:
    def __init__(self, gm: fx.GraphModule, ctx: PassContext):
        self.graph_module = gm
        self.ctx = ctx
        self._tp: dict[int, Placement] = {}
        for inp in ctx.inputs:
            if inp.tag is not None and inp.tag.placements:
                self._tp[inp.index] = inp.tag.placements[0]
            elif inp.is_split_value and ctx.layout.placement_dims:   # a DTensor from another program
                self._tp[inp.index] = ctx.arrival(inp)[0]
        self._over_dp = {inp.index for inp in ctx.inputs if self._zero_by_default(inp)}
        self._placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._pinned: set[int] = set()
        self._pin(ctx.config.partition_constraints)

    # -- what the policy reads ------------------------------------------------------------------------
    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    @property
    def config(self) -> Config:
        return self.ctx.config

    @property
    def tp_size(self) -> int:
        return self.ctx.layout.tp_size

    @property
    def state(self) -> dict[str, GraphInput]:
        """Parameters and buffers by fully qualified name."""
        return {inp.name: inp for inp in self.ctx.inputs if inp.is_state}

    @property
    def user_inputs(self) -> list[GraphInput]:
        return [inp for inp in self.ctx.inputs if not inp.is_state]

    def node_of(self, name: str) -> fx.Node:
        return self._placeholders[self._input(name).index]

    def input_of(self, node: fx.Node) -> GraphInput | None:
        if node.op != "placeholder":
            return None
        return self.ctx.inputs[self._placeholders.index(node)]

    def is_fixed(self, name: str) -> bool:
        """True when the tensor already holds its shard from an earlier program, is a DTensor that an
        earlier program returned split (a value crossing a graph break), or is pinned by the user: its
        placement stays."""
        inp = self._input(name)
        return inp.tag is not None or inp.is_split_value or inp.index in self._pinned

    def placement(self, name: str) -> Placement:
        return self._tp.get(self._input(name).index, Replicate())

    def divides(self, name: str, dim: int) -> bool:
        shape = self._input(name).shape
        return -len(shape) <= dim < len(shape) and shape[dim] % self.tp_size == 0

    # -- what the policy decides ----------------------------------------------------------------------
    def shard(self, name: str, dim: int) -> None:
        """Split ``name`` along ``dim``. A fused parameter (split into blocks by the graph, e.g. q|k|v)
        is split block by block, so that each rank holds its rows of every block."""
        inp = self._input(name)
        self._set(inp, self._split(inp, dim))

    def replicate(self, name: str) -> None:
        self._set(self._input(name), Replicate())

    def place_activation(self, node: fx.Node | str, placement: Placement | None,
                         readers: list[fx.Node] | None = None) -> None:
        """Redistribute the value of ``node`` to ``placement`` on the "tp" dimension where it is produced
        (a partial sum reduce-scattered, a shard gathered), for ``readers`` only (default: every node
        that reads it; the others keep the value as it is). None drops an earlier choice. Parameters and
        inputs are placed with :meth:`shard` / :meth:`replicate`."""
        name = node.name if isinstance(node, fx.Node) else node
        if not any(n.name == name for n in self.graph.nodes):
            raise PlanError(f"dynshard: the graph has no node named {name!r}")
        if placement is None:
            self.ctx.constraints.pop(name, None)
        elif self.ctx.layout.placement_dims:
            self.ctx.constraints[name] = ActivationPlacement(
                placements_for(self.ctx.layout, {"tp": placement}),
                None if readers is None else tuple(r.name for r in readers))

    def shard_over_dp(self, name: str) -> None:
        """Split ``name``'s rows over its zero group (needs ``use_zero``): ZeRO storage."""
        inp = self._input(name)
        if not self.ctx.outline.zero.level:
            raise PlanError(f"dynshard: shard_over_dp({name!r}) needs Config(use_zero=1, 2 or 3)")
        self._set_over_dp(inp, True)

    def replicate_over_dp(self, name: str) -> None:
        """Keep ``name`` whole on every data-parallel unit (its gradient is all-reduced)."""
        self._set_over_dp(self._input(name), False)

    def recompute(self, *modules: str) -> None:
        """Recompute the activations of these modules (class names or module paths, as ``recompute_modules``)
        in the backward instead of keeping them; replaces the config's choice for this graph."""
        if not lowers(self.ctx.layout, self.ctx.outline):
            raise PlanError("dynshard: a policy chooses recompute on the ATen graph, which a plan unit of one rank "
                            "does not lower; set Config(recompute_modules=...) for units of one rank")
        self.ctx.recompute = tuple(m.strip() for m in modules if m.strip())

    def propagate(self, reuse: Propagation | None = None) -> Propagation:
        """Placements and communication of the current choice (``reuse``: an earlier result, whose
        unaffected prefix is not recomputed)."""
        return propagate(self.graph_module, self.ctx, [self.placements(inp) for inp in self.ctx.inputs],
                         reuse=reuse)

    # -- results --------------------------------------------------------------------------------------
    def placements(self, inp: GraphInput) -> tuple[Placement, ...]:
        return placements_for(self.ctx.layout, {"tp": self._tp.get(inp.index, Replicate())})

    def finish(self) -> dict[int, tuple[Placement, ...]]:
        result = {}
        for inp in self.ctx.inputs:
            placements = self.placements(inp)
            check_divisible(inp.name, inp.shape, self.ctx.layout, placements)
            result[inp.index] = placements
        return result

    def finish_zero(self, placements: dict[int, tuple[Placement, ...]]) -> dict[int, ZeroSpec]:
        return zero_specs(self.ctx, placements, self._over_dp)

    # -- internals ------------------------------------------------------------------------------------
    def _split(self, inp: GraphInput, dim: int) -> Placement:
        dim = dim % max(len(inp.shape), 1)
        blocks, block_dim = self.ctx.blocked.get(inp.index, (1, None))
        return StridedShard(dim, split_factor=blocks) if blocks > 1 and dim == block_dim else Shard(dim)

    def _pin(self, pins) -> None:
        """Place the pinned tensors, and note the patterns that pin nothing in this graph."""
        if not pins or not self.ctx.layout.placement_dims:
            return
        used = set()
        for inp in self.ctx.inputs:
            found = pin_of(inp.name, pins) if inp.is_state else None
            if found is None:
                continue
            pattern, code = found
            used.add(pattern)
            dim = split_dim(code)
            if dim is not None and not (-len(inp.shape) <= dim < len(inp.shape) and self.divides(inp.name, dim)):
                raise PlanError(f"dynshard: partition constraint {pattern!r} pins {inp.name} {list(inp.shape)} to "
                                f"S{dim}, but dim {dim} does not split evenly over {self.tp_size} tp ranks; pin "
                                "'replicate' or another dim")
            self._set(inp, Replicate() if dim is None else self._split(inp, dim))
            self._pinned.add(inp.index)
        for pattern in pins:
            if pattern not in used:
                log.warning("dynshard: partition constraint %r pins no parameter or buffer of this graph", pattern)

    def _input(self, name: str | int) -> GraphInput:
        for inp in self.ctx.inputs:
            if inp.name == name or inp.index == name:
                return inp
        known = ", ".join(inp.name for inp in self.ctx.inputs)
        raise PlanError(f"dynshard: the graph has no parameter, buffer or input named {name!r}; it has {known}")

    def _zero_by_default(self, inp: GraphInput) -> bool:
        """A tensor already stored keeps its storage; otherwise ZeRO splits every trainable parameter."""
        if inp.tag is not None:
            return inp.tag.zero is not None
        return bool(self.ctx.outline.zero.level) and inp.kind == "parameter" and inp.requires_grad

    def _set_over_dp(self, inp: GraphInput, split: bool) -> None:
        if inp.tag is not None and (inp.tag.zero is not None) != split:
            raise PlanError(f"dynshard: {inp.name} is already stored by an earlier compiled program; a "
                            "parameter keeps one placement in every graph")
        (self._over_dp.add if split else self._over_dp.discard)(inp.index)

    def _set(self, inp: GraphInput, placement: Placement) -> None:
        if not self.ctx.layout.placement_dims or inp.index in self._pinned:    # (a pin wins over the policy)
            return
        if inp.tag is not None and self.placement(inp.name) != placement:
            raise PlanError(
                f"dynshard: {inp.name} is already placed as {self.placement(inp.name)} by an earlier "
                f"compiled program; a parameter keeps one placement in every graph")
        if inp.is_split_value and self.placement(inp.name) != placement:
            raise PlanError(
                f"dynshard: {inp.name} arrives as a DTensor placed {self.placement(inp.name)} (a split output "
                f"of another compiled program); its placement is fixed")
        self._tp[inp.index] = placement

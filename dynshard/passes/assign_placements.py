"""Run the policy, or install the plan given instead (a loaded, received or stored :class:`~dynshard.planning.Plan`):
every parameter, buffer and user input gets its placement on the mesh, and the program's Plan is recorded."""

from __future__ import annotations

import torch.fx as fx
from torch.distributed.tensor import Placement

from ..planning import ActivationChoice, Plan, PlanFileError, TensorChoice, decode_placement, encode_placement
from ..planning.node_keys import node_keys
from ..planning.plan import mesh_of
from ..runtime.sharding import check_divisible, local_shape, placements_for
from ..runtime.zero import ZeroSpec, zero_spec
from .context import ActivationPlacement, PassContext


def assign_placements(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """``ctx.policy`` (the backend passes ``policies.place``, a later stage of the flow) decides unless a plan
    is given."""
    if ctx.given is not None:
        install_plan(ctx.given, gm, ctx)
        ctx.zero = zero_specs(ctx, ctx.placements, ctx.over_dp)
    elif ctx.policy is None:
        raise ValueError("dynshard: nothing places this graph: the context has neither a plan nor a policy")
    else:
        ctx.policy(gm, ctx)
    ctx.plan = record_plan(gm, ctx)
    return gm


def zero_specs(ctx: PassContext, placements: dict[int, tuple[Placement, ...]],
               over_dp: set[int]) -> dict[int, ZeroSpec]:
    """The ZeRO storage of the inputs split over the data-parallel ranks (tagged inputs keep theirs)."""
    specs = {}
    for inp in ctx.inputs:
        if inp.tag is not None:
            spec = inp.tag.zero
        elif inp.index in over_dp:
            zero = ctx.outline.zero
            spec = zero_spec(zero.level, ctx.layout, zero.ngroups,
                             local_shape(inp.shape, ctx.layout, placements[inp.index]), zero.reduce_scatter)
        else:
            spec = None
        if spec is not None:
            specs[inp.index] = spec
    return specs


def record_plan(gm: fx.GraphModule, ctx: PassContext) -> Plan:
    """The decisions in ``ctx`` as a Plan (the given plan's policy name and predictions are kept)."""
    keys = node_keys(gm.graph)
    by_name = {n.name: n for n in keys}
    ctx.node_keys = {n.name: key for n, key in keys.items()}
    activations = {}
    for name, choice in ctx.constraints.items():
        readers = None if choice.readers is None else tuple(keys[by_name[r]] for r in choice.readers)
        activations[keys[by_name[name]]] = ActivationChoice(encode_placement(choice.placements[0]), readers)
    order = {key: i for i, key in enumerate(keys.values())}
    outline = ctx.outline
    return Plan(made_for=ctx.made_for, policy=outline.policy, mesh=mesh_of(ctx.layout), zero=outline.zero,
                tensors=tensor_choices(ctx), activations=dict(sorted(activations.items(), key=lambda item: order[item[0]])),
                recompute=ctx.recompute if ctx.given is None and ctx.recompute is not None else outline.recompute,
                mixed_precision=outline.mixed_precision, predicted=outline.predicted)


def tensor_choices(ctx: PassContext) -> dict[str, TensorChoice]:
    choices = {}
    for inp in ctx.inputs:
        placements = ctx.placements.get(inp.index, ())
        choices[inp.name] = TensorChoice.of(inp, encode_placement(placements[0]) if placements else "R",
                                            "zero" if inp.index in ctx.zero else None)
    return choices


def install_plan(plan: Plan, gm: fx.GraphModule, ctx: PassContext) -> None:
    """``plan``'s placements in ``ctx``, checked against this graph (a hand-edited plan may not fit)."""
    layout = ctx.layout
    names = [inp.name for inp in ctx.inputs]
    if list(plan.tensors) != names:
        missing = [n for n in names if n not in plan.tensors] or [n for n in plan.tensors if n not in names]
        raise PlanFileError(f"dynshard: the plan's tensors are not this graph's inputs (first difference: "
                            f"{missing[0] if missing else 'their order'}); make the plan again for this model")
    ctx.placements, ctx.over_dp = {}, set()
    for inp in ctx.inputs:
        choice = plan.tensors[inp.name]
        placement = decode_placement(choice.tp)
        placements = placements_for(layout, {"tp": placement} if layout.placement_dims else {})
        fixed = ctx.arrival(inp) if inp.tag is not None or inp.is_split_value else None
        if fixed is not None and tuple(fixed) != tuple(placements):
            raise PlanFileError(f"dynshard: the plan places {inp.name} as {choice.tp}, but it is already placed "
                                f"{fixed} (by an earlier compiled program, or as a split value); a tensor keeps one "
                                "placement in every graph")
        check_divisible(inp.name, inp.shape, layout, placements)
        ctx.placements[inp.index] = placements
        if choice.dp == "zero":
            if not inp.is_state or not inp.requires_grad:
                raise PlanFileError(f"dynshard: the plan splits {inp.name} over dp ('zero'), but ZeRO splits only "
                                    "trainable parameters; use 'replicate'")
            ctx.over_dp.add(inp.index)
    ctx.constraints = {}
    if plan.activations and not layout.placement_dims:
        raise PlanFileError("dynshard: the plan places activations, but a plan unit of one rank has nothing to place")
    by_key = {key: node for node, key in node_keys(gm.graph).items()}
    for key, choice in plan.activations.items():
        readers = choice.readers or ()
        for wanted in (key, *readers):
            if wanted not in by_key:
                raise PlanFileError(f"dynshard: the plan places activation {wanted!r}, which this graph does not "
                                    "compute (node keys are '<module path>:<op>:<occurrence>')")
        ctx.constraints[by_key[key].name] = ActivationPlacement(
            placements_for(layout, {"tp": decode_placement(choice.tp)}),
            None if choice.readers is None else tuple(by_key[r].name for r in choice.readers))


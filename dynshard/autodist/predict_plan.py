"""What any policy's plan is predicted to cost: ``dynshard.plan(..., device_profile=...)``.

The cost model autodist searches with (:mod:`.cost_model`, :mod:`.pipeline_costs`)
applied to the plan a policy made, so that a hand plan and autodist's choice read alike in ``explain`` and
on the plan page: step seconds (compute, communication, bubble) and bytes per rank at the peak
(activations kept for the backward and transient buffers besides what is held at rest). One call is one
step (accumulation is the caller's loop); a pipeline's step is its micro-batches. A hybrid pipeline is
priced as autodist prices it: its compute and activations per rank carried by Amdahl's law from the whole
graph on one rank and the tp policy's plan of it over the unit (planned here for that), its stages' own tp
collectives. Not predicted: a hybrid whose stages are left to place themselves (``"tp": null``).
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from ..config.autodist import AutodistOptions
from ..passes import PassContext, copy_graph, run_passes
from ..passes.cast_to_compute_dtype import cast_to_compute_dtype
from ..passes.lower_to_aten import lower
from ..planning import Plan
from ..planning.prediction import ProfileName
from ..runtime.mesh import planning_layout
from .cost_model import UnitCosts, predict
from .device_profile import DeviceProfile
from .fused_attention import op_costs_on
from .graph_costs import graph_costs
from .graphs import Graphs
from .pipeline_costs import predict_pipeline, unit_at

TRANSIENT_MEM_COEF = AutodistOptions.transient_mem_coef     # nnScaler's default, as autodist's


def with_prediction(gm: fx.GraphModule, plan: Plan, ctx: PassContext, graph: fx.GraphModule,
                    profile: DeviceProfile, graphs: Graphs) -> Plan:
    """``plan`` (made by ``graphs.plan`` from ``gm``, leaving ``ctx`` and ``graph``) with its predicted costs in
    ``predicted.cost`` (what was there kept)."""
    if plan.pipeline is not None:
        if any(t.tp is None for t in plan.tensors.values()):
            return plan
        unit = whole_graph_costs(gm, ctx, profile)
        if plan.mesh.tp > 1:
            unit = unit_at(unit, tp_unit_costs(gm, ctx, plan.mesh.plan_ngpus, graphs, profile), plan.mesh.plan_ngpus,
                           plan.mesh.tp)
        predicted = predict_pipeline(plan, unit, profile, TRANSIENT_MEM_COEF)
    else:
        predicted = predict(plan, unit_costs(gm, ctx, graph, profile), 1, profile, TRANSIENT_MEM_COEF)
    return dataclasses.replace(plan, predicted=dataclasses.replace(
        plan.predicted, cost=predicted, device_profile=ProfileName(profile.name, profile.digest())))


def unit_costs(gm: fx.GraphModule, ctx: PassContext, graph: fx.GraphModule, profile: DeviceProfile) -> UnitCosts:
    """What one rank of the plan's unit computes, keeps and sends per call (``graph``: the placed ATen graph)."""
    if ctx.layout.tp_mesh is None:          # a unit of one rank is not lowered by the passes: lower it here
        return whole_graph_costs(gm, ctx, profile)
    return graph_costs(graph, ctx.inputs, op_costs_on(profile, graph, ctx.inputs, ctx.fake_mode), ctx.layout.tp_size,
                       ctx.propagation, profile=profile)


def tp_unit_costs(gm: fx.GraphModule, ctx: PassContext, ranks: int, graphs: Graphs, profile: DeviceProfile
                  ) -> UnitCosts:
    """What one rank computes, keeps and sends with the whole graph placed by the tp policy over ``ranks``
    (the stages' tp options), on a layout with no process group."""
    config = dataclasses.replace(ctx.config, policy="tp", use_zero=0, zero_ngroups=1, zero_use_reduce_scatter=False,
                                 pas_config={"sequence_parallel": ctx.outline.pipeline.sequence_parallel})
    layout = planning_layout(ctx.layout.world_size, ranks, ctx.layout.device_type)
    lowered, lowered_ctx = graphs.lower(gm, ctx.inputs, config, layout, ctx.made_for)
    _, placed_ctx, placed = graphs.place(lowered, lowered_ctx, config)
    return graph_costs(placed, ctx.inputs, op_costs_on(profile, placed, ctx.inputs, placed_ctx.fake_mode), ranks,
                       placed_ctx.propagation, profile=profile)


def whole_graph_costs(gm: fx.GraphModule, ctx: PassContext, profile: DeviceProfile) -> UnitCosts:
    """What the whole graph costs one rank that runs all of it."""
    lowered = lower(run_passes(copy_graph(gm), ctx, [cast_to_compute_dtype]), ctx)
    return graph_costs(lowered, ctx.inputs, op_costs_on(profile, lowered, ctx.inputs, ctx.fake_mode), 1, None,
                       profile=profile)

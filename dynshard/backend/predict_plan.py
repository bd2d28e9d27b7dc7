"""What any policy's plan is predicted to cost: ``dynshard.plan(..., device_profile=...)``.

The cost model autodist searches with (:mod:`planning.cost_model`, :mod:`policies.autodist.pipeline_costs`)
applied to the plan a policy made, so that a hand plan and autodist's choice read alike in ``explain`` and
on the plan page: step seconds (compute, communication, bubble) and bytes per rank at the peak
(activations kept for the backward and transient buffers besides what is held at rest). One call is one
step (accumulation is the caller's loop); a pipeline's step is its micro-batches. Not predicted: hybrid
pipelines (each stage's tp placement is made when the stage compiles).
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from ..config.autodist import AutodistOptions
from ..passes import PassContext, run_passes
from ..passes.cast_to_compute_dtype import cast_to_compute_dtype
from ..passes.lower_to_aten import lower
from ..planning import Plan
from ..planning.cost_model import DeviceProfile, UnitCosts, predict
from ..policies.autodist.graph_costs import graph_costs, op_costs
from ..policies.autodist.pipeline_costs import predict_pipeline
from .plan_and_compile import copy_graph

TRANSIENT_MEM_COEF = AutodistOptions.transient_mem_coef     # nnScaler's default, as autodist's


def with_prediction(gm: fx.GraphModule, plan: Plan, ctx: PassContext, graph: fx.GraphModule,
                    profile: DeviceProfile) -> Plan:
    """``plan`` (made by ``plan_graph`` from ``gm``, leaving ``ctx`` and ``graph``) with its predicted costs in
    ``predicted`` (what was there kept). A hybrid pipeline is returned as it is."""
    if plan.pipeline is not None:
        if any(t.tp is None for t in plan.tensors.values()) or plan.mesh.tp > 1:
            return plan
        predicted = predict_pipeline(plan, whole_graph_costs(gm, ctx), profile, TRANSIENT_MEM_COEF)
    else:
        predicted = predict(plan, unit_costs(gm, ctx, graph), 1, profile, TRANSIENT_MEM_COEF)
    return dataclasses.replace(plan, predicted={**(plan.predicted or {}), **predicted,
                                                "device_profile": {"name": profile.name, "digest": profile.digest()}})


def unit_costs(gm: fx.GraphModule, ctx: PassContext, graph: fx.GraphModule) -> UnitCosts:
    """What one rank of the plan's unit computes, keeps and sends per call (``graph``: the placed ATen graph)."""
    if ctx.layout.tp_mesh is None:          # a unit of one rank is not lowered by the passes: lower it here
        return whole_graph_costs(gm, ctx)
    return graph_costs(graph, ctx.inputs, op_costs(graph, ctx.inputs, ctx.fake_mode), ctx.layout.tp_size,
                       ctx.propagation)


def whole_graph_costs(gm: fx.GraphModule, ctx: PassContext) -> UnitCosts:
    """What the whole graph costs one rank that runs all of it."""
    lowered = lower(run_passes(copy_graph(gm), ctx, [cast_to_compute_dtype]), ctx)
    return graph_costs(lowered, ctx.inputs, op_costs(lowered, ctx.inputs, ctx.fake_mode), 1, None)

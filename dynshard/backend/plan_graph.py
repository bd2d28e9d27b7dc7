"""The Plan a configuration gives one captured graph on a layout, made as the backend makes it on the
planning rank, without compiling anything: offline planning (:mod:`.offline`), a planner's
``planning.plan`` and the candidates of autodist's search, which gets these functions as ``GRAPHS``
(:mod:`dynshard.autodist.graphs`)."""

from __future__ import annotations

import torch.fx as fx

from .. import compat
from ..autodist.graphs import Graphs
from ..config import Config
from ..passes import LOWER, PLACE, PROPAGATE, PassContext, copy_graph, run_passes
from ..passes.assign_placements import record_plan
from ..planning import Plan
from ..planning.costs import with_forward_collectives
from ..planning.outline import outline_of
from ..policies import place
from ..runtime.mesh import Layout
from ..runtime.pipeline.schedules import build_schedule
from .pipeline import PIPELINE_CUT, PIPELINE_LOWER, pipeline_plan


def plan_graph(gm: fx.GraphModule, inputs, config: Config, layout: Layout, made_for,
               place_stages: bool = True, given_pipeline: Plan | None = None) -> tuple[Plan, PassContext, fx.GraphModule]:
    """``config``'s Plan for ``gm`` (described by ``inputs``), the context the passes filled, and the graph
    they left (the propagated ATen graph of a planned unit). ``place_stages=False``: a hybrid pipeline's
    stages are not planned (:func:`.pipeline.pipeline_plan`). ``given_pipeline``: a pipeline plan of this
    config whose stage starts are taken as they are (an edited cut), the rest made as the policy makes it."""
    outline = outline_of(config, layout.world_size, made_for)
    ctx = PassContext(config=config, outline=outline, layout=layout, inputs=inputs, fake_mode=compat.new_fake_mode(),
                      made_for=made_for, policy=place, given=given_pipeline)
    graph = copy_graph(gm)
    if outline.pipeline is not None:
        pipeline = outline.pipeline
        schedule = build_schedule(pipeline.schedule, pipeline.nsegments, pipeline.nmicros, layout.pp_size,
                                  pipeline.all_device_first)
        graph = run_passes(run_passes(graph, ctx, PIPELINE_LOWER), ctx, PIPELINE_CUT)
        return pipeline_plan(ctx, schedule, place_stages), ctx, graph
    if not layout.dim_names:        # a single process: nothing to place
        ctx.placements = {i.index: () for i in inputs}
        return record_plan(graph, ctx), ctx, graph
    return place_graph(*lower_graph(gm, inputs, config, layout, made_for), config)


def lower_graph(gm: fx.GraphModule, inputs, config: Config, layout: Layout, made_for) -> tuple[fx.GraphModule, PassContext]:
    """The passes before the policy (lowering to ATen and what splits fused ops): they do not depend on the
    policy, so one lowered graph serves every policy planned on ``layout``."""
    ctx = PassContext(config=config, outline=outline_of(config, layout.world_size, made_for), layout=layout,
                      inputs=inputs, fake_mode=compat.new_fake_mode(), made_for=made_for, policy=place)
    return run_passes(copy_graph(gm), ctx, LOWER), ctx


def place_graph(lowered: fx.GraphModule, lowered_ctx: PassContext, config: Config,
                given: Plan | None = None) -> tuple[Plan, PassContext, fx.GraphModule]:
    """``config``'s policy (or the ``given`` plan's placements) on a lowered graph, and the propagation of its
    placements. Neither changes the graph, so it is not copied: a search places one lowered graph for every
    candidate."""
    ctx = PassContext(config=config, outline=outline_of(config, lowered_ctx.layout.world_size, lowered_ctx.made_for),
                      layout=lowered_ctx.layout, inputs=lowered_ctx.inputs, fake_mode=lowered_ctx.fake_mode,
                      made_for=lowered_ctx.made_for, policy=place, given=given, blocked=dict(lowered_ctx.blocked),
                      op_memo=lowered_ctx.op_memo)
    graph = run_passes(run_passes(lowered, ctx, PLACE), ctx, PROPAGATE)
    return with_forward_collectives(ctx.plan, ctx.propagation, ctx.node_keys), ctx, graph


GRAPHS = Graphs(plan=plan_graph, lower=lower_graph, place=place_graph)     # (what autodist plans candidates with)

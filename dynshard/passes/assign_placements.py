"""Run the policy: every parameter, buffer and user input gets its placement on the mesh."""

from __future__ import annotations

import torch.fx as fx

from .context import PassContext


def assign_placements(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    from ..policies import PlanBuilder, resolve

    plan = PlanBuilder(gm, ctx)
    resolve(ctx.config)(plan, ctx.config)
    ctx.placements = plan.finish()
    return gm

"""Run the policy: every parameter, buffer and user input gets its placement on the mesh."""

from __future__ import annotations

import torch.fx as fx

from .context import PassContext


def assign_placements(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Placements already in the context (a plan stored on disk by an earlier run) skip the policy."""
    from ..policies import PlanBuilder, resolve
    from ..policies.plan_builder import zero_specs

    if ctx.placements:
        if sorted(ctx.placements) != [inp.index for inp in ctx.inputs]:
            raise ValueError("dynshard: a stored plan does not match the graph's inputs; clear cache_dir")
        ctx.zero = zero_specs(ctx, ctx.placements, ctx.over_dp)
        return gm
    plan = PlanBuilder(gm, ctx)
    resolve(ctx.config)(plan, ctx.config)
    ctx.placements = plan.finish()
    ctx.zero = plan.finish_zero(ctx.placements)
    return gm

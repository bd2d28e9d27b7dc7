"""What autodist plans its candidates with: the backend's own planning of one captured graph without
compiling it (:mod:`dynshard.backend.plan_graph`), handed to :func:`.plan_search.search` and
:func:`.predict_plan.with_prediction` by the backend that calls them (``plan_graph.GRAPHS``).

Why handed in, not imported: a candidate is planned exactly as the job would plan it (the same passes, a
pipeline's cut and its stages' plans, the same recording), which is the backend's code, and the backend
calls autodist; passing the three functions keeps the packages in their order (autodist before backend)
with no cycle, as ``PassContext.policy`` does for the passes and the policies.
"""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Graphs:
    # plan(gm, inputs, config, layout, made_for, place_stages=True, given_pipeline=None) -> (Plan, context, graph):
    # the Plan a configuration gives the graph on a layout (a pipeline's cut and, under hybrid, its stages)
    plan: Callable
    # lower(gm, inputs, config, layout, made_for) -> (lowered graph, context): the passes before the policy
    lower: Callable
    # place(lowered, lowered_ctx, config, given=None) -> (Plan, context, graph): a policy on a lowered graph
    place: Callable

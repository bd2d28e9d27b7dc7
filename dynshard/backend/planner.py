"""A planner's plan (:mod:`dynshard.config.planner`): the planner runs on rank 0 before the layout exists,
with a :class:`Planning` of the captured graph; the other ranks receive the Plan it returns (or its error).
The Plan must be made for this graph and world; then it is executed as a loaded plan file is. autodist's
search is chosen the same way (:func:`autodist_plan`)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import torch.fx as fx

from ..autodist import AutodistError, search, with_prediction
from ..autodist.device_profile import DeviceProfile, load_profile
from ..config import Config
from ..config.planner import Planner
from ..planning import Plan, TensorChoice
from ..planning.plan import first_mismatch
from ..runtime.mesh import planning_layout
from .agreement import from_rank0
from .plan_graph import GRAPHS, plan_graph


class PlannerError(ValueError):
    """A planner failed, or returned something that is not a Plan for this graph and world."""


@dataclasses.dataclass
class Planning:
    """What a planner sees: the graph's tensors (parameters, buffers and inputs by name, with their kind,
    shape and dtype), the world, the job's config (its defaults and limits), and :meth:`plan`."""

    world_size: int
    config: Config
    tensors: Mapping[str, TensorChoice]
    device_type: str
    graph: fx.GraphModule = dataclasses.field(repr=False)
    inputs: list = dataclasses.field(repr=False)
    made_for: Any = dataclasses.field(repr=False)

    def plan(self, config: Config | Mapping[str, Any] | None = None, *,
             device_profile: str | os.PathLike | DeviceProfile | None = None, **options) -> Plan:
        """The Plan a configuration gives this graph in this world: ``config`` (default: the job's) with
        ``options`` replaced (``policy="hybrid", plan_ngpus=4, pas_config={...}, use_zero=1, ...``); with
        ``device_profile`` ("cpu", "cuda", a calibrated file), its predicted step and peak in
        ``plan.predicted`` (autodist's plans always carry theirs)."""
        base = self.config if config is None else Config.from_options(config)
        chosen = dataclasses.replace(base, **options) if options else base
        if isinstance(chosen.policy, Planner):
            raise PlannerError("dynshard: planning.plan(...) makes a policy's plan: name the policy (policy='tp', "
                               "'data', 'pp', 'hybrid', 'autodist', ...), not a planner")
        chosen = dataclasses.replace(chosen, load_plan_path=None, save_plan_path=None).resolve(self.world_size)
        if chosen.policy == "autodist":
            return search(self.graph, self.inputs, chosen, self.world_size, self.made_for, self.device_type, GRAPHS)
        layout = planning_layout(self.world_size, chosen.plan_ngpus, self.device_type, pp_size=chosen.pipeline_ranks)
        made, ctx, graph = plan_graph(self.graph, self.inputs, chosen, layout, self.made_for)
        if device_profile is None:
            return made
        return with_prediction(self.graph, made, ctx, graph, load_profile(device_profile, self.device_type), GRAPHS)


def autodist_plan(gm: fx.GraphModule, inputs, config: Config, world: int, made_for, device_type: str) -> Plan:
    """The plan autodist chooses for ``gm`` in a job of ``world`` ranks, the same on every rank: its search
    (:func:`dynshard.autodist.search`) on rank 0, which the others receive."""
    text = from_rank0(lambda: search(gm, inputs, config, world, made_for, device_type, GRAPHS).to_json(),
                      AutodistError, "search a plan (autodist)")
    return Plan.from_json(text, "the plan autodist chose on rank 0")


def planner_plan(gm: fx.GraphModule, inputs, config: Config, world: int, made_for, device_type: str) -> Plan:
    """The plan ``config.policy`` (a planner) returns for ``gm``, the same on every rank."""
    text = from_rank0(lambda: run_planner(gm, inputs, config, world, made_for, device_type).to_json(), PlannerError,
                      "run the planner")
    return Plan.from_json(text, "the plan the planner returned on rank 0")


def run_planner(gm: fx.GraphModule, inputs, config: Config, world: int, made_for, device_type: str) -> Plan:
    tensors = {inp.name: TensorChoice.of(inp) for inp in inputs}
    planning = Planning(world, config, tensors, device_type, gm, inputs, made_for)
    name = config.policy.cache_token()
    plan = config.policy.fn(planning)
    if not isinstance(plan, Plan):
        raise PlannerError(f"dynshard: the {name} returned {type(plan).__name__}, not a dynshard.Plan; return "
                           "one of planning.plan(...)'s plans, edited or not")
    mismatch = first_mismatch(plan, made_for, tensors)
    if mismatch is not None:
        raise PlannerError(f"dynshard: the {name} returned a plan that was not made for this graph: {mismatch}. "
                           "Return a plan planning.plan(...) made in this call")
    return plan

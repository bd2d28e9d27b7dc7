"""``dynshard.plan``: the plans of a job of any size, made in one ordinary process.

The model runs once under ``torch.compile`` with a backend that captures and plans each graph as the
dynshard backend would on rank 0 of a ``world_size``-rank job (a process group that never communicates
stands in for the job), and runs the graph eagerly so that Dynamo goes on to the next one. Nothing is
compiled, nothing is sharded, and a model on the meta device stays there (its batch is moved to meta).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from .. import compat
from ..autodist import search, with_prediction
from ..autodist.device_profile import DeviceProfile, load_profile
from ..config import Config
from ..config.planner import Planner
from ..planning import Plan
from ..planning.plan import fingerprint
from ..runtime import mesh
from .capture import describe_inputs, raising_not_breaking
from .plan_cache import modes_token
from .planner import run_planner
from .plan_graph import GRAPHS, plan_graph


def plan(model: torch.nn.Module, args: Sequence[Any], config: Config | Mapping[str, Any] | None = None,
         world_size: int = 1, kwargs: Mapping[str, Any] | None = None,
         device_profile: str | os.PathLike | DeviceProfile | None = None) -> list[Plan]:
    """The plans (one per graph Dynamo captures, in order) that ``config`` gives ``model`` called with
    ``args``/``kwargs`` in a job of ``world_size`` ranks. Save one with ``Plan.to_json()`` and run it with
    ``Config(load_plan_path=...)``; ``dynshard.explain(plans)`` tells what it holds and sends.

    ``device_profile`` ("cpu", "cuda", a file ``python -m dynshard.calibrate`` wrote, or a DeviceProfile):
    also predict each plan's step seconds and peak bytes per rank with autodist's cost model, into
    ``Plan.predicted`` (autodist's plans always carry theirs: its profile is ``pas_config['device_profile']``)."""
    if dist.is_initialized():
        raise RuntimeError("dynshard.plan plans in a process without a process group (it stands one in for the "
                           f"{world_size}-rank job); call it before init_process_group, or in another process")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"dynshard.plan: world_size must be a positive integer, got {world_size!r}")
    config = Config.from_options(config)
    if device_profile is not None and config.policy == "autodist":
        raise ValueError("dynshard.plan: autodist predicts with pas_config['device_profile']; pass the profile there")
    profile = None if device_profile is None else load_profile(device_profile, "cpu")
    if config.load_plan_path:
        raise ValueError("dynshard.plan makes plans; a config with load_plan_path has nothing to plan")
    on_meta = any(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers()))
    if on_meta:
        args, kwargs = _to_meta(tuple(args)), _to_meta(dict(kwargs or {}))
    plans: list[Plan] = []
    torch._dynamo.reset()
    compat.fake_process_group(world_size)
    try:
        compat.keep_shapes_static()
        compiled = torch.compile(model, backend=functools.partial(_plan_graph, config=config, plans=plans,
                                                                  profile=profile))
        compiled(*args, **(kwargs or {}))
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    return plans


@raising_not_breaking
def _plan_graph(gm: fx.GraphModule, example_inputs, config: Config, plans: list[Plan], profile: DeviceProfile | None):
    world = dist.get_world_size()
    config = config.resolve(world)
    inputs = describe_inputs(gm, example_inputs)
    layout = mesh.layout_for(config.plan_ngpus, "cpu", config.pipeline_ranks)
    made_for = fingerprint(gm.code, world, modes_token())
    if config.policy == "autodist":
        plans.append(search(gm, inputs, config, world, made_for, "cpu", GRAPHS))
    elif isinstance(config.policy, Planner):
        plans.append(run_planner(gm, inputs, config, world, made_for, "cpu"))
    else:
        made, ctx, graph = plan_graph(gm, inputs, config, layout, made_for)
        plans.append(made if profile is None else with_prediction(gm, made, ctx, graph, profile, GRAPHS))
    return gm.forward


def _to_meta(value):
    return compat.pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), value)

"""A plan's outline: the decisions a program is built from before any tensor is placed.

The outline is a :class:`~dynshard.planning.Plan` without tensors: the factorisation of the world (which the
layout is built from), ZeRO, recompute, mixed precision, and the pipeline's schedule, micro-batches and
stages (its cut comes later, from the policy or the plan). A given plan (a plan file, autodist's or a
planner's choice) is its own outline; a string policy's outline is the user's configuration as it stands
(:func:`outline_of`). The backend builds the layout from it and every pass and runtime module reads these
decisions from it, never from the configuration, so a plan runs the same whatever configuration the job
was given; the configuration tells the policies what to choose and the compiler how to build.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..config import Config, ConfigError, mixed_precision_policy
from ..config.pipeline import INFERENCE_SCHEDULES
from .plan import MadeFor, MeshShape, PipelineChoice, Plan, PlanFileError, ZeroChoice


def policy_name(config: Config) -> str:
    """The name a plan records for ``config``'s policy (a callable's qualified name)."""
    policy = config.policy
    if isinstance(policy, str):
        return policy
    return getattr(policy, "__qualname__", None) or type(policy).__name__


def outline_of(config: Config, world_size: int, made_for: MadeFor | None = None) -> Plan:
    """What ``config`` decides before its policy places anything, in a world of ``world_size`` ranks."""
    plan_ngpus, pp = config.plan_ngpus, config.pipeline_ranks
    if world_size % plan_ngpus:
        raise ConfigError(f"dynshard: plan_ngpus={plan_ngpus} does not divide the world size {world_size}")
    pipeline = None
    if config.is_pipeline:
        options = config.pipeline
        pipeline = PipelineChoice(schedule=options.pipeline_scheduler, nmicros=options.pipeline_nmicros,
                                  nstages=options.nstages(config), nchunks=options.pipeline_nchunks, starts=(),
                                  stage_ranks=(), sequence_parallel=options.sequence_parallel)
    return Plan(made_for=made_for, policy=policy_name(config), tensors={}, pipeline=pipeline,
                mesh=MeshShape(world=world_size, dp=world_size // plan_ngpus, pp=pp, tp=plan_ngpus // pp),
                **_settings(config))


def _settings(config: Config) -> dict[str, Any]:
    """The plan's choices that a policy takes from the user's configuration as it is: ZeRO, recompute and
    mixed precision (a policy that chooses them, e.g. an automatic one, sets them itself)."""
    mp = config.mixed_precision
    return {"zero": ZeroChoice(config.zero, config.zero_ngroups, config.zero_use_reduce_scatter),
            "recompute": tuple(config.recompute_names),
            "mixed_precision": None if mp is None else {f.name: _setting(getattr(mp, f.name))
                                                        for f in dataclasses.fields(mp)}}


def _setting(value: Any) -> Any:
    return str(value).replace("torch.", "") if value is not None and not isinstance(value, (bool, int, str)) else value


def stage_outline(outline: Plan) -> Plan:
    """A hybrid pipeline stage's outline: its tp ranks placed by the tp policy, without ZeRO (the pipeline's
    ZeRO rows are gathered once per step) and without a pipeline of its own."""
    return dataclasses.replace(outline, made_for=None, policy="tp", zero=ZeroChoice(), tensors={}, activations={},
                               pipeline=None, predicted=None)


def mixed_precision_of(plan: Plan) -> MixedPrecisionPolicy | None:
    """The plan's mixed precision as torch's policy (dtypes from their names)."""
    if plan.mixed_precision is None:
        return None
    return mixed_precision_policy(dict(plan.mixed_precision))



def check_runs(plan: Plan, config: Config) -> None:
    """A given plan's pipeline runs what the job does: a training schedule unless ``inference_only``."""
    if plan.pipeline is not None and (plan.pipeline.schedule in INFERENCE_SCHEDULES) != config.inference_only:
        raise PlanFileError(f"dynshard: the plan's pipeline schedule {plan.pipeline.schedule!r} "
                            f"{'runs forward only' if not config.inference_only else 'trains'}, and this job has "
                            f"inference_only={config.inference_only}; make the plan for this job")

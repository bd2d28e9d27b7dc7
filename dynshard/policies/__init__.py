"""Policies decide how a plan unit splits the graph. See :mod:`.plan_builder` for the policy API."""

from __future__ import annotations

import functools
from typing import Callable

import torch.fx as fx

from ..config import Config
from ..passes.context import PassContext
from .data_parallel import data, dp
from .megatron import TensorParallelOptions, tensor_parallel_layers, tp
from .plan_builder import PlanBuilder, PlanError
from .tensor_parallel import tensor_parallel

BUILTIN: dict[str, Callable[[PlanBuilder, Config], None]] = {"dp": dp, "data": data, "tp": tp}


def resolve(config: Config) -> Callable[[PlanBuilder, Config], None]:
    return BUILTIN[config.policy] if isinstance(config.policy, str) else config.policy


def place(gm: fx.GraphModule, ctx: PassContext) -> None:
    """The policy step of ``passes.assign_placements``: the config's policy places every input of ``gm``."""
    place_with(resolve(ctx.config), gm, ctx)


def place_stage(sequence_parallel: bool) -> Callable[[fx.GraphModule, PassContext], None]:
    """The policy step of a hybrid pipeline's stage: Megatron's tp with the pipeline's tp options."""
    options = TensorParallelOptions(sequence_parallel=sequence_parallel)
    return functools.partial(place_with, lambda plan, config: tensor_parallel_layers(plan, options))


def place_with(policy: Callable[[PlanBuilder, Config], None], gm: fx.GraphModule, ctx: PassContext) -> None:
    plan = PlanBuilder(gm, ctx)
    policy(plan, ctx.config)
    ctx.placements = plan.finish()
    ctx.zero = plan.finish_zero(ctx.placements)


__all__ = ["BUILTIN", "PlanBuilder", "PlanError", "place", "place_stage", "resolve", "dp", "data", "tp", "tensor_parallel"]

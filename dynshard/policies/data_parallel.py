"""The ``dp`` and ``data`` policies: parameters whole on every rank, the batch split."""

from __future__ import annotations

from ..config import Config
from .plan_builder import PlanBuilder, PlanError


def dp(plan: PlanBuilder, config: Config) -> None:
    """Data parallelism over all ranks: plan_ngpus is 1, so there is nothing to place inside a unit.
    Gradients of the replicated parameters are averaged over "dp" inside the backward graph."""


def data(plan: PlanBuilder, config: Config) -> None:
    """Inside a plan unit, split every op along the batch dimension (dim 0 of each user input)."""
    for inp in plan.user_inputs:
        if not len(inp.shape):
            continue
        if not plan.divides(inp.name, 0):
            raise PlanError(
                f"dynshard: policy 'data' splits the batch over {plan.tp_size} ranks but input "
                f"{inp.name} has batch size {inp.shape[0]}; use a batch size divisible by plan_ngpus")
        plan.shard(inp.name, 0)

"""A planner: a policy that returns the whole Plan before the job's layout exists.

A callable ``policy(plan, config)`` places tensors on a layout that is already built: the mesh
factorisation, the pipeline and the ZeRO level are the config's by then. A planner decides those too. It
is called once per captured graph, on rank 0 (the other ranks receive its Plan), with a
:class:`dynshard.backend.planner.Planning`: the graph's tensors, the world, and ``planning.plan(...)``,
which makes the Plan any configuration would give this graph (any policy, ``plan_ngpus``, pipeline,
ZeRO level, recompute; priced when asked). It returns one :class:`dynshard.Plan`, one of those or one it
edited (a tensor's placement, a stage boundary, the schedule, recompute), and the backend executes it as
it would a loaded plan file. autodist is such a search; a planner is the user's own.

    @dynshard.planner
    def fastest(planning):
        plans = [planning.plan(policy=p, plan_ngpus=2, device_profile="cpu") for p in ("tp", "data")]
        return min(plans, key=lambda p: p.predicted.cost.step_seconds)

    torch.compile(model, backend="dynshard", options=dynshard.Config(policy=fastest))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Planner:
    """``fn(planning) -> Plan``, marked as a planner (``dynshard.planner(fn)``)."""

    fn: Callable[[Any], Any]

    def __call__(self, *args, **kwargs):
        raise TypeError(f"dynshard: {self.cache_token()} is a planner: dynshard calls it with a Planning before "
                        "the layout exists, never as a placement policy(plan, config)")

    def cache_token(self) -> str:
        """Its name in plan keys and ``Config.describe()`` (the same on every rank and across restarts)."""
        return f"planner {getattr(self.fn, '__module__', '')}.{getattr(self.fn, '__qualname__', repr(self.fn))}"


def planner(fn: Callable[[Any], Any]) -> Planner:
    """Mark ``fn(planning) -> Plan`` as a planner, for ``Config(policy=...)``."""
    if not callable(fn):
        raise TypeError(f"dynshard.planner takes a callable fn(planning) -> Plan, got {fn!r}")
    return Planner(fn)

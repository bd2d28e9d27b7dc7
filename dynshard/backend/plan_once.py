"""Planned once per job: rank 0 runs the policy (or reads the plan ``cache_dir`` keeps) and sends the Plan;
the other ranks install it as a given plan and run no policy. A plan from ``load_plan_path`` is on every
rank already, and nothing is sent. Whole graphs and pipelines (their stage cut) share this.

The others do the work before the planning step (lowering) while rank 0 plans, and wait for the plan just
before it. A rank whose planning raises still takes part in the one message of the compile (rank 0 sends
its error instead of the plan; another rank waits for rank 0's message), so every rank raises and the
ranks stay in step for the next compile (see :class:`.agreement.PlanChannel`). A process that plans alone
(one rank, a fake group) plans as before.
"""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

from ..passes import PassContext
from ..planning import Plan
from .agreement import PlanChannel, plan_channel
from .plan_cache import PLANS

Step = Callable[[PassContext], Any]
T = TypeVar("T")


def plan_once(ctx: PassContext, key: str, run: Callable[[Step | None, Step | None], T], alone: bool = False) -> T:
    """``run(before_planning, after_planning)`` runs the passes, calling each (when given) around the step
    that plans (the policy, or the stage cut); that step records ``ctx.plan``. Returns what ``run`` returns.
    ``alone``: this rank plans by itself, with no message (a program of an agreed family, see .families)."""
    if ctx.given is not None or alone:           # a plan file; a family's program
        result = run(None, None)
    else:
        channel = plan_channel()
        try:
            if channel is not None and not channel.planner:
                return run(lambda ctx: _receive(ctx, channel), None)
            ctx.given = PLANS.load_plan(ctx.config, key)
            if ctx.given is not None and channel is not None:   # at once: the others need not wait for the passes
                channel.send(ctx.given.to_json())
            result = run(None, None if channel is None else lambda ctx: _send(ctx, channel))
        except BaseException as error:
            if channel is not None:
                channel.abandon(error)
            raise
    PLANS.save_plan(ctx.config, key, ctx.plan, ctx.layout)
    return result


def _send(ctx: PassContext, channel: PlanChannel) -> None:
    if not channel.finished:      # (a plan read from cache_dir went out before the passes)
        channel.send(ctx.plan.to_json())


def _receive(ctx: PassContext, channel: PlanChannel) -> None:
    start = time.perf_counter()
    ctx.given = Plan.from_json(channel.receive(), "the plan rank 0 sent")
    ctx.timings.append(("receive_plan", time.perf_counter() - start))     # mostly waiting for rank 0

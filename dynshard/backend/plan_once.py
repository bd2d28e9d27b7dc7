"""Planned once per job: rank 0 runs the policy (or reads the plan ``cache_dir`` keeps) and sends the Plan;
the other ranks install it as a given plan and run no policy. A plan from ``load_plan_path`` is on every
rank already, and nothing is sent. Whole graphs and pipelines (their stage cut) share this.

The compile path reads top to bottom around it (:func:`.plan_and_compile.plan_and_compile`)::

    with plan_once(ctx, key) as agreement:
        lowered = run_passes(graph, ctx, LOWER)
        agreement.receive()             # the other ranks: rank 0's plan, the given plan from here on
        placed = run_passes(lowered, ctx, PLACE)
        agreement.send()                # rank 0: ctx.plan, to the others
        ...                             # propagation, rewriting and the compile, on every rank at once

so the others lower the graph while rank 0 plans, and wait for the plan just before they place it. A rank
whose passes raise still takes part in the one message of the compile (rank 0 sends its error instead of
the plan; another rank waits for rank 0's message), so every rank raises and the ranks stay in step for the
next compile (see :class:`.agreement.PlanChannel`). A process that plans alone (one rank, a fake group)
plans as before.
"""

from __future__ import annotations

import time

from ..passes import PassContext
from ..planning import Plan
from .agreement import PlanChannel, plan_channel
from .plan_cache import load_plan, save_plan


class PlanAgreement:
    """This rank's part in planning one compile once per job: :meth:`receive` before the planning step,
    :meth:`send` after it (each nothing where this rank neither waits nor sends)."""

    def __init__(self, ctx: PassContext, key: str, channel: PlanChannel | None, plans: bool) -> None:
        self.ctx, self.key, self.channel = ctx, key, channel
        self.plans = plans          # this rank plans (or reads the plan cache_dir keeps); else it is given

    @property
    def receives(self) -> bool:
        return self.channel is not None and not self.channel.planner

    def receive(self) -> None:
        """The other ranks: rank 0's plan becomes the given plan (mostly waiting for rank 0)."""
        if not self.receives:
            return
        start = time.perf_counter()
        self.ctx.given = Plan.from_json(self.channel.receive(), "the plan rank 0 sent")
        self.ctx.timings.append(("receive_plan", time.perf_counter() - start))

    def send(self) -> None:
        """Rank 0: the plan its planning step recorded, to the others (a plan read from cache_dir went out
        before the passes)."""
        if self.channel is not None and self.channel.planner and not self.channel.finished:
            self.channel.send(self.ctx.plan.to_json())

    def __enter__(self) -> PlanAgreement:
        if self.plans and not self.receives:
            self.ctx.given = load_plan(self.ctx.config, self.key)
            if self.ctx.given is not None and self.channel is not None:   # at once: the others need not wait
                self.channel.send(self.ctx.given.to_json())
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is not None:
            if self.channel is not None:
                self.channel.abandon(error)
            return
        if not self.receives:
            save_plan(self.ctx.config, self.key, self.ctx.plan, self.ctx.layout)


def plan_once(ctx: PassContext, key: str, alone: bool = False) -> PlanAgreement:
    """This rank's agreement on the plan of the compile ``key`` (a context manager). ``alone``: this rank
    plans by itself, with no message (a program of an agreed family, see .families); so does a compile
    whose plan is given (a plan file: on every rank already)."""
    plans = ctx.given is None and not alone
    return PlanAgreement(ctx, key, plan_channel() if plans else None, plans)

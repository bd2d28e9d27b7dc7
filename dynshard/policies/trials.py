"""How the ``tp`` policy's passes judge a trial placement (shared by :mod:`.megatron` and :mod:`.experts`)."""

from __future__ import annotations

import collections

from ..passes.propagation import Propagation
from .plan_builder import PlanBuilder


def try_propagate(plan: PlanBuilder, base: Propagation) -> Propagation | None:
    """A propagation, or None when DTensor cannot even trace the trial (it would need a gather that it
    only knows how to do on real data, e.g. of a strided shard)."""
    try:
        return plan.propagate(reuse=base)
    except Exception:  # noqa: BLE001 - any failure means this trial is not a plan
        return None


def adds_only_all_reduces(base: Propagation, trial: Propagation, at_most: int = 1) -> bool:
    """Megatron's acceptance rule: at most one all-reduce (or one per lookup of a vocab-parallel table)
    and nothing else. Not counted: the all-reduces of one value per row of a vocab-parallel cross-entropy."""
    before = collections.Counter(c.kind for c in base.collectives if c.node not in base.vocab_parallel_losses)
    after = collections.Counter(c.kind for c in trial.collectives if c.node not in trial.vocab_parallel_losses)
    added = after - before
    return set(added) <= {"all_reduce"} and added["all_reduce"] <= max(at_most, 1)

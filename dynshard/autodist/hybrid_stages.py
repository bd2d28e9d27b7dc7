"""A hybrid pipeline's stages priced with the whole graph's tp decisions, before any stage is planned.

The hybrid policy places each stage with the tp policy on the stage graph; the tp policy reads the graph's
structure, so a stage of Megatron layers gets the placements the same layers get in the whole graph, and
the same forward collectives (2 all-reduces per layer, the vocabulary's lookup in the first stage and its
loss in the last), of the same bytes at any tp (an all-reduce moves the whole activation). Planning a
stage costs lowering its graph to ATen and the tp policy's trials on it: per factorisation about one more
lowering of the whole graph. autodist therefore prices every hybrid candidate from the tp plan the search
has already made over the unit, and plans for real only the candidate it would choose (then prices that
plan again and chooses again: :func:`.plan_search.search`). A slow test holds the estimate to
the plan the hybrid policy makes.

Where the stages do not start at instances of the repeated layer (``pipe_split`` markers, pivots), a
collective's stage cannot be read from its module path: no estimate is made and the candidate is planned.
"""

from __future__ import annotations

import dataclasses

from ..planning import STAGE_SEPARATOR, Plan


def estimated_stages(plan: Plan, tp_plan: Plan, instances: tuple[str, ...]) -> Plan | None:
    """``plan`` (a hybrid pipeline whose stages are not placed) with ``tp_plan``'s placement of each tensor
    and its forward collectives, each in the stage holding its layer; None when that cannot be read."""
    order = {path: i for i, path in enumerate(instances)}
    starts = [order.get(start) for start in plan.pipeline.starts]
    if None in starts or starts != sorted(starts):
        return None
    tensors = {name: dataclasses.replace(t, tp=tp_plan.tensors[name].tp if t.tp is None and name in tp_plan.tensors
                                         else t.tp if t.tp is not None else "R")
               for name, t in plan.tensors.items()}
    collectives, stage = [], 0
    for collective in tp_plan.predicted.collectives:
        layer = _instance_of(collective.at.partition(":")[0], order)
        if layer is not None:
            stage = sum(1 for start in starts if start <= layer)
        collectives.append(dataclasses.replace(collective, at=f"{stage}{STAGE_SEPARATOR}{collective.at}"))
    predicted = dataclasses.replace(plan.predicted, forward_collectives=tuple(collectives))
    return dataclasses.replace(plan, tensors=tensors, predicted=predicted)


def _instance_of(path: str, order: dict[str, int]) -> int | None:
    while path:
        if path in order:
            return order[path]
        path = path.rpartition(".")[0]
    return None

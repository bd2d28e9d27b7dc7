"""A tp variant with several kinds of layer left whole (or on the unit's batch shards), priced from the
variants with one kind each, before it is planned.

Each kind of layer tp splits (the vocabulary, the attention, the MLP: :func:`.space.tp_variants`) is split,
left whole, or run on the unit's batch shards. What one kind's choice changes is local to that kind's layers:
its matmuls (a whole kind runs them whole on every rank, one on batch shards on its rank's rows), the values
they save, its own collectives (a split pair's all-reduce, or under batch parallelism the gather before it
and the reduce-scatter after it), its weights' placements and their gradients' all-reduce over the unit. So
a variant's costs are the base's plus each of its kinds' change from the base: the base is tp for kinds left
whole and tp with batch parallelism (every kind split, the activations between them on batch shards) for
kinds on batch shards. Planning one variant is a propagation of the whole graph (about 0.2 s at 32 layers);
this makes ``2k + 2`` of them (tp, the batch base, each kind whole and on batch shards) price every one
of the ``2 * (2^k - 2)`` variants of ``k`` kinds.

Summed term by term (each op's output too, whose largest is the transient), the estimate is what
:func:`.cost_model.predict` reads off the plan the tp policy makes, wherever the kinds'
changes are independent: on a GPT all 6 variants of two kinds (a test holds every estimate to the plan). A
collective two kinds' changes each remove (at their boundary) is removed once. Where they interact
otherwise the estimate can be wrong, so autodist plans the variant it would choose for real (one propagation,
with the estimate's placements), prices it again and chooses again, as with a hybrid's stages
(:func:`.plan_search.search`).
"""

from __future__ import annotations

import collections
import dataclasses

from ..planning import Plan
from .cost_model import UnitCosts
from ..planning.prediction import ForwardCollective

_ADDED = ("forward_flop_seconds", "backward_extra_seconds", "forward_bytes", "saved_bytes", "replicated_grad_bytes", "replicated_grads")
_ADDED_PER_INSTANCE = ("saved_bytes", "entry_bytes", "flop_seconds", "bytes", "input_bytes")


def composed(base: tuple[Plan, UnitCosts], parts: list[tuple[Plan, UnitCosts]]) -> tuple[Plan, UnitCosts] | None:
    """The plan and costs of the variant that makes each of ``parts``' changes to ``base`` (each part a
    variant with one kind changed); None when the parts' changes overlap (then it cannot be read off them)."""
    plan = _composed_plan(base[0], [p for p, _ in parts])
    if plan is None:
        return None
    return plan, _composed_costs(base[1], [u for _, u in parts])


def _composed_plan(base: Plan, parts: list[Plan]) -> Plan | None:
    tensors = _changes(base.tensors, [p.tensors for p in parts])
    activations = _changes(base.activations, [p.activations for p in parts])
    found = {_key(c): c for plan in [base, *parts] for c in _collectives(plan)}
    count = collections.Counter(_key(c) for c in _collectives(base))
    for part in parts:      # (a collective two parts each remove, one at the boundary of their kinds, goes once)
        count.update(_key(c) for c in _collectives(part))
        count.subtract(_key(c) for c in _collectives(base))
    if tensors is None or activations is None:
        return None
    collectives = tuple(found[key] for key in sorted(count) for _ in range(max(count[key], 0)))
    return dataclasses.replace(base, tensors=tensors, activations=activations,
                               predicted=dataclasses.replace(base.predicted, forward_collectives=collectives))


def _changes(base, parts) -> dict | None:
    """``base`` (name -> choice) with each part's changes; None when two parts change one name differently."""
    out = dict(base)
    changed: dict[str, object] = {}
    for part in parts:
        for name in set(part) | set(base):
            value = part.get(name)
            if value == base.get(name):
                continue
            if name in changed and changed[name] != value:
                return None
            changed[name] = value
    for name, value in changed.items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out


def _collectives(plan: Plan) -> tuple[ForwardCollective, ...]:
    return plan.predicted.collectives


def _key(collective: ForwardCollective) -> tuple:
    """(in the order of its JSON's fields by name: the composed plan's collectives are sorted by it)"""
    return tuple(sorted(collective.to_dict().items()))


def _composed_costs(base: UnitCosts, parts: list[UnitCosts]) -> UnitCosts:
    assert all(len(p.outputs) == len(base.outputs) and tuple(i.path for i in p.instances) == tuple(
        i.path for i in base.instances) for p in parts)
    fields = {name: getattr(base, name) + sum(getattr(p, name) - getattr(base, name) for p in parts)
              for name in _ADDED}
    instances = tuple(
        dataclasses.replace(instance, **{name: getattr(instance, name) + sum(
            getattr(p.instances[i], name) - getattr(instance, name) for p in parts) for name in _ADDED_PER_INSTANCE})
        for i, instance in enumerate(base.instances))
    outputs = tuple(out + sum(p.outputs[i] - out for p in parts) for i, out in enumerate(base.outputs))
    return dataclasses.replace(base, **fields, instances=instances, outputs=outputs,
                               largest_output=max(outputs, default=0))

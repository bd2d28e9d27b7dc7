"""What a re-propagation can take from an earlier propagation of the same graph (``reuse``), so that a
policy's trial (one group of weights split, everything else as before) runs only the layer it changes.

- **The prefix.** Nodes before the first reader of an input whose placement changed (and before the
  first activation whose placement moved) compute what they computed before: their values are reused.
- **The suffix.** A trial differs from its base only while some value it has computed differs and is
  still to be read. Once none is (a Megatron layer returns its residual stream replicated, whether its
  weights were split or not), every later node would compute what it computed in the base: the base's
  values and records are taken from there on. :class:`Rejoin` finds that point.

Both are exact: the propagation is a function of the values' specs, which are compared in full (mesh,
placements, global and local layout; :func:`.op_memo.value_key`).
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from .op_memo import value_key


def reusable_prefix(gm: fx.GraphModule, placements: tuple, constraints: dict, reuse) -> tuple[dict, Any]:
    """The values to start from (node -> value) and the base's records for those nodes (None: no reuse)."""
    if reuse is None or not reuse.env or len(reuse.input_placements) != len(placements):
        return {}, None
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    changed = {placeholders[i] for i, (a, b) in enumerate(zip(reuse.input_placements, placements)) if a != b}
    position = {n: i for i, n in enumerate(nodes)}
    first_use = min((position[u] for p in changed for u in p.users), default=len(nodes))
    moved = moved_constraints(constraints, reuse.constraints)
    first_use = min([first_use] + [i for i, n in enumerate(nodes) if n.name in moved])
    # a slice decided at a matmul that runs again is decided again: its chain runs again too
    by_name = {n.name: i for i, n in enumerate(nodes)}
    first_use = min([first_use] + [by_name[m.chain[0]] for m in reuse.matched_slices.values()
                                   if by_name[m.consumer] >= first_use])
    prefix = [n for n in nodes[:first_use] if n not in changed and n in reuse.env]
    return {n: reuse.env[n] for n in prefix}, reuse.prefix({n.name for n in prefix})


def moved_constraints(constraints: dict, before: dict) -> set[str]:
    return {name for name in set(constraints) | set(before) if constraints.get(name) != before.get(name)}


class Rejoin:
    """Follows a re-propagation node by node; :meth:`after` says when it has rejoined its base."""

    def __init__(self, gm: fx.GraphModule, base, constraints: dict):
        self.base = base
        self.nodes = list(gm.graph.nodes)
        self.position = {n: i for i, n in enumerate(self.nodes)}
        self.expiring: dict[int, list[fx.Node]] = {}     # position -> the values last read there
        for node in self.nodes:
            if node.users:
                last = max(self.position[u] for u in node.users)
                self.expiring.setdefault(last, []).append(node)
        by_name = {n.name: i for i, n in enumerate(self.nodes)}
        # no rejoining before an activation whose placement moved has been placed, nor inside a slice the
        # base matched (its chain's placements are decided at its matmul)
        self.earliest = max([by_name[name] for name in moved_constraints(constraints, base.constraints)
                             if name in by_name], default=-1)
        self.slices = [(by_name[m.chain[0]], by_name[m.consumer]) for m in base.matched_slices.values()]
        self.complete = all(n in base.env for n in self.nodes[:-1])    # (else there is nothing to take)
        self.differing: set[fx.Node] = set()

    def after(self, node: fx.Node, value) -> bool:
        """Record ``node``'s value; True when no value still to be read differs from the base's, so that
        the base holds from the next node on."""
        at = self.position[node]
        if node.users and not _same(value, self.base.env.get(node)):
            self.differing.add(node)
        for read in self.expiring.get(at, ()):
            self.differing.discard(read)
        return (self.complete and not self.differing and self.earliest < at < len(self.nodes) - 2
                and not any(start <= at < end for start, end in self.slices))

    def rest(self, node: fx.Node) -> list[fx.Node]:
        """The nodes after ``node``, but the output."""
        return self.nodes[self.position[node] + 1:-1]


def _same(value, base) -> bool:
    if value is base:
        return True
    key = value_key(value)
    return key is not None and key == value_key(base)

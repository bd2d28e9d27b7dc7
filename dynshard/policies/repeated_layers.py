"""Trial decisions taken once for a model's repeated layers.

The ``tp`` policy judges each group of parameters by a trial propagation, and each trial re-propagates the
graph from that group to the end: on an L-layer model the column pass costs O(L^2) in propagated nodes
(about a second per layer at d 1024, most of a 32-layer model's planning). A transformer's layers are
alike, so a decision is tied: the group at the same place in a later layer (its parameter names equal
once layer indices are masked, ``blocks.#.attn.q.weight``) takes the decision its first two occurrences
agreed on, without a trial. One propagation at the end checks the tied decisions together against the
rule each trial applies (at most one all-reduce per accepted group, nothing else); when it fails they are
undone and tried one by one, as before. Two occurrences, not one: the first layer reads the embedding's
output and may differ from the rest.
"""

from __future__ import annotations

import re
from collections import defaultdict

_INDEX = re.compile(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)")

Group = list[tuple[str, int]]


def layer_pattern(name: str) -> str:
    """``blocks.3.attn.q.weight`` -> ``blocks.#.attn.q.weight`` (every numeric path part masked)."""
    return _INDEX.sub("#", name)


class TiedDecisions:
    """The outcomes of trials by group signature, and the groups that were given one without a trial."""

    def __init__(self) -> None:
        self._outcomes: dict[tuple, list[frozenset]] = defaultdict(list)
        self.tied: list[Group] = []       # groups split by a tied decision, in order

    @staticmethod
    def signature(group: Group) -> tuple:
        return tuple((layer_pattern(name), dim) for name, dim in group)

    def record(self, group: Group, split: Group) -> None:
        """A trial's outcome for ``group``: the members it left split (empty: none)."""
        if any(layer_pattern(name) != name for name, _ in group):      # only groups inside numbered layers
            self._outcomes[self.signature(group)].append(frozenset(layer_pattern(name) for name, _ in split))

    def decision(self, group: Group) -> Group | None:
        """The members of ``group`` to split without a trial (possibly none), or None when no decision is
        tied yet (fewer than two earlier occurrences, or they disagreed)."""
        outcomes = self._outcomes.get(self.signature(group), [])
        if len(outcomes) < 2 or outcomes[0] != outcomes[1] or any(layer_pattern(n) == n for n, _ in group):
            return None
        return [(name, dim) for name, dim in group if layer_pattern(name) in outcomes[0]]

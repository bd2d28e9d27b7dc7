"""What DTensor's propagation of a plan records (:mod:`.propagate_sharding` fills it): every node's placements,
the collectives and local re-shards the plan costs, and where it fell back. The policies, the cost model and
the rewrite read it."""

from __future__ import annotations

import dataclasses

from torch.distributed.tensor import Placement


@dataclasses.dataclass(frozen=True)
class Collective:
    node: str
    kind: str           # all_reduce, all_gather, reduce_scatter, all_to_all
    mesh_dim: str
    bytes: int
    # whether the backward spends one of the same bytes: Megatron's f/g pairs and sequence parallelism's
    # all-gather/reduce-scatter pairs do; the reduction of a scalar (a loss's sum and total weight over split
    # rows: its gradient is the same scalar on every rank) and a vocabulary-parallel loss's three all-reduces
    # of one value per row (its backward is local) do not
    mirrored: bool = True


@dataclasses.dataclass(frozen=True)
class LocalReshard:
    """An input that DTensor re-shards without communication (Replicate -> Shard) before an op."""

    node: str
    source: str         # the fx node whose value is re-sharded
    dst: tuple[Placement, ...]


@dataclasses.dataclass(frozen=True)
class MatchedSlice:
    """A whole value sliced locally (no communication) to the placements of a batched matmul's other,
    split operand: ``source`` is sliced for ``chain[0]`` only, and ``chain`` (ops that commute with the
    slice, ending with the fold of the batch dimensions) runs on the slice into ``consumer``."""

    source: str
    placements: tuple[Placement, ...]
    chain: tuple[str, ...]
    consumer: str


@dataclasses.dataclass
class Propagation:
    placements: dict[str, tuple[Placement, ...]]
    collectives: list[Collective]
    local_reshards: list[LocalReshard]
    fallbacks: dict[str, str]         # node name -> reason
    replicated_constants: set[str]    # nodes producing plain tensors that become Replicate DTensors
    reduced_partials: set[str]        # nodes whose Partial outputs are all-reduced right away
    input_placements: tuple = ()
    vocab_parallel_losses: set[str] = dataclasses.field(default_factory=set)  # fused log_softmax+nll nodes
    constraints: dict = dataclasses.field(default_factory=dict)   # the activation placements propagated
    matched_slices: dict[str, MatchedSlice] = dataclasses.field(default_factory=dict)  # by chain[0]
    drawn_whole: set[str] = dataclasses.field(default_factory=set)   # random ops drawn whole, sliced (random_draws)
    replayed_layers: int = dataclasses.field(default=0, compare=False)   # layers taken from an earlier one (layer_memo)
    env: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)  # fx node -> fake value
    placed: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)  # values placed for some readers

    def prefix(self, names: set[str]) -> "Propagation":
        """What this propagation recorded for the nodes called ``names`` only."""
        return Propagation(
            {n: p for n, p in self.placements.items() if n in names},
            [c for c in self.collectives if c.node in names],
            [r for r in self.local_reshards if r.node in names],
            {n: r for n, r in self.fallbacks.items() if n in names},
            self.replicated_constants & names, self.reduced_partials & names,
            vocab_parallel_losses=self.vocab_parallel_losses & names,
            matched_slices={n: m for n, m in self.matched_slices.items() if m.consumer in names},
            drawn_whole=self.drawn_whole & names)

    def followed_by(self, later: "Propagation") -> "Propagation":
        """This propagation's records, then ``later``'s (of the nodes after these)."""
        return dataclasses.replace(
            self, placements={**self.placements, **later.placements},
            collectives=self.collectives + later.collectives,
            local_reshards=self.local_reshards + later.local_reshards,
            fallbacks={**self.fallbacks, **later.fallbacks},
            replicated_constants=self.replicated_constants | later.replicated_constants,
            reduced_partials=self.reduced_partials | later.reduced_partials,
            vocab_parallel_losses=self.vocab_parallel_losses | later.vocab_parallel_losses,
            matched_slices={**self.matched_slices, **later.matched_slices},
            drawn_whole=self.drawn_whole | later.drawn_whole)

    def comm_bytes(self) -> int:
        return sum(c.bytes for c in self.collectives)

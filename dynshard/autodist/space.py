"""The plans autodist chooses among: what dynshard's policies execute, inside ``plan_ngpus`` ranks a unit.

A candidate is a placement policy (how a unit of ``plan_ngpus`` ranks splits the graph), a ZeRO level over
the data-parallel units, and a recompute choice. The placements come from the policies themselves, so the
plans of ``tp`` (with and without sequence parallelism), ``data`` and ``dp`` are candidates as those policies
make them; ZeRO levels and recompute change no placement and are applied to a planned candidate
(:func:`with_choices`). The data-parallel degree across units is the user's (their sampler fixes it).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch.fx as fx

from ..config import Config
from ..config.pins import pin_of
from ..passes.propagation import Propagation
from ..planning import ActivationChoice, Plan, encode_placement
from ..planning.plan import ZeroChoice
from ..policies.megatron import sequence_parallel_activations
from ..policies.repeated_layers import layer_pattern

ZERO_LEVELS = (0, 1, 2, 3)
WHOLE_KINDS = 4             # kinds of split layers up to which every subset left whole is a candidate


@dataclasses.dataclass(frozen=True)
class Placement:
    """How a unit splits the graph: a built-in policy, its pas_config, and parameter patterns it leaves whole
    (pins after the user's own)."""
    name: str
    policy: str
    pas_config: tuple[tuple[str, object], ...] = ()
    whole: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()     # a tp variant's kinds of layer whole or on batch shards (:func:`tp_variants`)

    def config(self, user: Config, zero: int, recompute: str) -> Config:
        pins = dict(user.partition_constraints)
        for pattern in self.whole:
            pins.setdefault(pattern, "replicate")
        return dataclasses.replace(user, policy=self.policy, pas_config=dict(self.pas_config), use_zero=zero,
                                   recompute_modules=recompute, load_plan_path=None, save_plan_path=None,
                                   partition_constraints=pins)


SEQUENCE_PARALLEL = Placement("tp + sequence parallel", "tp", (("sequence_parallel", True),))
BATCH_PARALLEL = Placement("tp + batch parallel", "tp", (("batch_parallel", True),))
PER_OP = Placement("tp, placed per op", "tp")     # the per-op ILP's plan (autodist.op_placement)
PER_OP_FITTING = Placement("tp, placed per op within mem_constraint", "tp")     # (the same, with its memory row)


@dataclasses.dataclass(frozen=True)
class Candidate:
    placement: Placement
    zero: int
    recompute: tuple[str, ...]

    @property
    def name(self) -> str:
        parts = [self.placement.name]
        if self.zero:
            parts.append(f"ZeRO-{self.zero}")
        if self.recompute:
            parts.append(f"recompute {','.join(self.recompute)}")
        return " + ".join(parts)


def placements(config: Config) -> list[Placement]:
    """The ways a unit of ``config.plan_ngpus`` ranks splits the graph (each over the whole unit: under a
    ``max_partition_degree`` below it they are costed, for the pipelines' stages, but not candidates)."""
    if config.plan_ngpus == 1:
        return [Placement("dp", "dp")]
    return [Placement("tp", "tp"), SEQUENCE_PARALLEL, Placement("data", "data"), context_parallel(config.plan_ngpus)]


def context_parallel(ranks: int) -> Placement:
    """The sequence split over the unit's ranks (the tp policy's ``context_parallel``): a candidate where the
    graph's sequence divides as it needs (else its policy refuses it, and it is not one)."""
    return Placement("context parallel", "tp", (("context_parallel", ranks),))


def tp_variants(tp: Plan) -> list[Placement]:
    """The tp policy with some kinds of the layers it splits left whole: per kind, a repeated layer's sibling
    modules whose weights it splits by columns (``blocks.*.attn.{k,q,v}``, ``blocks.*.fc1``, the vocabulary
    ``wte``), tied across the layers. Pinning a pair's column side whole leaves its row side whole too (it no
    longer reads a split activation), so each variant keeps those kinds' matmuls and collectives off the tp
    ranks: fewer collectives for more memory and compute, a choice between tp's and data's, made per kind.
    Every proper subset of up to ``WHOLE_KINDS`` kinds (6 variants for a GPT's vocabulary, attention and MLP),
    one kind at a time beyond; none when tp splits one kind only (its variant would split nothing)."""
    kinds: dict[str, set[str]] = {}
    for split in ("S0", "S1"):      # (a row side joins the kind of its column side: the modules' parent)
        for name, choice in tp.tensors.items():
            if choice.kind == "parameter" and choice.tp == split:
                pattern = layer_pattern(name).replace("#", "*")
                kind = pattern.rpartition(".")[0].rpartition(".")[0]
                if split == "S0" or kind in kinds:
                    kinds.setdefault(kind, set()).add(pattern)
    if len(kinds) < 2:
        return []
    labels = {kind: _kind_label(kind, patterns) for kind, patterns in kinds.items()}
    sizes = range(1, len(kinds)) if len(kinds) <= WHOLE_KINDS else (1,)
    return [Placement(f"tp, {' and '.join(labels[k] for k in subset)} whole", "tp", (),
                      tuple(sorted(p for k in subset for p in kinds[k])), subset)
            for size in sizes for subset in itertools.combinations(sorted(kinds), size)]


def _kind_label(kind: str, patterns: set[str]) -> str:
    modules = sorted({p.rpartition(".")[0] for p in patterns})
    leaves = [m.rpartition(".")[2] for m in modules]
    return modules[0] if len(modules) == 1 else f"{kind + '.' if kind else ''}{{{','.join(leaves)}}}"


def left_whole(tp: Plan, variant: Placement) -> Plan | None:
    """tp's plan with ``variant``'s parameters whole: what the tp policy makes with them pinned, read off its
    plan instead of planned again (None: the plan places activations, which an edit could strand)."""
    if tp.activations:
        return None
    whole = dict.fromkeys(variant.whole, "R")
    return dataclasses.replace(tp, tensors={name: dataclasses.replace(t, tp="R") if pin_of(name, whole) else t
                                            for name, t in tp.tensors.items()})


def on_batch_shards(variant: Placement) -> Placement:
    """``variant`` (tp with some kinds whole) with the activations between split layers split along the batch:
    the kinds left whole run on the unit's batch shards (data parallelism for them, tp for the rest)."""
    return Placement(variant.name.removesuffix(" whole") + " on batch shards", "tp", (("batch_parallel", True),),
                     variant.whole, variant.kinds)


def with_sequence_parallel(tp: Plan, graph: fx.Graph, propagation: Propagation, tp_size: int,
                           keys: dict[str, str], dim: int = -2) -> Plan | None:
    """tp's plan with Megatron's sequence parallelism (along the batch: ``dim`` 0), as the tp policy places it
    with ``sequence_parallel`` (``batch_parallel``) on tp's own placements, read off tp's propagated ``graph``
    (node ``keys`` by name) instead of planned again (None: tp's plan places activations already)."""
    if tp.activations:
        return None
    activations = {keys[node.name]: ActivationChoice(encode_placement(placement), None if readers is None else
                                                     tuple(keys[r.name] for r in readers))
                   for node, placement, readers in sequence_parallel_activations(graph, propagation, tp_size, dim)}
    return dataclasses.replace(tp, activations=activations)


def zero_levels(dp: int) -> tuple[int, ...]:
    return ZERO_LEVELS if dp > 1 else (0,)


def recompute_choices(config: Config, repeated: str | None) -> list[tuple[str, ...]]:
    forced = config.autodist.recompute_modules
    if forced is not None:
        return [tuple(n.strip() for n in forced.split(",") if n.strip())]
    return [()] + ([(repeated,)] if repeated else [])


def with_choices(plan: Plan, zero: int, recompute: tuple[str, ...], reduce_scatter: bool, ngroups: int) -> Plan:
    """A plan planned at ZeRO level 1 (or 0 with one unit), at another ZeRO level and recompute choice."""
    tensors = {name: dataclasses.replace(t, dp="replicate") if t.dp == "zero" and zero == 0 else t
               for name, t in plan.tensors.items()}
    return dataclasses.replace(plan, zero=ZeroChoice(zero, ngroups, reduce_scatter), tensors=tensors,
                               recompute=recompute)

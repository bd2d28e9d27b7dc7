"""The plans autodist chooses among: what dynshard's policies execute, inside ``plan_ngpus`` ranks a unit.

A candidate is a placement policy (how a unit of ``plan_ngpus`` ranks splits the graph), a ZeRO level over
the data-parallel units, and a recompute choice. The placements come from the policies themselves, so the
plans of ``tp`` (with and without sequence parallelism), ``data`` and ``dp`` are candidates as those policies
make them; ZeRO levels and recompute change no placement and are applied to a planned candidate
(:func:`with_choices`). The data-parallel degree across units is the user's (their sampler fixes it).
"""

from __future__ import annotations

import dataclasses

from ...config import Config
from ...planning import Plan
from ...planning.plan import ZeroChoice

ZERO_LEVELS = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class Placement:
    """How a unit splits the graph: a built-in policy and its pas_config."""
    name: str
    policy: str
    pas_config: tuple[tuple[str, object], ...] = ()

    def config(self, user: Config, zero: int, recompute: str) -> Config:
        return dataclasses.replace(user, policy=self.policy, pas_config=dict(self.pas_config), use_zero=zero,
                                   recompute_modules=recompute, load_plan_path=None, save_plan_path=None)


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
    return [Placement("tp", "tp"), Placement("tp + sequence parallel", "tp", (("sequence_parallel", True),)),
            Placement("data", "data")]


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

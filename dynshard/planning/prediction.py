"""``Plan.predicted``: what a plan is predicted to cost, as one typed value.

- ``forward_collectives``: the forward collectives the sharding propagation found, by node key (every plan
  whose unit was propagated; a hybrid's keyed ``<stage>/<node key>``);
- ``op_placement``: the per-op placement ILP's solve, when the plan is its;
- ``cost``: the cost model's step seconds (compute, communication, bubble) and bytes per rank at the peak
  (autodist's plans; any plan made with a device profile);
- ``device_profile``: the profile a hand plan was priced with;
- ``autodist``: autodist's record: the choice, the solver's, every candidate it priced.

JSON (the plan's ``"predicted"``, null when nothing is predicted): the fields in that order, ``cost``'s
fields at the top level of the object (``"step_seconds"``, ..., ``"bytes_per_rank"``), as plan files have
always held them, so that a file written before this type reads back to the same bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

SECONDS = ("step_seconds", "compute_seconds", "communication_seconds", "tp_communication_seconds",
           "dp_communication_seconds")


@dataclasses.dataclass(frozen=True)
class ForwardCollective:
    """A forward collective of the propagated graph (``passes.propagation.Collective``), by node key."""

    at: str
    kind: str
    dim: str
    bytes: int
    mirrored: bool = True       # one of the same bytes in the backward (JSON: ``"mirrored": false`` only)

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.at, "kind": self.kind, "dim": self.dim, "bytes": self.bytes,
                **({} if self.mirrored else {"mirrored": False})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ForwardCollective":
        return cls(data["at"], data["kind"], data["dim"], data["bytes"], data.get("mirrored", True))


@dataclasses.dataclass(frozen=True)
class Collectives:
    count: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """Bytes per rank at the step's peak (a pipeline's: its busiest rank's), by what holds them."""

    parameters: int
    buffers: int
    gradients: int
    optimizer: int
    gathered: int
    activations: int
    transient: int
    peak: int

    def parts(self) -> dict[str, int]:
        """What the peak is made of, by name (every field but ``peak``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "peak"}


@dataclasses.dataclass(frozen=True)
class Cost:
    """The cost model's prediction of one step (``autodist.cost_model.predict``; a pipeline's,
    ``autodist.pipeline_costs.predict_pipeline``, also says ``shared_gradient_seconds`` and
    ``micro_batches_held``)."""

    step_seconds: float
    compute_seconds: float
    communication_seconds: float
    tp_communication_seconds: float
    dp_communication_seconds: float
    bubble_seconds: float
    tp_collectives_per_micro_batch: Collectives
    bytes_per_rank: RankMemory
    shared_gradient_seconds: float | None = None     # pipelines: the copies' gradient sum
    micro_batches_held: tuple[int, ...] | None = None    # pipelines: per pipeline rank

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in SECONDS}
        if self.shared_gradient_seconds is not None:
            out["shared_gradient_seconds"] = self.shared_gradient_seconds
        out["bubble_seconds"] = self.bubble_seconds
        out["tp_collectives_per_micro_batch"] = dataclasses.asdict(self.tp_collectives_per_micro_batch)
        if self.micro_batches_held is not None:
            out["micro_batches_held"] = list(self.micro_batches_held)
        out["bytes_per_rank"] = dataclasses.asdict(self.bytes_per_rank)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Cost":
        held = data.get("micro_batches_held")
        return cls(*(data[name] for name in SECONDS), data["bubble_seconds"],
                   Collectives(**data["tp_collectives_per_micro_batch"]), RankMemory(**data["bytes_per_rank"]),
                   data.get("shared_gradient_seconds"), None if held is None else tuple(held))


@dataclasses.dataclass(frozen=True)
class ProfileName:
    """A device profile as a plan names it: its name and the digest of its constants."""

    name: str
    digest: str


@dataclasses.dataclass(frozen=True)
class OpPlacementSolve:
    """The per-op placement ILP's solve (``autodist.op_placement``) of the plan it made."""

    solver: str
    status: str
    objective: float | None
    bound: float | None
    gap: float | None
    lp_integral: bool
    nodes: int
    reads: int
    held_bytes: int
    budget_bytes: int | None


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A plan autodist priced, as its record keeps it (a record made before the step was split into compute,
    communication and bubble, or before estimates were marked, reads them as None and writes them back
    without)."""

    plan: str
    step_seconds: float
    compute_seconds: float | None
    communication_seconds: float | None
    bubble_seconds: float | None
    peak_bytes: int
    fits: bool
    estimated: bool | None  # priced from other plans (a hybrid's stages from the tp plan, a variant from its parts)

    def to_dict(self) -> dict[str, Any]:
        return {name: value for name, value in dataclasses.asdict(self).items()
                if value is not None or name not in _LATER}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Candidate":
        return cls(**{f.name: data.get(f.name) if f.name in _LATER else data[f.name] for f in dataclasses.fields(cls)})


_LATER = ("compute_seconds", "communication_seconds", "bubble_seconds", "estimated")


@dataclasses.dataclass(frozen=True)
class AutodistRecord:
    """What autodist's search chose and how: the chosen candidate, the solve (an ILP's; pipelines: the
    enumeration's), its inputs, and every candidate it priced, by predicted step."""

    chosen: str
    solver: str
    status: str             # "optimal" when every ILP was solved to optimality, else "time limit"
    objective: float | None
    bound: float | None
    gap: float | None
    lp_integral: bool | None
    ilps: int
    objective_seconds: float
    mem_constraint_gb: float | None
    update_freq: int
    device_profile: ProfileName
    task_name: str | None
    candidates: tuple[Candidate, ...]

    def to_dict(self) -> dict[str, Any]:
        solve = {"objective": self.objective, "bound": self.bound, "gap": self.gap, "lp_integral": self.lp_integral}
        # (an ILP's solve names its status second, the enumeration's last: the order plan files have held)
        head = ({"chosen": self.chosen, "solver": self.solver, **solve, "status": self.status}
                if self.solver.startswith("enumeration") else
                {"chosen": self.chosen, "solver": self.solver, "status": self.status, **solve})
        return {**head, "ilps": self.ilps, "objective_seconds": self.objective_seconds,
                "mem_constraint_gb": self.mem_constraint_gb, "update_freq": self.update_freq,
                "device_profile": dataclasses.asdict(self.device_profile), "task_name": self.task_name,
                "candidates": [c.to_dict() for c in self.candidates]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "AutodistRecord":
        fields = {f.name for f in dataclasses.fields(cls)} - {"device_profile", "candidates"}
        return cls(**{name: data[name] for name in fields}, device_profile=ProfileName(**data["device_profile"]),
                   candidates=tuple(Candidate.from_dict(c) for c in data["candidates"]))


@dataclasses.dataclass(frozen=True)
class Prediction:
    """``Plan.predicted`` (the module's docstring); ``Prediction()``: nothing predicted (JSON null)."""

    forward_collectives: tuple[ForwardCollective, ...] | None = None
    op_placement: OpPlacementSolve | None = None
    cost: Cost | None = None
    device_profile: ProfileName | None = None
    autodist: AutodistRecord | None = None

    def __post_init__(self) -> None:
        if self.forward_collectives is not None:
            object.__setattr__(self, "forward_collectives", tuple(self.forward_collectives))

    def __bool__(self) -> bool:
        return self != EMPTY

    @property
    def collectives(self) -> tuple[ForwardCollective, ...]:
        """The forward collectives, none when the plan's unit was not propagated."""
        return self.forward_collectives or ()

    def to_dict(self) -> dict[str, Any] | None:
        if not self:
            return None
        out: dict[str, Any] = {}
        if self.forward_collectives is not None:
            out["forward_collectives"] = [c.to_dict() for c in self.forward_collectives]
        if self.op_placement is not None:
            out["op_placement"] = dataclasses.asdict(self.op_placement)
        if self.cost is not None:
            out.update(self.cost.to_dict())
        if self.device_profile is not None:
            out["device_profile"] = dataclasses.asdict(self.device_profile)
        if self.autodist is not None:
            out["autodist"] = self.autodist.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "Prediction":
        """The value of a plan's ``"predicted"`` JSON (a mapping; None: nothing predicted)."""
        if data is None:
            return EMPTY
        known = {"forward_collectives", "op_placement", "device_profile", "autodist", *SECONDS, "bubble_seconds",
                 "shared_gradient_seconds", "tp_collectives_per_micro_batch", "micro_batches_held", "bytes_per_rank"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"predicted has no key {unknown[0]!r} (it holds {', '.join(sorted(known))})")
        found = data.get("forward_collectives")
        solve, profile, record = data.get("op_placement"), data.get("device_profile"), data.get("autodist")
        return cls(forward_collectives=None if found is None else tuple(ForwardCollective.from_dict(c) for c in found),
                   op_placement=None if solve is None else OpPlacementSolve(**solve),
                   cost=Cost.from_dict(data) if "step_seconds" in data else None,
                   device_profile=None if profile is None else ProfileName(**profile),
                   autodist=None if record is None else AutodistRecord.from_dict(record))


EMPTY = Prediction()

"""``dynshard.Plan``: every decision that shapes the per-rank programs of one captured graph, as one value.

A policy makes it (or a plan file gives it); the backend executes it. It says:

- ``mesh``: the factorisation of the world into dp x pp x tp (a plan unit is pp x tp ranks);
- ``zero``: the ZeRO level, its groups and whether gradients are reduce-scattered;
- ``tensors``: per parameter, buffer and user input (parameters and buffers by fully qualified name), its
  shape, its placement on the unit's tensor-parallel ranks (``tp``) and over the data-parallel units
  (``dp``: "replicate", "zero" rows, or "batch" for user inputs, each unit its own);
- ``activations``: values the policy placed, keyed by module path, op and occurrence
  (:mod:`.node_keys`), so that a key survives a re-trace; a placement holds for the listed readers only
  where readers differ;
- ``recompute``: module class names or paths whose activations are recomputed in the backward;
- ``mixed_precision``: the compute and reduction dtypes;
- ``pipeline``: the stage cut (where each stage after the first starts), schedule, micro-batches, chunks
  and the pipeline ranks that run each stage;
- ``made_for``: the graph, input shapes and world it fits (checked when a plan is loaded);
- ``predicted``: what the plan is predicted to cost (:class:`.prediction.Prediction`: the forward
  collectives the propagation found, the cost model's step and peak, autodist's record).

JSON schema (``to_json``; version 1). Keys appear in this order, a tensor or activation per line::

    {"dynshard_plan": 1,
     "made_for": {"graph": "<sha256 of the captured graph's code, 16 hex>", "world_size": 4,
                  "modes": "grad=True autocast=off default_dtype=torch.float32"},
     "policy": "tp",
     "mesh": {"world": 4, "dp": 2, "pp": 1, "tp": 2},
     "zero": {"level": 1, "ngroups": 1, "reduce_scatter": false},
     "tensors": {"<fqn>": {"kind": "parameter", "shape": [64, 32], "dtype": "float32", "tp": "S0", "dp": "zero"}},
                 (pipelines: also "stages": [0, 3], the stages that read it; "tp": null under hybrid, where
                 each stage's tp policy places its tensors when the stage compiles)
     "activations": {"<module path>:<op>:<occurrence>": {"tp": "R", "readers": ["<key>", ...] or null}},
     "recompute": ["Block"],
     "mixed_precision": null or {"param_dtype": "bfloat16", "reduce_dtype": "float32", ...},
     "pipeline": null or {"schedule": "1f1b", "nmicros": 4, "nstages": 2, "nchunks": 1,
                          "starts": ["layers.2"], "stage_ranks": [[0], [1]], "how": "...", "flops": [..],
                          "sequence_parallel": false},
     "predicted": null or {"forward_collectives": [...], "step_seconds": ..., "bytes_per_rank": {...}, ...}}
                  (:mod:`.prediction` has its keys)

Placements: "R" (whole), "S<d>" (split along dim d), "S<d>x<b>" (a fused tensor split block by block, b
blocks), "P<op>" (a partial value). A ``starts`` entry is a node key or a bare module path (the stage starts
at that module's first op), so that a boundary can be moved by hand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from types import MappingProxyType
from typing import Any, Mapping

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from ..compat import StridedShard
from ..config.pipeline import INFERENCE_SCHEDULES, TRAINING_SCHEDULES, broken_schedule_rule
from .prediction import EMPTY, Prediction


PLAN_VERSION = 1
DP_CHOICES = ("replicate", "zero", "batch")
STAGE_SEPARATOR = "/"       # a hybrid stage's activation and collective keys: "<stage>/<node key>"


class PlanFileError(ValueError):
    """A plan that cannot be read, or that was made for another graph, input shapes or world."""


@dataclasses.dataclass(frozen=True)
class MeshShape:
    world: int
    dp: int
    pp: int
    tp: int

    @property
    def plan_ngpus(self) -> int:
        return self.pp * self.tp


@dataclasses.dataclass(frozen=True)
class ZeroChoice:
    level: int = 0
    ngroups: int = 1
    reduce_scatter: bool = False


@dataclasses.dataclass(frozen=True)
class TensorChoice:
    kind: str                       # "parameter", "buffer", "input" or "size" (a symbolic size)
    shape: tuple[int | str, ...]    # a symbolic dimension by its symbol ("d0"): the plan serves every size
    dtype: str
    tp: str | None = "R"            # its placement on the unit's tp ranks (None: by its pipeline stage's tp policy)
    dp: str = "replicate"           # over the data-parallel units: "replicate", "zero" rows, "batch"
    stages: tuple[int, ...] | None = None   # pipelines: the stages that read it

    @classmethod
    def of(cls, inp: Any, tp: str | None = "R", dp: str | None = None,
           stages: tuple[int, ...] | None = None) -> "TensorChoice":
        """A graph input's (``runtime.graph_inputs.GraphInput``) choice; ``dp`` None: "batch" for a user
        input, else "replicate"."""
        dp = dp if dp is not None else "batch" if inp.kind == "input" else "replicate"
        return cls(inp.kind, inp.family_shape(), str(inp.dtype).replace("torch.", ""), tp, dp, stages)


@dataclasses.dataclass(frozen=True)
class ActivationChoice:
    tp: str
    readers: tuple[str, ...] | None = None     # node keys of the readers it holds for (None: every reader)


@dataclasses.dataclass(frozen=True)
class PipelineChoice:
    schedule: str
    nmicros: int
    nstages: int
    nchunks: int
    starts: tuple[str, ...]         # where stages 1.. start: node keys or module paths
    stage_ranks: tuple[tuple[int, ...], ...]
    how: str = ""
    flops: tuple[int, ...] = ()
    sequence_parallel: bool = False

    def check(self, mesh: MeshShape, zero_level: int) -> None:
        """What a hand edit can break: the schedule, the counts and the ranks they need."""
        if self.schedule not in TRAINING_SCHEDULES + INFERENCE_SCHEDULES:
            raise PlanFileError(f"dynshard: the plan's pipeline schedule {self.schedule!r} is not one of "
                                f"{', '.join(TRAINING_SCHEDULES + INFERENCE_SCHEDULES)}")
        if min(self.nmicros, self.nstages, self.nchunks) < 1 or self.nstages % self.nchunks:
            raise PlanFileError(f"dynshard: the plan's pipeline has nmicros={self.nmicros}, nstages={self.nstages}, "
                                f"nchunks={self.nchunks}; each must be positive and nchunks must divide nstages")
        if self.nstages // self.nchunks != mesh.pp:
            raise PlanFileError(f"dynshard: the plan's pipeline runs {self.nstages} stages of {self.nchunks} chunk(s) "
                                f"per rank on {self.nstages // self.nchunks} pipeline ranks, but its mesh has pp={mesh.pp}")
        broken = broken_schedule_rule(self.schedule, self.nstages, self.nmicros, self.nchunks, zero_level)
        if broken is not None:
            raise PlanFileError(f"dynshard: the plan's pipeline breaks a rule of its schedule: {broken}")

    @property
    def all_device_first(self) -> bool:
        """1f1b_plus: the graph's first segment runs tensor parallel on every rank of the unit."""
        return self.schedule == "1f1b_plus"

    @property
    def nsegments(self) -> int:
        """The graphs the captured graph is cut into: the stages, and 1f1b_plus's all-device segment."""
        return self.nstages + int(self.all_device_first)


@dataclasses.dataclass(frozen=True)
class MadeFor:
    graph: str
    world_size: int
    modes: str


@dataclasses.dataclass(frozen=True)
class Plan:
    made_for: MadeFor | None           # None: a stage program's plan inside a pipeline
    policy: str
    mesh: MeshShape
    zero: ZeroChoice
    tensors: Mapping[str, TensorChoice]
    activations: Mapping[str, ActivationChoice] = dataclasses.field(default_factory=dict)
    recompute: tuple[str, ...] = ()
    mixed_precision: Mapping[str, Any] | None = None
    pipeline: PipelineChoice | None = None
    predicted: Prediction = EMPTY        # (None or a mapping of its JSON given: read as one)
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))
        object.__setattr__(self, "activations", MappingProxyType(dict(self.activations)))
        if self.mixed_precision is not None:
            object.__setattr__(self, "mixed_precision", MappingProxyType(dict(self.mixed_precision)))
        if not isinstance(self.predicted, Prediction):
            object.__setattr__(self, "predicted", Prediction.from_dict(self.predicted))

    # -- editing --------------------------------------------------------------------------------------
    def with_tensor(self, name: str, **changes: Any) -> "Plan":
        """This plan with ``name``'s choice changed (``tp="R"``, ``dp="replicate"``, ...)."""
        if name not in self.tensors:
            raise KeyError(f"dynshard: the plan has no tensor {name!r}")
        return dataclasses.replace(self, tensors={**self.tensors, name: dataclasses.replace(self.tensors[name], **changes)})

    def digest(self) -> str:
        """A short hash of the plan's decisions (not of its predictions)."""
        decisions = dataclasses.replace(self, predicted=EMPTY)
        return hashlib.sha256(decisions.to_json().encode()).hexdigest()[:16]

    def __reduce__(self):
        """Pickled as its JSON (mapping proxies do not pickle), so that plans and the reports that hold them
        travel between processes."""
        return (_plan_from_json, (self.to_json(),))

    # -- JSON -----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "dynshard_plan": self.version,
            "made_for": None if self.made_for is None else dataclasses.asdict(self.made_for),
            "policy": self.policy,
            "mesh": dataclasses.asdict(self.mesh),
            "zero": dataclasses.asdict(self.zero),
            "tensors": {name: _tensor_dict(t) for name, t in self.tensors.items()},
            "activations": {key: {"tp": a.tp, "readers": None if a.readers is None else list(a.readers)}
                            for key, a in self.activations.items()},
            "recompute": list(self.recompute),
            "mixed_precision": None if self.mixed_precision is None else dict(self.mixed_precision),
            "pipeline": None if self.pipeline is None else _pipeline_dict(self.pipeline),
            "predicted": self.predicted.to_dict(),
        }

    def to_json(self) -> str:
        """The plan as JSON text: stable key order, one tensor per line, byte-identical for equal plans."""
        return format_json(self.to_dict()) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "the plan text") -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanFileError(f"dynshard: {source} is not valid JSON ({error}); it is not a dynshard plan "
                                "or it was cut short") from None
        return cls.from_dict(data, source)

    @classmethod
    def from_dict(cls, data: Any, source: str = "the plan") -> "Plan":
        if not isinstance(data, dict) or "dynshard_plan" not in data:
            raise PlanFileError(f"dynshard: {source} is not a dynshard plan (no 'dynshard_plan' version key)")
        if data["dynshard_plan"] != PLAN_VERSION:
            raise PlanFileError(f"dynshard: {source} is a version {data['dynshard_plan']!r} plan; this dynshard "
                                f"reads version {PLAN_VERSION}. Make the plan again with this version")
        try:
            tensors = {name: _tensor(name, t) for name, t in data["tensors"].items()}
            activations = {key: ActivationChoice(_placement_text(a["tp"], key),
                                                 None if a.get("readers") is None else tuple(a["readers"]))
                           for key, a in data.get("activations", {}).items()}
            pipeline = data.get("pipeline")
            made_for = data["made_for"]
            plan = cls(made_for=None if made_for is None else MadeFor(**made_for), policy=str(data["policy"]), mesh=MeshShape(**data["mesh"]),
                       zero=ZeroChoice(**data["zero"]), tensors=tensors, activations=activations,
                       recompute=tuple(data.get("recompute", ())), mixed_precision=data.get("mixed_precision"),
                       pipeline=None if pipeline is None else _pipeline(pipeline), predicted=data.get("predicted"))
        except PlanFileError as error:
            raise PlanFileError(f"dynshard: {source}: {error}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise PlanFileError(f"dynshard: {source} is not a well-formed dynshard plan ({type(error).__name__}: "
                                f"{error}); see dynshard.planning.plan for the schema") from None
        plan.check()
        return plan

    def check(self) -> None:
        """The plan's own consistency (a hand edit that cannot work)."""
        mesh = self.mesh
        if min(mesh.world, mesh.dp, mesh.pp, mesh.tp) < 1 or mesh.dp * mesh.pp * mesh.tp != mesh.world:
            raise PlanFileError(f"dynshard: the plan's mesh dp={mesh.dp} x pp={mesh.pp} x tp={mesh.tp} is not its "
                                f"world of {mesh.world} ranks")
        if self.zero.level not in (0, 1, 2, 3):
            raise PlanFileError(f"dynshard: the plan's zero level must be 0-3, got {self.zero.level!r}")
        if not isinstance(self.zero.ngroups, int) or self.zero.ngroups < 1 or mesh.dp % self.zero.ngroups:
            raise PlanFileError(f"dynshard: the plan's zero ngroups={self.zero.ngroups!r} does not divide its "
                                f"dp={mesh.dp} units")
        if self.pipeline is not None:
            self.pipeline.check(mesh, self.zero.level)
        for name, tensor in self.tensors.items():
            if tensor.dp not in DP_CHOICES:
                raise PlanFileError(f"dynshard: tensor {name!r} has dp {tensor.dp!r}; use one of {', '.join(DP_CHOICES)}")
            if tensor.dp == "zero" and not self.zero.level:
                raise PlanFileError(f"dynshard: tensor {name!r} is split over dp ('zero') but the plan's zero level is 0")
            placement = None if tensor.tp is None else decode_placement(tensor.tp)
            if isinstance(placement, Shard) and not -len(tensor.shape) <= placement.dim < len(tensor.shape):
                raise PlanFileError(f"dynshard: tensor {name!r} of shape {list(tensor.shape)} cannot be split "
                                    f"along dim {placement.dim}")


_DEVICE = re.compile(r"device\(type='[a-z_]+'(?:, index=\d+)?\)|device='[a-z_]+(?::\d+)?'|device = '[a-z_]+(?::\d+)?'")


def fingerprint(code: str, world_size: int, modes: str) -> MadeFor:
    """What a plan is made for. The graph's code is hashed without its device constants (``torch.arange(T,
    device=idx.device)`` bakes the device in): a plan made on the meta device, or on CPU for a GPU job, fits."""
    graph = hashlib.sha256(_DEVICE.sub("device(...)", code).encode()).hexdigest()[:16]
    return MadeFor(graph=graph, world_size=world_size, modes=modes)


def first_mismatch(plan: Plan, made_for: MadeFor, tensors: Mapping[str, TensorChoice]) -> str | None:
    """What differs first between what ``plan`` was made for and this graph (None: it fits)."""
    if plan.made_for is None:
        return "it is a pipeline stage's plan, not a graph's"
    if plan.made_for.world_size != made_for.world_size:
        return f"it was made for {plan.made_for.world_size} ranks and this job has {made_for.world_size}"
    planned, here = list(plan.tensors.items()), list(tensors.items())
    for (name, mine), (other, theirs) in zip(planned, here):
        if name != other or mine.kind != theirs.kind:
            return (f"its graph input #{planned.index((name, mine))} is {mine.kind} {name!r} and this graph's is "
                    f"{theirs.kind} {other!r} (another model or code path)")
        if (tuple(mine.shape), mine.dtype) != (tuple(theirs.shape), theirs.dtype):
            return (f"{mine.kind} {name!r} is {list(mine.shape)} {mine.dtype} in the plan and "
                    f"{list(theirs.shape)} {theirs.dtype} here")
    if len(planned) != len(here):
        return f"it has {len(planned)} graph inputs and this graph has {len(here)} (another model or code path)"
    if plan.made_for.modes != made_for.modes:
        return f"it was made under {plan.made_for.modes} and this graph runs under {made_for.modes}"
    if plan.made_for.graph != made_for.graph:
        return (f"its graph's code hash is {plan.made_for.graph} and this graph's is {made_for.graph} (the same "
                "inputs, other code: the model or dynshard changed)")
    return None


# -- placements as text ---------------------------------------------------------------------------------
def encode_placement(placement: Placement) -> str:
    kind = type(placement)      # (issubclass: torch's isinstance on placements is slow when it misses)
    if issubclass(kind, StridedShard):
        return f"S{placement.dim}x{placement.split_factor}"
    if issubclass(kind, Shard):
        return f"S{placement.dim}"
    if issubclass(kind, Partial):
        return f"P{placement.reduce_op}"
    if issubclass(kind, Replicate):
        return "R"
    raise ValueError(f"dynshard: cannot store placement {placement}")


def decode_placement(text: str) -> Placement:
    try:
        if text == "R":
            return Replicate()
        if text.startswith("S") and "x" in text:
            dim, blocks = text[1:].split("x")
            return StridedShard(int(dim), split_factor=int(blocks))
        if text.startswith("S"):
            return Shard(int(text[1:]))
        if text.startswith("P") and len(text) > 1:
            return Partial(text[1:])
    except ValueError:
        pass
    raise PlanFileError(f"{text!r} is not a placement (use 'R', 'S<dim>', 'S<dim>x<blocks>' or 'P<op>')")


def _placement_text(text: Any, where: str) -> str:
    if not isinstance(text, str):
        raise PlanFileError(f"{where}: placement {text!r} is not a string")
    decode_placement(text)
    return text


def _tensor(name: str, data: Mapping[str, Any]) -> TensorChoice:
    return TensorChoice(kind=str(data["kind"]), shape=tuple(_size(s) for s in data["shape"]), dtype=str(data["dtype"]),
                        tp=None if data.get("tp", "R") is None else _placement_text(data["tp"], f"tensor {name!r}"),
                        dp=str(data.get("dp", "replicate")),
                        stages=None if data.get("stages") is None else tuple(int(s) for s in data["stages"]))


def _size(size: Any) -> int | str:
    """A dimension of a plan's tensor: a size, or a symbol ("d0")."""
    return size if isinstance(size, str) else int(size)


def _tensor_dict(t: TensorChoice) -> dict[str, Any]:
    data = {"kind": t.kind, "shape": list(t.shape), "dtype": t.dtype, "tp": t.tp, "dp": t.dp}
    if t.stages is not None:
        data["stages"] = list(t.stages)
    return data


def _pipeline_dict(p: PipelineChoice) -> dict[str, Any]:
    return {"schedule": p.schedule, "nmicros": p.nmicros, "nstages": p.nstages, "nchunks": p.nchunks,
            "starts": list(p.starts), "stage_ranks": [list(r) for r in p.stage_ranks], "how": p.how,
            "flops": list(p.flops), "sequence_parallel": p.sequence_parallel}


def _pipeline(data: Mapping[str, Any]) -> PipelineChoice:
    return PipelineChoice(schedule=str(data["schedule"]), nmicros=int(data["nmicros"]), nstages=int(data["nstages"]),
                          nchunks=int(data.get("nchunks", 1)), starts=tuple(str(s) for s in data["starts"]),
                          stage_ranks=tuple(tuple(int(r) for r in ranks) for ranks in data.get("stage_ranks", ())),
                          how=str(data.get("how", "")), flops=tuple(int(f) for f in data.get("flops", ())),
                          sequence_parallel=bool(data.get("sequence_parallel", False)))


def format_json(value: Any, indent: int = 0, lead: int = 0, width: int = 150) -> str:
    """JSON text a person reads: a container that fits on its line (``lead``: what precedes it there) stays
    on it; else one entry per line."""
    compact = json.dumps(value, separators=(", ", ": "))
    if not isinstance(value, (dict, list)) or not value or indent + lead + len(compact) <= width:
        return compact
    pad, inner = " " * indent, " " * (indent + 2)
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {format_json(v, indent + 2, len(json.dumps(k)) + 2, width)}"
                 for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    items = [inner + format_json(v, indent + 2, 0, width) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + pad + "]"


# -- the plan and the configuration ------------------------------------------------------------------------
def mesh_of(layout: Any) -> MeshShape:
    """The factorisation a world layout (``runtime.mesh.Layout``) makes."""
    return MeshShape(world=layout.world_size, dp=layout.dp_size, pp=layout.pp_size, tp=layout.tp_size)


def _plan_from_json(text: str) -> Plan:
    return Plan.from_json(text, "a pickled plan")

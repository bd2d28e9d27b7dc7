"""What a plan costs, read from the plan alone: bytes per rank at rest and the collectives of a step.

Memory at rest, per rank (ZeRO's levels as dynshard runs them, docs/design.md "ZeRO rows"): a parameter
holds its tp shard, and its rows over its ZeRO group when the plan says "zero"; its gradient the same;
the optimizer state is Adam's two fp32 moments per element the rank updates (nnScaler's default model).
A tied tensor read by two pipeline stages is held by both stages' ranks. Parameters count as trainable.

Collectives per step, per rank, as payload bytes (what each rank puts in; a ring all-reduce moves about
twice that): the forward collectives the propagation predicted (``Plan.predicted.forward_collectives``;
a pipeline's, once per micro-batch),
and the data-parallel ones each parameter costs: an all-reduce of its gradient ("replicate"), or for ZeRO
rows an all-gather of the parameter (level 3: two, forward and backward) and a reduce-scatter of the
gradient (level 1 without ``reduce_scatter``: an all-reduce of the whole gradient instead).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter, defaultdict

import torch

from .plan import Plan, TensorChoice, decode_placement
from .prediction import ForwardCollective

ADAM_STATE_BYTES = 8         # two fp32 moments per element
ADAM_STEP_BYTES = 80         # moved per element updated: torch's foreach AdamW reads or writes the parameter, its
                             # gradient, both moments and a temporary 20 times (lerp_, mul_, addcmul_, mul_, sqrt,
                             # div_, add_, addcdiv_), 4 bytes each


@dataclasses.dataclass(frozen=True)
class RankBytes:
    ranks: str                  # which ranks of a unit ("all", "pipeline rank 1", ...)
    parameters: int
    buffers: int
    gradients: int
    optimizer: int
    exact: bool = True          # False: a hybrid stage's tensors counted whole (its tp placement comes later)

    @property
    def total(self) -> int:
        return self.parameters + self.buffers + self.gradients + self.optimizer


@dataclasses.dataclass(frozen=True)
class StepCollective:
    kind: str
    dim: str                    # mesh dimension: "tp", "dp" (or the ZeRO group)
    bytes: int                  # payload per rank per step
    count: int
    what: str


@functools.cache
def itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


@functools.cache
def _split_dim(tp: str) -> int | None:
    return getattr(decode_placement(tp), "dim", None)


def local_numel(plan: Plan, tensor: TensorChoice, rows: bool = True) -> tuple[int, bool]:
    """Elements this rank holds at rest (``rows``: of ZeRO's rows when the plan says "zero"; else the whole
    tp shard), and whether that is exact. (A search prices thousands of plans: no dataclass is copied here.)"""
    shape = list(tensor.shape)
    exact = tensor.tp is not None
    if tensor.tp is not None and plan.mesh.tp > 1:
        dim = _split_dim(tensor.tp)
        if dim is not None and shape:
            shape[dim] = math.ceil(shape[dim] / plan.mesh.tp)
    if rows and tensor.dp == "zero" and shape:
        group = plan.mesh.dp // plan.zero.ngroups
        shape[0] = math.ceil(shape[0] / group)
    return math.prod(shape), exact


def whole_bytes(plan: Plan, tensor: TensorChoice) -> int:
    """Bytes of this rank's tp shard of ``tensor`` before ZeRO splits it into rows (a replica)."""
    return local_numel(plan, tensor, rows=False)[0] * itemsize(tensor.dtype)


def gathered_replica_bytes(plan: Plan, tensor: TensorChoice) -> int:
    """Bytes of ``tensor``'s tp shard as ZeRO gathers it: in the dtype the program computes in."""
    return local_numel(plan, tensor, rows=False)[0] * compute_itemsize(plan, tensor)


def compute_itemsize(plan: Plan, tensor: TensorChoice) -> int:
    """A parameter's element in the program: mixed precision's ``param_dtype`` for a floating one (its ZeRO
    rows are cast before they are gathered, as FSDP2 does), else its own."""
    return _mixed_itemsize(plan, tensor, ("param_dtype",))


def reduced_itemsize(plan: Plan, tensor: TensorChoice) -> int:
    """A parameter's gradient element as it is reduced: ``reduce_dtype``, else ``param_dtype``, else its own."""
    return _mixed_itemsize(plan, tensor, ("reduce_dtype", "param_dtype"))


def _mixed_itemsize(plan: Plan, tensor: TensorChoice, fields: tuple[str, ...]) -> int:
    policy = plan.mixed_precision or {}
    if tensor.kind == "parameter" and getattr(torch, tensor.dtype).is_floating_point:
        for field in fields:
            if policy.get(field):
                return itemsize(str(policy[field]).removeprefix("torch."))
    return itemsize(tensor.dtype)


def memory_at_rest(plan: Plan) -> list[RankBytes]:
    """Bytes per rank at rest: one row for a plan unit's ranks alike, one per pipeline rank otherwise."""
    if plan.pipeline is None:
        return [_bytes_of(plan, list(plan.tensors.values()), "every rank")]
    rows = []
    for rank in range(plan.mesh.pp):
        stages = {s for s, ranks in enumerate(plan.pipeline.stage_ranks) if rank in ranks}
        held = [t for t in plan.tensors.values() if t.stages and stages & set(t.stages)]
        rows.append(_bytes_of(plan, held, f"pipeline rank {rank} (stages {', '.join(map(str, sorted(stages)))})"))
    return rows


def tensor_bytes(plan: Plan, tensor: TensorChoice) -> int:
    """What holding ``tensor`` at rest costs a rank: its shard, and for a parameter its gradient and Adam's
    state (the terms of :func:`memory_at_rest`)."""
    return _bytes_of(plan, [tensor], "").total


def _bytes_of(plan: Plan, tensors: list[TensorChoice], ranks: str) -> RankBytes:
    totals: dict[str, int] = defaultdict(int)
    exact = True
    for tensor, count in Counter(tensors).items():      # (a model's repeated layers: the same choices, costed once)
        if tensor.kind in ("input", "size"):
            continue
        numel, precise = local_numel(plan, tensor)
        numel *= count
        exact &= precise
        size = numel * itemsize(tensor.dtype)
        if tensor.kind == "buffer":
            totals["buffers"] += size
            continue
        totals["parameters"] += size
        totals["gradients"] += size
        totals["optimizer"] += numel * ADAM_STATE_BYTES
    return RankBytes(ranks, totals["parameters"], totals["buffers"], totals["gradients"], totals["optimizer"], exact)


def step_collectives(plan: Plan) -> list[StepCollective]:
    """The collectives of one training step on a rank, grouped by kind, dimension and what they move."""
    found: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    micro_batches = plan.pipeline.nmicros if plan.pipeline is not None else 1   # a pipeline's programs run per micro-batch
    for c in plan.predicted.collectives:
        found[(c.kind, c.dim, "forward activations (tp)")] += [c.bytes] * micro_batches
    for tensor in plan.tensors.values():
        for kind, dim, size, what in tensor_collectives(plan, tensor):
            found[(kind, dim, what)].append(size)
    return [StepCollective(kind, dim, sum(sizes), len(sizes), what) for (kind, dim, what), sizes in found.items()]


def tensor_collectives(plan: Plan, tensor: TensorChoice) -> list[tuple[str, str, int, str]]:
    """(kind, dimension, payload bytes, what) of the data-parallel collectives one step spends on ``tensor``."""
    if plan.mesh.dp == 1 or tensor.kind != "parameter" or tensor.dp not in ("replicate", "zero"):
        return []
    numel, _ = local_numel(plan, tensor)
    size, gathered = numel * reduced_itemsize(plan, tensor), numel * compute_itemsize(plan, tensor)
    if tensor.dp == "replicate":
        return [("all_reduce", "dp", size, "gradients")]
    found = [("all_gather", "dp", gathered, "parameters (ZeRO rows)")]
    if plan.zero.level == 3:
        found.append(("all_gather", "dp", gathered, "parameters again in the backward (ZeRO-3)"))
    whole = size * (plan.mesh.dp // plan.zero.ngroups)
    if plan.zero.level == 1 and not plan.zero.reduce_scatter:
        found.append(("all_reduce", "dp", whole, "gradients, then sliced (ZeRO-1)"))
    else:
        found.append(("reduce_scatter", "dp", whole, "gradients (ZeRO)"))
    if plan.zero.ngroups > 1:
        found.append(("all_reduce", "dp", size, "gradient rows across ZeRO groups"))
    return found


def group_of(plan: Plan, dim: str, what: str) -> int:
    """The ranks a collective of ``step_collectives`` / :func:`tensor_collectives` runs over."""
    if dim == "tp":
        return plan.mesh.tp
    if "across ZeRO groups" in what:
        return plan.zero.ngroups
    if what == "gradients":             # a replicated parameter's all-reduce over every unit
        return plan.mesh.dp
    return plan.mesh.dp // plan.zero.ngroups


def with_forward_collectives(plan: Plan, propagation, node_keys: dict[str, str]) -> Plan:
    """``plan`` with the forward collectives a sharding propagation (``passes.propagate_sharding``) found,
    by node key, in ``predicted`` (other predictions kept)."""
    if propagation is None:
        return plan
    collectives = tuple(ForwardCollective(node_keys.get(c.node, c.node), c.kind, c.mesh_dim, c.bytes, c.mirrored)
                        for c in propagation.collectives)
    return dataclasses.replace(plan, predicted=dataclasses.replace(plan.predicted, forward_collectives=collectives))


def tp_collectives(plan: Plan) -> tuple[int, int]:
    """(calls, bytes) of a micro-batch's forward tp collectives and their backward mirrors."""
    found = plan.predicted.collectives
    return (sum(2 if c.mirrored else 1 for c in found),
            sum((2 if c.mirrored else 1) * c.bytes for c in found))

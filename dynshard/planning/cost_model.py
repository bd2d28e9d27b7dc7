"""The cost model an automatic policy ranks plans by: a training step's seconds and a rank's peak bytes.

Inputs: a :class:`~dynshard.planning.Plan` (mesh, ZeRO, each tensor's placement, the forward collectives
its propagation found), what one rank computes, keeps and writes for one micro-batch (``UnitCosts``, read
from the graph), the micro-batches per step, and a :class:`DeviceProfile`.

Time, per step and rank (nothing overlapped: on CPU/gloo ranks and collectives share the cores; on GPUs
this is an upper bound):
- compute: per micro-batch, forward FLOPs / ``flops_per_s`` + bytes moved / ``bytes_per_s``; the backward
  twice the forward (two matmuls per matmul); a recomputed module's forward once more;
- tp communication, per micro-batch: the forward collectives of the plan, each mirrored in the backward by
  one of the same bytes (Megatron's f/g pairs; sequence parallel's all-gather/reduce-scatter pairs), and the
  all-reduce of every replicated parameter's gradient that split ops leave partial;
- dp communication, per step: the gradient and ZeRO collectives of ``costs.step_collectives``, in buckets
  of ``BUCKET_BYTES`` as Inductor's bucketing sends them.
A collective of ``kind`` over ``p`` ranks moving ``n`` bytes (the whole buffer) costs
``alpha + ring(kind, p) * n / bandwidth``: ring = 2(p-1)/p for an all-reduce, (p-1)/p otherwise.

Memory, per rank, at the step's peak (docs/design.md "ZeRO rows"): parameters, buffers, gradients and
Adam's state at rest; ZeRO levels 1-2 add the gathered parameters (kept through the step), level 3 one
block's; accumulating under ZeRO adds whole replicas and their gradients; activations saved for the backward
(with recompute: each block's inputs and one block's own); transient: ``transient_mem_coef`` times the
largest tensor one op writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

from .costs import itemsize, local_numel, memory_at_rest, step_collectives
from .plan import Plan

BUCKET_BYTES = 25 * 1024 ** 2
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """One rank's device and its links: achieved rates, not datasheet peaks."""

    name: str
    flops_per_s: float
    bytes_per_s: float
    alpha_s: dict           # collective kind -> seconds per call
    bandwidth: dict         # collective kind -> bytes per second (bus bandwidth)

    def collective_seconds(self, kind: str, whole_bytes: float, group: int, calls: int = 1) -> float:
        if group <= 1 or whole_bytes <= 0:
            return 0.0
        ring = 2 * (group - 1) / group if kind == "all_reduce" else (group - 1) / group
        return calls * self.alpha_s[kind] + ring * whole_bytes / self.bandwidth[kind]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "DeviceProfile":
        data = json.loads(text)
        return cls(data["name"], float(data["flops_per_s"]), float(data["bytes_per_s"]),
                   {k: float(data["alpha_s"][k]) for k in KINDS}, {k: float(data["bandwidth"][k]) for k in KINDS})

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


def _uniform(name: str, flops: float, bandwidth: float, alpha: float, link: float) -> DeviceProfile:
    return DeviceProfile(name, flops, bandwidth, {k: alpha for k in KINDS}, {k: link for k in KINDS})


# Built-in constants when no calibration file is given: a CPU core per rank with gloo over loopback, and
# an H100 with NCCL over NVLink (achieved, not peak: ~60% of dense bf16 / HBM, NCCL's bus bandwidth).
DEFAULT_PROFILES = {
    "cpu": _uniform("cpu-gloo (built-in)", 3e10, 4e9, 1.5e-4, 1.5e9),
    "cuda": _uniform("cuda-nccl (built-in)", 4e14, 2e12, 2e-5, 1.5e11),
}


@dataclasses.dataclass(frozen=True)
class UnitCosts:
    """One micro-batch on one rank of a unit (``policies.autodist.graph_costs.GraphCosts`` fills it)."""
    forward_flops: float
    forward_bytes: float
    saved_bytes: float
    largest_output: float
    recompute_saved: float
    recompute_flops: float
    recompute_bytes: float
    replicated_grad_bytes: float
    blocks: int = 1


def predict(plan: Plan, unit: UnitCosts, nmicros: int, profile: DeviceProfile, transient_mem_coef: float) -> dict:
    """``plan``'s step seconds and peak bytes per rank (the dict ``Plan.predicted`` keeps)."""
    recompute = bool(plan.recompute)
    forward = unit.forward_flops / profile.flops_per_s + unit.forward_bytes / profile.bytes_per_s
    again = (unit.recompute_flops / profile.flops_per_s + unit.recompute_bytes / profile.bytes_per_s) if recompute else 0.0
    compute = nmicros * (3 * forward + again)
    tp = plan.mesh.tp
    tp_comm = sum(2 * profile.collective_seconds(c["kind"], c["bytes"], tp)
                  for c in (plan.predicted or {}).get("forward_collectives", ()))
    tp_comm += profile.collective_seconds("all_reduce", unit.replicated_grad_bytes, tp)
    dp_comm = 0.0
    for c in step_collectives(plan):
        if c.dim == "tp":
            continue
        if "across ZeRO groups" in c.what:
            group = plan.zero.ngroups
        elif c.what == "gradients":         # a replicated parameter's all-reduce over every unit
            group = plan.mesh.dp
        else:                               # ZeRO rows: within a ZeRO group
            group = plan.mesh.dp // plan.zero.ngroups
        whole = c.bytes * group if c.kind == "all_gather" else c.bytes
        dp_comm += profile.collective_seconds(c.kind, whole, group, max(1, math.ceil(whole / BUCKET_BYTES)))
    communication = nmicros * tp_comm + dp_comm
    rest = memory_at_rest(plan)[0]
    zero_whole = sum(local_numel(dataclasses.replace(plan, zero=dataclasses.replace(plan.zero, level=0)),
                                 dataclasses.replace(t, dp="replicate"))[0] * itemsize(t.dtype)
                     for t in plan.tensors.values() if t.kind == "parameter" and t.dp == "zero")
    gathered = 0.0
    if plan.zero.level in (1, 2):
        gathered = zero_whole
    elif plan.zero.level == 3:
        gathered = zero_whole / max(unit.blocks, 1)
    if plan.zero.level and nmicros > 1:
        gathered += 2 * zero_whole            # whole replicas and their gradients while accumulating
    activations = unit.recompute_saved if recompute else unit.saved_bytes
    transient = transient_mem_coef * unit.largest_output
    peak = rest.total + gathered + activations + transient
    return {
        "step_seconds": _round(compute + communication),
        "compute_seconds": _round(compute),
        "communication_seconds": _round(communication),
        "tp_communication_seconds": _round(nmicros * tp_comm),
        "dp_communication_seconds": _round(dp_comm),
        "bubble_seconds": 0.0,
        "bytes_per_rank": {"parameters": rest.parameters, "buffers": rest.buffers, "gradients": rest.gradients,
                           "optimizer": rest.optimizer, "gathered": int(gathered), "activations": int(activations),
                           "transient": int(transient), "peak": int(peak)},
    }


def _round(seconds: float) -> float:
    return float(f"{seconds:.6g}")

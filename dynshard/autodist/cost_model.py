"""The cost model an automatic policy ranks plans by: a training step's seconds and a rank's peak bytes.

Inputs: a :class:`~dynshard.planning.Plan` (mesh, ZeRO, each tensor's placement, the forward collectives
its propagation found), what one rank computes, keeps and writes for one micro-batch (``UnitCosts``, read
from the graph), the micro-batches per step, and a :class:`.device_profile.DeviceProfile`.

Time, per step and rank (nothing overlapped where collectives and compute share the cores: CPU/gloo; where
they do not, ``DeviceProfile.overlap``, the gradients' reductions overlap the backward: see below):
- compute: per micro-batch, forward FLOPs at the rate of their class (their dtype; a GPU's fused attention,
  :mod:`.fused_attention`; ``DeviceProfile.flop_seconds``) + bytes moved once fused / ``bytes_per_s`` +
  kernels * ``launch_s`` (:mod:`.fused_traffic`); the backward twice the forward (two matmuls per matmul;
  fused attention 2.5x: it recomputes its scores); a recomputed module's forward ops once more, those on a
  path to a value its backward reads;
  per step, the optimizer's update of the rank's share of each parameter (``update_seconds``: Adam, memory
  bound; ZeRO's rows update a 1/dp share);
- tp communication, per micro-batch: the forward collectives of the plan, each mirrored in the backward by
  one of the same bytes (Megatron's f/g pairs; sequence parallel's all-gather/reduce-scatter pairs; not the
  reduction of a loss's scalars nor a vocabulary-parallel loss's, whose backward is local), and the
  all-reduce of every replicated parameter's gradient that split ops leave partial. Those are one call per
  gradient and split reader in the program (27 for the bench GPT under sequence parallelism, 65 under data:
  its tied table twice), which ``tp_collectives_per_micro_batch`` counts as
  traced, but their latency and wait are priced per 25 MB bucket: issued back to back, they meet about
  once (per bucket, data's step is predicted at 0.97x its measurement; per call it would gain ~62 latencies
  and meetings, an estimated +0.05 s on a 0.18 s step);
- dp communication, per step: each parameter's gradient and ZeRO collectives (``costs.tensor_collectives``),
  their latency once per kind and program region (each block's run in the block) and once per
  ``BUCKET_BYTES`` (Inductor's buckets).
A collective of ``kind`` over ``p`` ranks moving ``n`` bytes (the whole buffer) costs what the profile's
table measured for ``n`` over ``p`` ranks (interpolated), or without one ``alpha + ring(kind, p) * n /
bandwidth``: ring = 2(p-1)/p for an all-reduce, (p-1)/p otherwise; the bandwidth the network's where the
group's ranks span hosts (``DeviceProfile.bus_bandwidth``). ZeRO gathers in mixed precision's
``param_dtype`` and reduces in ``reduce_dtype`` (``planning.costs.tensor_collectives``).

Where collectives run beside compute (NCCL's streams), the gradients' reductions, issued region by region as
the last micro-batch's backward proceeds, overlap the backward of the regions before them: a step pays
``max(R / regions, R - B (regions - 1) / regions)`` of their ``R`` seconds over a backward of ``B``
(:func:`exposed_reduction_seconds`); ZeRO's gathers are paid whole (the program issues a block's gather where
the block starts), and so are tp collectives (on the critical path).

Every collective is also a meeting point: it waits for the slowest rank, and ranks that ran the same work
since the last one arrive apart by their jitter, which grows with that work. Measured on this project's
2-core machine (gloo), an all-reduce that follows 3 ms of compute on each rank waits 1.7 ms beyond its idle
latency, one after 12 ms waits 2.8 ms: about ``skew * sqrt(seconds since the last meeting)``. ``k`` meetings
spread over ``C`` seconds of compute then cost ``skew * sqrt(k * C)`` (k gaps of C/k). ``dynshard.calibrate``
measures ``skew``; it is 0 for a device that does not share its cores (the built-in CUDA profile).

Memory, per rank, at the step's peak (docs/design.md "ZeRO rows"): parameters, buffers, gradients and
Adam's state at rest; ZeRO levels 1-2 add the gathered parameters (kept through the step, in ``param_dtype``),
level 3 one block's; under mixed precision a replicated parameter's compute copy (the backward keeps it); accumulating under ZeRO adds whole replicas and their gradients; activations saved for the backward
(with recompute: each block's inputs and one block's own); transient: ``transient_mem_coef`` times the
largest tensor one op writes.

Recompute is per instance of the model's repeated module (``Plan.recompute`` names instances by path or
the class for all of them) and ZeRO rows per parameter (``TensorChoice.dp``): every term is linear in those
choices except the largest recomputed instance (one instance's activations exist again during the
backward), which the ILP of :mod:`.choices` bounds with one variable.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

from ..planning.costs import (ADAM_STATE_BYTES, ADAM_STEP_BYTES, group_of, itemsize, local_numel, memory_at_rest,
                              compute_itemsize, gathered_replica_bytes, tensor_collectives, tp_collectives,
                              whole_bytes)
from ..planning.plan import Plan
from ..planning.prediction import Collectives, Cost, RankMemory
from .device_profile import DeviceProfile

BUCKET_BYTES = 25 * 1024 ** 2
REDUCTIONS = ("all_reduce", "reduce_scatter")


@dataclasses.dataclass(frozen=True)
class InstanceCosts:
    """One instance of the repeated module class on one rank, per micro-batch."""
    path: str
    saved_bytes: float          # what its forward keeps for the backward
    entry_bytes: float          # what a recompute keeps instead: its inputs from outside, and the outputs of
                                # the tp reductions inside it (collectives are not recomputed)
    flop_seconds: float         # of the FLOPs run again when recomputed, at the device's rates: the forward
                                # ops on a path to a value the backward reads (matmuls and attention too; not
                                # one that feeds only its output)
    bytes: float                # bytes those of them that are memory bound move again
    input_bytes: float = 0.0    # its activations from outside it (what a pipeline stage boundary sends)
    kernels: float = 0.0        # launched again when recomputed


@dataclasses.dataclass(frozen=True)
class UnitCosts:
    """One micro-batch on one rank of a unit (:mod:`.graph_costs` measures it)."""
    forward_flop_seconds: float     # the forward's FLOPs at the device's rate for each (its dtype, fused attention)
    forward_bytes: float            # moved by the ops that compute nothing (memory bound)
    saved_bytes: float
    largest_output: float
    replicated_grad_bytes: float    # gradients of replicated parameters that split ops leave partial over tp
    recompute_class: str | None = None
    instances: tuple[InstanceCosts, ...] = ()
    replicated_grads: int = 0       # how many such gradients (one all-reduce each, per micro-batch)
    outputs: tuple[float, ...] = ()  # each op's output bytes on the rank, in the graph's order (largest_output's)
    kernels: float = 0.0            # the forward's, once fused (the backward's: twice as many)
    backward_extra_seconds: float = 0.0     # the backward's FLOPs beyond twice the forward's (fused attention)

    def recomputed(self, recompute: tuple[str, ...]) -> list[InstanceCosts]:
        return [i for i in self.instances if i.path in recompute or self.recompute_class in recompute]

    @property
    def blocks(self) -> int:
        return max(len(self.instances), 1)


def predict(plan: Plan, unit: UnitCosts, nmicros: int, profile: DeviceProfile, transient_mem_coef: float) -> Cost:
    """``plan``'s step seconds and peak bytes per rank (``Plan.predicted.cost``)."""
    recomputed = unit.recomputed(plan.recompute)
    forward = forward_seconds(unit, profile)
    parameters = Counter(t for t in plan.tensors.values() if t.kind == "parameter")     # (repeated layers': once)
    compute = nmicros * (3 * forward + unit.backward_extra_seconds + sum(instance_seconds(i, profile)
                                                                           for i in recomputed)) + sum(
        n * update_seconds(plan, t, profile) for t, n in parameters.items())
    tp_comm = tp_seconds(plan, unit, profile)
    dp_kinds = {(k, w) for t in parameters for k, _, _, w in tensor_collectives(plan, t)}
    dp_comm = sum(n * parameter_seconds(plan, t, profile) for t, n in parameters.items()) + regions(unit) * sum(
        profile.alpha_s[kind] for kind, what in dp_kinds)
    if profile.overlap:     # the gradients' reductions run beside the backward of the regions before them
        reductions = sum(n * parameter_seconds(plan, t, profile, reductions=True) for t, n in parameters.items()) + \
            regions(unit) * sum(profile.alpha_s[kind] for kind, what in dp_kinds if kind in REDUCTIONS)
        backward = 3 * forward - forward + unit.backward_extra_seconds + sum(instance_seconds(i, profile)
                                                                            for i in recomputed)
        dp_comm -= reductions - exposed_reduction_seconds(reductions, backward, regions(unit))
    # waiting for the slowest rank: the tp collectives spread over each micro-batch, the data-parallel ones
    # region by region (dp_waits). Priced on the compute without recompute, so that the ILP's choices leave
    # it a constant
    if plan.mesh.tp > 1:
        tp_comm += profile.meeting_seconds(tp_calls(plan, unit), 3 * forward)
    if dp_kinds:
        dp_comm += dp_waits(plan, unit, nmicros, profile, any(t.dp == "zero" for t in parameters))
    rest = memory_at_rest(plan)[0]
    gathered = sum(n * gathered_bytes(plan, t, nmicros, unit.blocks) for t, n in parameters.items())
    activations = unit.saved_bytes - sum(i.saved_bytes - i.entry_bytes for i in recomputed) + max(
        (i.saved_bytes for i in recomputed), default=0.0)
    transient = transient_mem_coef * unit.largest_output
    peak = rest.total + gathered + activations + transient
    tp_count, tp_bytes = tp_collectives(plan)
    return Cost(
        step_seconds=round_seconds(compute + nmicros * tp_comm + dp_comm),
        compute_seconds=round_seconds(compute),
        communication_seconds=round_seconds(nmicros * tp_comm + dp_comm),
        tp_communication_seconds=round_seconds(nmicros * tp_comm),
        dp_communication_seconds=round_seconds(dp_comm),
        bubble_seconds=0.0,
        tp_collectives_per_micro_batch=Collectives(tp_count + unit.replicated_grads,
                                                   int(tp_bytes + unit.replicated_grad_bytes)),
        bytes_per_rank=RankMemory(rest.parameters, rest.buffers, rest.gradients, rest.optimizer, int(gathered),
                                  int(activations), int(transient), math.ceil(peak)),
    )


def forward_seconds(unit: UnitCosts, profile: DeviceProfile) -> float:
    """One micro-batch's forward on one rank: its FLOPs at the device's rate, its memory-bound bytes at its
    bandwidth, its kernels' launches."""
    return unit.forward_flop_seconds + unit.forward_bytes / profile.bytes_per_s + unit.kernels * profile.launch_s


def instance_seconds(instance: InstanceCosts, profile: DeviceProfile) -> float:
    return instance.flop_seconds + instance.bytes / profile.bytes_per_s + instance.kernels * profile.launch_s


def tp_calls(plan: Plan, unit: UnitCosts) -> int:
    """tp collectives of one micro-batch: the forward's, mirrored in the backward, and the gradient buckets."""
    return tp_collectives(plan)[0] + math.ceil(unit.replicated_grad_bytes / BUCKET_BYTES)


def tp_seconds(plan: Plan, unit: UnitCosts, profile: DeviceProfile) -> float:
    """tp communication of one micro-batch: the forward's collectives, each mirrored in the backward."""
    tp = plan.mesh.tp
    seconds = sum((2 if c.mirrored else 1) * profile.collective_seconds(c.kind, c.bytes, tp)
                  for c in plan.predicted.collectives)
    buckets = math.ceil(unit.replicated_grad_bytes / BUCKET_BYTES)     # (one call each, back to back: see above)
    return seconds + profile.collective_seconds("all_reduce", unit.replicated_grad_bytes, tp, buckets)


def regions(unit: UnitCosts) -> int:
    """The program regions a step's data-parallel collectives are issued from: each parameter's run in the
    region that reads it (regional compilation moves a repeated block's into the block, ``passes/grad_sync``),
    so a kind of collective is one call per block and one for the rest of the program."""
    return unit.blocks + 1


def dp_waits(plan: Plan, unit: UnitCosts, nmicros: int, profile: DeviceProfile, rows: bool) -> float:
    """How long a step's data-parallel collectives wait for the slowest unit. Each phase is one collective a
    region (:func:`regions`), spread over the compute of the micro-batch that synchronises: the gradients'
    reduction in the backward; with ZeRO ``rows``, the parameters' gather in the forward, and under ZeRO-3
    again in the backward (15 calls a step for a 4-block GPT under ZeRO-3, 10 under ZeRO-1, 5 under dp,
    counted in a profile). The first also absorbs the skew of the micro-batches accumulated before it."""
    forward = forward_seconds(unit, profile)
    phases = 1 + ((2 if plan.zero.level == 3 else 1) if rows else 0)
    return profile.meeting_seconds(phases * regions(unit), 3 * forward) + profile.meeting_seconds(
        1, (nmicros - 1) * 3 * forward)


def hidden_share(profile: DeviceProfile, unit: UnitCosts) -> float:
    """The share of the gradients' reductions a step pays where the backward hides the rest (the regime of
    :func:`exposed_reduction_seconds` that :mod:`.choices`' ILP prices, linear in its choices; the plan it
    chooses is priced again, exactly): 1 where collectives do not run beside compute."""
    return 1 / regions(unit) if profile.overlap else 1.0


def exposed_reduction_seconds(reductions: float, backward: float, regions: int) -> float:
    """What the gradients' reductions (``reductions`` seconds, issued region by region as the last micro-batch's
    backward of ``backward`` seconds proceeds) add to the step where collectives run beside compute: each
    region's overlaps the backward of the regions after it; the last region's, and what exceeds the rest
    of the backward, does not."""
    return max(reductions / regions, reductions - backward * (regions - 1) / regions)


def dp_stride(plan: Plan, what: str) -> int:
    """How many ranks apart a data-parallel collective's ranks are (a unit's ranks are consecutive)."""
    if "across ZeRO groups" in what:
        return plan.mesh.plan_ngpus * (plan.mesh.dp // plan.zero.ngroups)
    return plan.mesh.plan_ngpus


def parameter_seconds(plan: Plan, tensor, profile: DeviceProfile, reductions: bool = False) -> float:
    """The bandwidth part of a parameter's data-parallel collectives per step (their latency is paid once
    per bucket: ``alpha`` per ``BUCKET_BYTES``, and once per kind and region in :func:`predict`); only its
    gradient's reductions with ``reductions``."""
    seconds = 0.0
    for kind, _, size, what in tensor_collectives(plan, tensor):
        if reductions and kind not in REDUCTIONS:
            continue
        group, stride = group_of(plan, "dp", what), dp_stride(plan, what)
        whole = size * group if kind == "all_gather" else size
        if kind in profile.table and group == profile.table_ranks:      # (its share of a bucket's call)
            seconds += whole * profile.collective_seconds(kind, BUCKET_BYTES, group) / BUCKET_BYTES
            continue
        ring = 2 * (group - 1) / group if kind == "all_reduce" else (group - 1) / group
        seconds += whole * (ring / profile.bus_bandwidth(kind, group, stride) + profile.alpha_s[kind] / BUCKET_BYTES)
    return seconds


def update_seconds(plan: Plan, tensor, profile: DeviceProfile) -> float:
    """The optimizer's step on this rank's share of a parameter (its ZeRO rows, else its tp shard): memory bound,
    ``ADAM_STEP_BYTES`` per element at the device's bandwidth, once per step."""
    return local_numel(plan, tensor)[0] * ADAM_STEP_BYTES / profile.bytes_per_s


def gathered_bytes(plan: Plan, tensor, nmicros: int, blocks: int) -> float:
    """Bytes a ZeRO parameter is whole for during a step: kept through it (levels 1-2), one block's worth
    (level 3), and as a replica with its gradient while accumulating; a replicated parameter's copy in mixed
    precision's compute dtype (the backward keeps it)."""
    if tensor.dp != "zero" or not plan.zero.level:
        if tensor.kind == "parameter" and compute_itemsize(plan, tensor) != itemsize(tensor.dtype):
            return float(gathered_replica_bytes(plan, tensor))
        return 0.0
    whole, replica = whole_bytes(plan, tensor), gathered_replica_bytes(plan, tensor)
    gathered = replica if plan.zero.level in (1, 2) else replica / blocks
    return gathered + (2 * whole if nmicros > 1 else 0.0)


def rest_bytes(plan: Plan, tensor) -> int:
    """A parameter's bytes at rest: itself, its gradient and Adam's two fp32 moments."""
    numel, _ = local_numel(plan, tensor)
    return numel * (2 * itemsize(tensor.dtype) + ADAM_STATE_BYTES)


def round_seconds(seconds: float) -> float:
    return float(f"{seconds:.6g}")

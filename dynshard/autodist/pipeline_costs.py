"""What a pipeline plan costs a step: the schedule simulated with each stage's time, and each pipeline
rank's peak with the micro-batches it holds at once.

A stage's share of the work is its share of the forward FLOPs the cut measured (``PipelineChoice.flops``);
its forward takes that share of one micro-batch's forward on one rank (:mod:`.cost_model`),
its backward twice that (recompute adds its share of the recomputed blocks' time). The schedule is run by
the executor's own simulator (:func:`dynshard.runtime.pipeline.simulate.simulate`) with the slowest stage's
costs and the boundary's transfer time (``alpha + bytes / bandwidth`` of a point-to-point message, priced as
an all-to-all of the block's input): its makespan is the step's compute and bubble. The data-parallel
reduction follows the step (the busiest pipeline rank's parameters), and so does the sum of a gradient over
the ranks holding copies of its parameter (a tied embedding; chimera_direct's every stage). Memory per
pipeline rank: its stages' parameters, gradients and Adam's state (ZeRO rows at rest), under ZeRO their whole
replicas and gradients during the step (gathered once a step, reduce-scattered at its end), its stages' share
of the activations times the most micro-batches it holds between a forward and its backward in the simulated
timeline, and the transient term.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict

from ..planning import STAGE_SEPARATOR, Plan
from .device_profile import DeviceProfile
from .cost_model import (UnitCosts, forward_seconds, instance_seconds, parameter_seconds,
                                    round_seconds, update_seconds)
from ..planning.costs import (compute_itemsize, gathered_replica_bytes, itemsize, memory_at_rest, tensor_collectives,
                              tp_collectives, whole_bytes)
from ..planning.prediction import Collectives, Cost, RankMemory
from ..runtime.pipeline.schedules import build_schedule
from ..runtime.pipeline.simulate import simulate


def predict_pipeline(plan: Plan, unit: UnitCosts, profile: DeviceProfile, transient_mem_coef: float) -> Cost:
    p = plan.pipeline
    total = sum(p.flops) or 1
    shares = [f / total for f in p.flops]
    recomputed = unit.recomputed(plan.recompute)
    forward = forward_seconds(unit, profile)
    again = sum(instance_seconds(i, profile) for i in recomputed)
    tp = stage_tp_seconds(plan, profile, [share * 3 * forward for share in shares])  # (hybrid) forward, backward
    boundary = max((i.input_bytes for i in unit.instances), default=0.0)
    f = max(share * forward + tp[s][0] for s, share in enumerate(shares))
    b = max(share * (2 * forward + unit.backward_extra_seconds + again) + tp[s][1] for s, share in enumerate(shares))
    # a transfer meets the neighbouring stage: it waits for its skew over the action before it
    transfer = profile.alpha_s["all_to_all"] + boundary / profile.bandwidth["all_to_all"] + \
        profile.meeting_seconds(1, f) if len(shares) > 1 else 0.0
    simulated, held = _simulated(p.schedule, p.nstages, p.nmicros, plan.mesh.pp, f, b, transfer)
    rest = memory_at_rest(plan)
    saved, largest_block = activation_terms(plan, unit)
    rank_stages = [{s for s, owners in enumerate(p.stage_ranks) if rank in owners} for rank in range(plan.mesh.pp)]
    on_stages = [(t, set(t.stages or ())) for t in plan.tensors.values()]
    replicas_of = [(gathered_bytes(plan, t), on) for t, on in on_stages if on]
    ranks = []
    for rank, stages in enumerate(rank_stages):
        # (each micro-batch held is one of its stages' forwards: with several stages a rank, the largest's)
        activations = max(shares[s] for s in stages) * saved * held[rank] + largest_block
        replicas = sum(size for size, on in replicas_of if stages & on)
        ranks.append((rest[rank], activations + replicas, replicas))
    transient = transient_mem_coef * unit.largest_output
    busiest, during, replicas = max(ranks, key=lambda r: r[0].total + r[1])
    activations = during - replicas
    params = [t for t in plan.tensors.values() if t.kind == "parameter"]
    seconds_of = [(parameter_seconds(plan, t, profile), on) for t, on in on_stages if t.kind == "parameter" and on]
    dp_comm = max((sum(seconds for seconds, on in seconds_of if on & stages) for stages in rank_stages), default=0.0)
    dp_kinds = {(k, w) for t in params for k, _, _, w in tensor_collectives(plan, t)}
    dp_comm += sum(profile.alpha_s[kind] for kind, what in dp_kinds)
    shared = shared_seconds(plan, profile, rank_stages)
    # the optimizer's update after the schedule, of each rank's stages' parameters
    updates = max((sum(update_seconds(plan, t, profile) for t, on in on_stages if t.kind == "parameter" and on & stages)
                   for stages in rank_stages), default=0.0)
    busy = max(simulated.busy) + updates
    if dp_kinds or shared:
        dp_comm += profile.meeting_seconds(1, busy)       # (see cost_model: one meeting after the step)
    dp_comm += shared
    peak = busiest.total + during + transient
    return Cost(
        step_seconds=round_seconds(simulated.makespan + updates + dp_comm),
        compute_seconds=round_seconds(busy),
        communication_seconds=round_seconds(dp_comm),      # (tp's is inside the stages' times, hence compute)
        tp_communication_seconds=round_seconds(p.nmicros * max(sum(stage) for stage in tp)),
        dp_communication_seconds=round_seconds(dp_comm - shared),
        shared_gradient_seconds=round_seconds(shared),
        bubble_seconds=round_seconds(simulated.makespan + updates - busy),
        tp_collectives_per_micro_batch=Collectives(tp_collectives(plan)[0], int(tp_collectives(plan)[1])),
        micro_batches_held=tuple(held),
        bytes_per_rank=RankMemory(busiest.parameters, busiest.buffers, busiest.gradients, busiest.optimizer,
                                  int(replicas), int(activations), int(transient), math.ceil(peak)),
    )


def shared_seconds(plan: Plan, profile: DeviceProfile, rank_stages: list[set[int]]) -> float:
    """The sum of each parameter's gradient over the pipeline ranks holding a copy (a tied embedding and LM head
    on the first and last stage; every stage of chimera_direct, on two ranks): after the schedule, one
    all-reduce per set of owners (``runtime/pipeline/ownership.reduce_gradients``), the busiest rank's."""
    sizes: dict[frozenset, int] = defaultdict(int)
    for t in plan.tensors.values():
        if t.kind == "parameter" and t.stages:
            owners = frozenset(r for r, stages in enumerate(rank_stages) if stages & set(t.stages))
            if len(owners) > 1:
                sizes[owners] += whole_bytes(plan, t)
    return max((sum(profile.collective_seconds("all_reduce", size, len(owners))
                    for owners, size in sizes.items() if rank in owners) for rank in range(len(rank_stages))),
               default=0.0)


def activation_terms(plan: Plan, unit: UnitCosts) -> tuple[float, float]:
    """The bytes one micro-batch's forward leaves saved for its backward (the whole graph's, less what the
    recomputed blocks drop: their inputs stay), and the largest recomputed block's, which exists again in its
    backward."""
    recomputed = unit.recomputed(plan.recompute)
    saved = unit.saved_bytes - sum(i.saved_bytes - i.entry_bytes for i in recomputed)
    return saved, max((i.saved_bytes for i in recomputed), default=0.0)


def gathered_bytes(plan: Plan, tensor) -> int:
    """ZeRO under a pipeline: a parameter in rows is gathered whole once per step, and its gradient
    accumulated whole over the micro-batches before the reduce-scatter at the step's end; a replicated one's
    copy in mixed precision's compute dtype."""
    if tensor.kind != "parameter":
        return 0
    if tensor.dp == "zero":
        return 2 * whole_bytes(plan, tensor)
    return gathered_replica_bytes(plan, tensor) if compute_itemsize(plan, tensor) != itemsize(tensor.dtype) else 0


def stage_tp_seconds(plan: Plan, profile: DeviceProfile, compute: list[float]) -> list[tuple[float, float]]:
    """Per stage, its tp collectives' seconds for one micro-batch (a hybrid plan's, keyed ``<stage>/...``), in
    the forward and in the backward: each forward collective, and its mirror (:func:`~dynshard.planning.costs.
    mirrored`), with their meetings' wait over the stage's ``compute`` seconds a micro-batch shared between
    the two by their calls."""
    nstages = plan.pipeline.nstages
    seconds, calls = [[0.0, 0.0] for _ in range(nstages)], [[0, 0] for _ in range(nstages)]
    for c in plan.predicted.collectives:
        stage, _, _ = c.at.partition(STAGE_SEPARATOR)
        if c.dim == "tp" and stage.isdigit() and int(stage) < nstages:
            for phase in (0, 1) if c.mirrored else (0,):
                seconds[int(stage)][phase] += profile.collective_seconds(c.kind, c.bytes, plan.mesh.tp)
                calls[int(stage)][phase] += 1
    found = []
    for (forward, backward), (f, b), spent in zip(seconds, calls, compute):
        wait = profile.meeting_seconds(f + b, spent)
        found.append((forward + wait * f / max(f + b, 1), backward + wait * b / max(f + b, 1)))
    return found


def unit_at(whole: UnitCosts, split: UnitCosts, ranks: int, tp: int) -> UnitCosts:
    """One rank's costs with the graph split over ``tp`` ranks, from the whole graph's (one rank) and the
    tp policy's over ``ranks``: each figure x(t) = x(1) (a + (1 - a) / t), its unsplit part a fitted to the two
    (Amdahl's law). A hybrid stage's tp planning is what the tp policy does on the whole graph, so the
    figures carry over; the tp collectives themselves are the plan's own, per stage."""
    if tp == ranks:
        return split
    if tp == 1:
        return whole

    def at(one: float, many: float) -> float:
        if one <= 0:
            return many
        kept = min(max((many / one - 1 / ranks) / (1 - 1 / ranks), 0.0), 1.0)
        return one * (kept + (1 - kept) / tp)

    others = {i.path: i for i in split.instances}
    instances = tuple(dataclasses.replace(
        i, saved_bytes=at(i.saved_bytes, others[i.path].saved_bytes),
        entry_bytes=at(i.entry_bytes, others[i.path].entry_bytes), flop_seconds=at(i.flop_seconds, others[i.path].flop_seconds),
        bytes=at(i.bytes, others[i.path].bytes)) if i.path in others else i for i in whole.instances)
    return dataclasses.replace(
        whole, forward_flop_seconds=at(whole.forward_flop_seconds, split.forward_flop_seconds),
        backward_extra_seconds=at(whole.backward_extra_seconds, split.backward_extra_seconds),
        forward_bytes=at(whole.forward_bytes, split.forward_bytes), saved_bytes=at(whole.saved_bytes, split.saved_bytes),
        largest_output=at(whole.largest_output, split.largest_output), instances=instances,
        replicated_grad_bytes=split.replicated_grad_bytes, replicated_grads=split.replicated_grads)


@functools.lru_cache(maxsize=256)
def _simulated(schedule: str, nstages: int, nmicros: int, nranks: int, f: float, b: float, comm: float):
    """The schedule's simulation and the micro-batches each rank holds (the same for every ZeRO level of a
    candidate: the search asks again for each)."""
    simulated = simulate(build_schedule(schedule, nstages, nmicros, nranks), f=f, b=b, comm=comm)
    return simulated, _held(simulated, nranks)


def _held(simulated, nranks: int) -> list[int]:
    """The most micro-batches each rank holds between a forward and the backward that frees them."""
    held = []
    for rank in range(nranks):
        live = most = 0
        for _, _, action in simulated.timeline[rank]:
            if action.kind == "F":
                live += 1
            elif action.kind in ("B", "I"):
                live -= 1
            most = max(most, live)
        held.append(most)
    return held

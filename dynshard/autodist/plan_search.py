"""``policy="autodist"``: the plan the cost model predicts fastest that fits ``mem_constraint``, chosen before
the layout is built, and then executed as a given plan (a loaded plan file takes the same path).

The search, on rank 0 (the others receive its plan, or its error: ``backend.planner.autodist_plan``), for one
captured graph, its candidates planned as the backend plans a graph without compiling it (``graphs``, the
backend's :mod:`dynshard.backend.plan_graph`, handed in: :mod:`.graphs`):
1. each placement of :func:`.space.placements` is planned by its policy on a layout with no
   process group behind it (``runtime.mesh.PlanningLayout``), at ZeRO level 1 when there are several
   units (which tensors take ZeRO rows), and costed per micro-batch on one rank
   (:mod:`.graph_costs`); tp + sequence parallel and tp's variants are read off tp's plan
   (the plans their policy makes, tested byte for byte, without planning tp again); a variant of several
   kinds of layer whole or on batch shards is priced from the variants of one kind each
   (:mod:`.composed`), not planned;
2. every ZeRO level and recompute choice of it is priced (:func:`.cost_model.predict`); with
   ``explore_pipeline``, every pipeline of the unit's ranks too, a hybrid's stages priced from the tp plan of
   step 1 (:mod:`.hybrid_stages`), and a pipeline over ``mem_constraint`` again with the
   stage cut that fits (:mod:`.stage_memory`);
3. the fastest candidate whose peak fits wins (ties: the smaller peak, then the name); a candidate whose price
   was estimated (a hybrid priced from the tp plan, a variant from its parts) is planned for real before it
   can win, and priced again. The space is enumerated whole, so
   the choice is optimal in it under the cost model (``gap`` 0); the plan records every candidate's
   prediction, as ``explain`` shows them.
When no candidate fits, every rank raises :class:`AutodistError` naming ``mem_constraint``, the smallest
peak a candidate reaches and what dominates it, before anything is compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import time
from typing import Callable

import torch.fx as fx

from ..config import Config
from ..config.autodist import INTERLEAVED_CHUNKS
from ..config.pipeline import broken_schedule_rule
from ..planning import Plan
from ..planning.prediction import AutodistRecord, Candidate as CandidateRecord, Cost, OpPlacementSolve, ProfileName
from ..runtime.mesh import planning_layout
from ..runtime.pipeline.schedules import build_schedule
from .choices import choose
from .composed import composed
from .cost_model import UnitCosts, predict
from .device_profile import DeviceProfile, load_profile
from .fused_attention import op_costs_on
from .graph_costs import graph_costs, repeated_blocks
from .graphs import Graphs
from .hybrid_stages import estimated_stages
from .op_placement import as_plan, per_op_problem
from .pipeline_costs import predict_pipeline, unit_at
from .predict_plan import whole_graph_costs
from .space import (BATCH_PARALLEL, PER_OP, PER_OP_FITTING, SEQUENCE_PARALLEL, Candidate, Placement, left_whole,
                    on_batch_shards, placements, recompute_choices, tp_variants, with_choices, with_sequence_parallel,
                    zero_levels)
from .stage_memory import cut_for_memory

log = logging.getLogger("dynshard")
GB = 1024 ** 3


class AutodistError(ValueError):
    """No plan autodist can build fits the memory budget, or its inputs are wrong."""


def device_profile(config: Config, device_type: str) -> DeviceProfile:
    try:
        return load_profile(config.autodist.device_profile, device_type)
    except ValueError as error:
        raise AutodistError(f"{error} (pas_config['device_profile'])") from error


@contextlib.contextmanager
def _cycle_collector_paused():
    """The search copies, propagates and drops a graph of thousands of fx nodes per candidate, reference
    cycles that the cyclic collector would walk again and again: a sixth of a 32-layer search. Their memory
    is freed when the search ends (torch.distributed.checkpoint's state_dict pauses it the same way)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def search(gm: fx.GraphModule, inputs, config: Config, world: int, made_for, device_type: str,
           graphs: Graphs) -> Plan:
    """The plan autodist chooses for the captured graph ``gm`` (its ``inputs`` described by the backend) in a
    job of ``world`` ranks, made for ``made_for``; its candidates planned by ``graphs``."""
    with _cycle_collector_paused():
        return _search(gm, inputs, config, world, made_for, device_type, graphs)


def _search(gm: fx.GraphModule, inputs, config: Config, world: int, made_for, device_type: str,
            graphs: Graphs) -> Plan:
    start = time.perf_counter()
    options = config.autodist
    profile = device_profile(config, device_type)
    budget = options.mem_constraint_bytes
    units, whole, estimated = planned_units(gm, inputs, config, world, made_for, device_type, graphs)
    real = functools.cache(lambda name: estimated[name]())     # (an estimated placement planned: once)
    limit = options.max_partition_degree
    whole_unit = limit is None or limit >= config.plan_ngpus      # may a tensor split over the whole unit?
    hand = hand_plans(units, config, world, profile) if whole_unit else []
    guessed = {c.name for c, _, _ in hand if c.placement.name in estimated}     # (hand rows priced from parts)
    exact = {}          # a row whose price was estimated -> its row planned for real
    fine = []
    for placement, base, unit in units if whole_unit else ():
        for zero in zero_levels(world // config.plan_ngpus):
            row = _ilp_row(placement, base, unit, zero, config, profile)
            if row is not None:
                fine.append(row)
                if placement.name in estimated:
                    exact[row[0]] = functools.partial(_planned_ilp_row, placement, real, zero, config, profile)
    # every hand plan is a candidate too (after the ILPs' rows: a tie keeps the ILP's), so the choice is the
    # fastest fitting plan that explain's table lists whatever the ILPs found or skipped; one priced from its
    # parts is planned for real before it can win
    fine += [(c.name, plan, None, p) for c, plan, p in hand]
    for c, _, _ in hand:
        if c.name in guessed:
            exact[c.name] = functools.partial(_planned_hand_row, c, real, config, profile)
    if options.explore_pipeline and config.plan_ngpus > 1:
        tp_unit = next(((base, unit) for placement, base, unit in units if placement.name == "tp"), None)
        pipelines, hybrids = pipeline_plans(gm, inputs, config, world, made_for, device_type, profile, whole, tp_unit,
                                            graphs)
        exact.update(hybrids)
        hand += pipelines
        fine += [(c.name, plan, None, p) for c, plan, p in pipelines]
    if not hand:
        raise AutodistError(f"dynshard: autodist found no plan whose tensors split over at most max_partition_degree="
                            f"{limit} ranks: no pipeline of this graph qualifies. Raise max_partition_degree or set "
                            f"plan_ngpus to at most {limit}")
    name, plan, solution, predicted = _fastest_fitting(fine, exact, budget, hand, options.mem_constraint, guessed)
    seconds = time.perf_counter() - start
    solved = [row[2] for row in fine if row[2] is not None]
    statuses = {s.status for s in solved}
    step = predicted.step_seconds
    pipeline = plan.pipeline is not None
    solve = solution.record() if solution is not None else {
        "solver": "enumeration (pipelines: every schedule priced)" if pipeline else
        "enumeration (a hand plan: uniform ZeRO and recompute, priced)", "objective": step, "bound": step, "gap": 0.0,
        "lp_integral": None}
    record = AutodistRecord(
        chosen=name, solver=solve["solver"], status="optimal" if statuses <= {"optimal"} else "time limit",
        objective=solve["objective"], bound=solve["bound"], gap=solve["gap"], lp_integral=solve["lp_integral"],
        ilps=len(solved), objective_seconds=step, mem_constraint_gb=options.mem_constraint,
        update_freq=options.update_freq, device_profile=ProfileName(profile.name, profile.digest()),
        task_name=options.task_name,
        candidates=tuple(CandidateRecord(
            plan=c.name, step_seconds=p.step_seconds, compute_seconds=p.compute_seconds,
            communication_seconds=p.communication_seconds, bubble_seconds=p.bubble_seconds,
            peak_bytes=p.bytes_per_rank.peak, fits=budget is None or p.bytes_per_rank.peak <= budget,
            estimated=c.name in exact or c.name in guessed)     # (priced from tp's plan, or parts)
            for c, _, p in sorted(hand, key=lambda row: (row[2].step_seconds, row[0].name))),
    )
    level = logging.INFO if options.verbose else logging.DEBUG    # (the search's time is logged, not kept: a plan
                                                                   # is the same bytes for the same inputs)
    log.log(level, "autodist: %d hand plans and %d ILPs in %.2fs, chose %s (%.4gs a step, %.3g GB peak)", len(hand),
            len(solved), seconds, name, step, predicted.bytes_per_rank.peak / GB)
    return dataclasses.replace(plan, policy="autodist", predicted=dataclasses.replace(
        plan.predicted, cost=predicted, autodist=record))


def planned_units(gm: fx.GraphModule, inputs, config: Config, world: int, made_for, device_type: str, graphs: Graphs
                  ) -> tuple[list[tuple[Placement, Plan, UnitCosts]], UnitCosts, dict[str, Callable[[], tuple]]]:
    """Each placement's plan (its eligible parameters in ZeRO rows when there are several units) and what one
    rank of its unit computes, keeps and sends per micro-batch; what the whole graph costs one rank; and, for
    each tp variant of several kinds priced from its parts (:mod:`.composed`) rather than
    planned, how to plan it for real: (its plan, its costs)."""
    plan_graph, lower_graph, place_graph = graphs.plan, graphs.lower, graphs.place
    options = config.autodist
    config = config.resolve(world)
    dp = world // config.plan_ngpus
    layout = planning_layout(world, config.plan_ngpus, device_type)
    units = []
    forced = options.recompute_modules or ""
    choices = placements(config)
    profile = device_profile(config, device_type)
    if layout.tp_mesh is None:          # a unit of one rank: one placement, lowered here only to be costed
        (placement,) = choices
        base, ctx, _ = plan_graph(gm, inputs, placement.config(config, 1 if dp > 1 else 0, forced), layout, made_for)
        units.append((placement, base, whole_graph_costs(gm, ctx, profile)))
        return units, units[0][2], {}
    lowered, lowered_ctx = lower_graph(gm, inputs, choices[0].config(config, 1 if dp > 1 else 0, forced), layout,
                                       made_for)
    ops = op_costs_on(profile, lowered, inputs, lowered_ctx.fake_mode)   # (placement-free: once for every placement)
    blocks = repeated_blocks(lowered)

    solves: dict[str, OpPlacementSolve] = {}      # a per-op ILP's plan -> its solve, which the plan records

    def planned(placement: Placement, edit: Plan | None):
        """(plan, costs, propagated graph, context) of ``placement``, ``edit`` its plan read off another's."""
        base, ctx, graph = place_graph(lowered, lowered_ctx, placement.config(config, 1 if dp > 1 else 0, forced),
                                       edit)
        if placement.name in solves:
            base = dataclasses.replace(base, predicted=dataclasses.replace(base.predicted,
                                                                           op_placement=solves[placement.name]))
        return base, graph_costs(graph, inputs, ops, layout.tp_size, ctx.propagation, blocks, profile=profile), graph, ctx

    def on_batch(plan: Plan, graph: fx.GraphModule, ctx) -> Plan | None:
        batch = with_sequence_parallel(plan, graph.graph, ctx.propagation, layout.tp_size, ctx.node_keys, dim=0)
        return batch if batch is not None and any(a.tp != "R" for a in batch.activations.values()) else None

    skipped = {}
    edits: dict[str, Plan] = {}       # a tp variant: tp's plan with a kind left whole, propagated as given
    several: list[Placement] = []     # tp variants of several kinds: priced from their parts
    for placement in choices:
        try:
            base, unit, graph, ctx = planned(placement, edits.get(placement.name))
        except Exception as error:      # noqa: BLE001 - a placement its policy cannot make is not a candidate
            skipped[placement.name] = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            log.info("autodist: no %s plan for this graph: %s", placement.name, skipped[placement.name])
            continue
        units.append((placement, base, unit))
        if placement.name == "tp":      # (then each kind of the layers it splits, left whole: a choice per kind)
            sequence_parallel = with_sequence_parallel(base, graph.graph, ctx.propagation, layout.tp_size, ctx.node_keys)
            if sequence_parallel is not None:
                edits[SEQUENCE_PARALLEL.name] = sequence_parallel
            for variant in tp_variants(base):
                edited = left_whole(base, variant)
                if edited is not None:
                    edits[variant.name] = edited
                (choices if len(variant.kinds) == 1 else several).append(variant)
            batch = on_batch(base, graph, ctx) if several else None
            if batch is not None:       # (the base the variants on batch shards are priced from)
                choices.append(BATCH_PARALLEL)
                edits[BATCH_PARALLEL.name] = batch
            for candidate, edited, solve in placed_per_op(lowered, inputs, ops, blocks[1], base, unit, ctx.node_keys,
                                                          layout, config):
                choices.append(candidate)
                edits[candidate.name], solves[candidate.name] = edited, solve
        elif placement.whole and not placement.pas_config:      # (and that kind on the unit's batch shards)
            batch = on_batch(base, graph, ctx)
            if batch is not None:
                choices.append(on_batch_shards(placement))
                edits[choices[-1].name] = batch
    if not units:
        raise AutodistError("dynshard: autodist found no placement its policies can make for this graph: " + "; ".join(
            f"{name}: {reason}" for name, reason in skipped.items()))

    def for_real(variant: Placement, whole: Placement) -> tuple[Plan, UnitCosts]:
        plan, unit, graph, ctx = planned(whole, edits.get(whole.name))
        if variant is whole:
            return plan, unit
        batch = on_batch(plan, graph, ctx)
        if batch is None:
            raise ValueError("no activation would be on batch shards")
        return planned(variant, batch)[:2]

    by_name = {placement.name: (base, unit) for placement, base, unit in units}
    singles = {(p.kinds, bool(p.pas_config)): p.name for p, _, _ in units if len(p.kinds) == 1}
    estimated = {}
    for whole in several:
        for variant, base in ((whole, "tp"), (on_batch_shards(whole), BATCH_PARALLEL.name)):
            parts = [singles.get(((kind,), variant is not whole)) for kind in variant.kinds]
            found = (composed(by_name[base], [by_name[p] for p in parts])
                     if base in by_name and None not in parts else None)
            if found is not None:       # (planned for real with the estimate's placements: one propagation)
                estimated[variant.name] = functools.partial(lambda v, e: planned(v, e)[:2], variant, found[0])
            else:
                try:
                    found = for_real(variant, whole)
                except Exception as error:      # noqa: BLE001 - as above
                    log.info("autodist: no %s plan for this graph: %s", variant.name, error)
                    continue
            units.append((variant, *found))
    return units, graph_costs(lowered, inputs, ops, 1, None, blocks, profile=profile), estimated


def placed_per_op(lowered: fx.GraphModule, inputs, ops, blocks, tp: Plan, unit: UnitCosts, keys, layout,
                  config: Config) -> list[tuple[Placement, Plan, OpPlacementSolve]]:
    """The per-op ILP's plan (:mod:`.op_placement`), unless it splits nothing (a unit repeating
    the whole graph on every rank: data's batch split beats it) or is tp's own plan; and when what it holds is
    over ``mem_constraint`` (less tp's transient), the ILP's plan with a row that holds it there too: ZeRO and
    recompute, chosen for every candidate afterwards, may make the first fit and keep it faster. Each with its
    solve, as its plan records it (``predicted.op_placement``)."""
    options = config.autodist
    problem = per_op_problem(lowered.graph, inputs, ops, blocks, tp, unit, layout,
                             device_profile(config, layout.device_type), options.update_freq,
                             config.partition_constraints)       # (built once, solved with a budget or without)

    def solved(placement: Placement, budget: float | None):
        placed = problem.solve(30.0, budget)
        plan, unsaid = as_plan(tp, placed, lowered.graph, inputs, keys)
        log.debug("autodist: %s: an ILP over %d nodes and %d edges, %s in %.3fs%s", placement.name, placed.nodes,
                  placed.edges, placed.solution.status, placed.solution.seconds,
                  f"; not said: {unsaid}" if unsaid else "")
        splits = any(t.tp != "R" for t in plan.tensors.values()) or any(a.tp != "R" for a in plan.activations.values())
        keep = splits and (plan.tensors, plan.activations) != (tp.tensors, tp.activations)
        solve = OpPlacementSolve(**placed.solution.record(), nodes=placed.nodes, reads=placed.edges,
                                 held_bytes=int(placed.held), budget_bytes=None if budget is None else int(budget))
        return ([(placement, plan, solve)] if keep else []), placed.held

    found, held = solved(PER_OP, None)
    if options.mem_constraint_bytes is not None:
        budget = options.mem_constraint_bytes - options.transient_mem_coef * unit.largest_output
        if held > budget:
            try:
                found += solved(PER_OP_FITTING, budget)[0]
            except ValueError as error:     # (nothing it places fits the row)
                log.info("autodist: %s: %s", PER_OP_FITTING.name, error)
    return found


def hand_plans(units, config: Config, world: int, profile: DeviceProfile) -> list[tuple[Candidate, Plan, Cost]]:
    """The plans the hand policies make in the same space (uniform choices), each with its prediction."""
    options = config.autodist
    rows = []
    for placement, base, unit in units:
        for zero in zero_levels(world // config.plan_ngpus):
            for recompute in recompute_choices(config, unit.recompute_class):
                candidate = Candidate(placement, zero, recompute)
                plan = with_choices(base, zero, recompute, config.zero_use_reduce_scatter, config.zero_ngroups)
                rows.append((candidate, plan, predict(plan, unit, options.update_freq, profile,
                                                      options.transient_mem_coef)))
    return rows


def pipeline_plans(gm: fx.GraphModule, inputs, config: Config, world: int, made_for, device_type: str,
                   profile: DeviceProfile, whole: UnitCosts, tp_unit: tuple[Plan, UnitCosts] | None, graphs: Graphs
                   ) -> tuple[list[tuple[Candidate, Plan, Cost]], dict[str, Callable[[], tuple[Plan, Cost]]]]:
    """The pipelines of a unit's ranks, with each schedule, at each ZeRO level across the units, with and
    without recompute: the pp policy's (every rank of a unit one stage) and, for each factorisation of
    ``plan_ngpus`` into pp x tp stages, the hybrid policy's (its stages tp-split; priced with the tp policy's
    plan and costs over ``plan_ngpus`` ranks, ``tp_unit``: its tensors' placements and collectives
    (:mod:`.hybrid_stages`), its figures carried to the stages' tp by
    :func:`.pipeline_costs.unit_at`).

    Also, by candidate name, how to plan a hybrid candidate whose stages were priced from the tp plan for
    real: its plan, as the hybrid policy makes it, and that plan's prediction."""
    options = config.autodist
    config = config.resolve(world)
    dp = world // config.plan_ngpus
    limit = options.max_partition_degree or config.plan_ngpus
    factors = [config.plan_ngpus] + ([pp for pp in range(2, config.plan_ngpus)
                                      if config.plan_ngpus % pp == 0 and config.plan_ngpus // pp <= limit]
                                     if tp_unit is not None else [])
    instances = tuple(i.path for i in whole.instances)
    budget = options.mem_constraint_bytes
    rows, exact = [], {}
    for pp in factors:
        layout = planning_layout(world, config.plan_ngpus, device_type, pp_size=pp)
        tp = config.plan_ngpus // pp
        unit = unit_at(whole, tp_unit[1], config.plan_ngpus, tp) if tp > 1 else whole
        planned, estimated, cut = None, False, None
        moved: dict[tuple, tuple[Plan, bool]] = {}     # plans with a stage cut under the budget, by (starts, note)
        for schedule in options.schedules:
            pas = {"pipeline_nmicros": options.update_freq, "pipeline_scheduler": schedule,
                   "pipeline_pivots": options.pipeline_pivots}
            if tp > 1:
                pas["pipeline_nstages"] = pp
            if schedule == "1f1b_interleaved":      # (the chunks: stages per pipeline rank)
                pas.update(pipeline_nchunks=INTERLEAVED_CHUNKS, pipeline_nstages=pp * INTERLEAVED_CHUNKS)
            if broken_schedule_rule(schedule, pas.get("pipeline_nstages", pp), options.update_freq,
                                    pas.get("pipeline_nchunks", 1), 0) is not None or (
                    schedule == "chimera_direct" and tp > 1):
                continue        # (chimera_direct: 4 pipeline ranks, micro-batches in pairs; not yet run with tp stages)
            placement = Placement(f"pp {schedule}" if tp == 1 else f"hybrid pp {pp} x tp {tp} {schedule}",
                                  "pp" if tp == 1 else "hybrid", tuple(pas.items()))
            base = placement.config(config, 1 if dp > 1 else 0, options.recompute_modules or "")
            stages = functools.partial(_staged_plan, graphs.plan, gm, inputs, base, layout, made_for,
                                       tp_unit[0] if tp > 1 else None, instances)
            if planned is not None and _same_stages(planned, schedule, pas.get("pipeline_nstages", pp)):
                plan = _rescheduled(planned, schedule)      # (the policy's plan with that schedule: tested equal)
            else:
                try:        # (at ZeRO level 1 when there are units: which tensors take rows)
                    plan, estimated, cut = stages()
                except Exception as error:      # noqa: BLE001 - a pipeline this graph cannot be cut into is not a candidate
                    log.info("autodist: no %s plan for this graph: %s", placement.name,
                             str(error).strip().splitlines()[0])
                    continue
                planned = plan
            # (chimera_direct holds every stage on two ranks: its ZeRO rows are not built for that, and not priced)
            for zero in zero_levels(dp) if schedule != "chimera_direct" else (0,):
                for recompute in recompute_choices(config, whole.recompute_class):
                    candidate = Candidate(placement, zero, recompute)
                    staged, predicted = _priced(plan, zero, recompute, config, unit, profile)
                    rows.append((candidate, staged, predicted))
                    if estimated:
                        exact[candidate.name] = functools.partial(
                            _planned_for_real, graphs.plan, candidate.name, gm, inputs, base, layout, made_for, zero,
                            recompute,
                            config, unit, profile)
                    if budget is None or predicted.bytes_per_rank.peak <= budget:
                        continue
                    found = cut_for_memory(staged, *cut[1:], unit, predicted.micro_batches_held, budget,
                                           options.transient_mem_coef)
                    if found is None or tuple(found[0]) == plan.pipeline.starts:
                        continue
                    starts, searched = found        # (searched: '' when the cut is the best, else how near)
                    given = _with_starts(cut[0], starts, searched)
                    if (tuple(starts), searched) not in moved:
                        moved[tuple(starts), searched] = stages(given)[:2]
                    name = f"{placement.name}, stages at {', '.join(starts)}" + (f" ({searched})" if searched else "")
                    again = Candidate(Placement(name, placement.policy, placement.pas_config), zero, recompute)
                    moved_plan, moved_estimated = moved[tuple(starts), searched]
                    rows.append((again, *_priced(_rescheduled(moved_plan, schedule), zero, recompute, config, unit,
                                                 profile)))
                    if moved_estimated:
                        exact[again.name] = functools.partial(
                            _planned_for_real, graphs.plan, again.name, gm, inputs, base, layout, made_for, zero,
                            recompute,
                            config, unit, profile, given)
    return rows, exact


def _priced(plan: Plan, zero: int, recompute, config: Config, unit: UnitCosts,
            profile: DeviceProfile) -> tuple[Plan, Cost]:
    """A pipeline plan at a ZeRO level and recompute choice, and its prediction."""
    staged = with_choices(plan, zero, recompute, config.zero_use_reduce_scatter, config.zero_ngroups)
    return staged, predict_pipeline(staged, unit, profile, config.autodist.transient_mem_coef)


def _staged_plan(plan_graph, gm, inputs, base: Config, layout, made_for, tp_plan: Plan | None,
                 instances: tuple[str, ...], given: Plan | None = None) -> tuple[Plan, bool, tuple]:
    """A pipeline candidate's plan (its stage cut the policy's, or ``given``'s), whether a hybrid's stages were
    priced from the tp plan ``tp_plan`` (:mod:`.hybrid_stages`) rather than planned, and the
    cut: (its stages' tensors unplaced, the cut graph, its context)."""
    plan, ctx, graph = plan_graph(gm, inputs, base, layout, made_for, place_stages=tp_plan is None,
                                  given_pipeline=given)
    cut = (plan, graph, ctx)
    if tp_plan is None:
        return plan, False, cut
    guess = estimated_stages(plan, tp_plan, instances)
    if guess is not None:
        return guess, True, cut
    return plan_graph(gm, inputs, base, layout, made_for, given_pipeline=given)[0], False, cut


def _with_starts(plan: Plan, starts: list[str], searched: str = "") -> Plan:
    """``plan`` (a pipeline, its hybrid stages unplaced) with its stages starting at ``starts``: a given plan
    for :func:`dynshard.backend.plan_graph.plan_graph`, as a plan file with that cut is. ``searched``: how near the best a
    local search's cut is ('' for the best)."""
    how = plan.pipeline.how.replace(", balanced by FLOPs", "") + (
        f", within mem_constraint by {searched}" if searched else ", the slowest stage lightest within mem_constraint")
    return dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, starts=tuple(starts), flops=(),
                                                                  how=how))


def _planned_for_real(plan_graph, name: str, gm, inputs, base: Config, layout, made_for, zero: int, recompute,
                      config: Config, unit: UnitCosts, profile: DeviceProfile, given: Plan | None = None) -> tuple:
    """A hybrid candidate's row (name, plan, solution, prediction) with its stages planned."""
    plan, predicted = _priced(plan_graph(gm, inputs, base, layout, made_for, given_pipeline=given)[0], zero,
                              recompute, config, unit, profile)
    return name, plan, None, predicted


def _ilp_row(placement: Placement, base: Plan, unit: UnitCosts, zero: int, config: Config,
             profile: DeviceProfile) -> tuple | None:
    """The row (name, plan, solution, prediction) of the ILP choosing ZeRO rows and recompute for ``placement``
    at ZeRO level ``zero``; None when it has no solution."""
    options = config.autodist
    start = with_choices(base, zero, base.recompute, config.zero_use_reduce_scatter, config.zero_ngroups)
    choice = choose(start, unit, options.update_freq, profile, options.transient_mem_coef,
                    options.mem_constraint_bytes, search_recompute=options.recompute_modules is None)
    if not choice.solution.x:
        return None
    predicted = predict(choice.plan, unit, options.update_freq, profile, options.transient_mem_coef)
    return _describe(placement.name, choice.plan, unit), choice.plan, choice.solution, predicted


def _planned_ilp_row(placement: Placement, real, zero: int, config: Config, profile: DeviceProfile) -> tuple | None:
    """:func:`_ilp_row` of an estimated placement (:mod:`.composed`), planned for real."""
    return _ilp_row(placement, *real(placement.name), zero, config, profile)


def _planned_hand_row(candidate: Candidate, real, config: Config, profile: DeviceProfile) -> tuple:
    """A hand plan's row (name, plan, solution, prediction) of a placement priced from its parts
    (:mod:`.composed`), planned for real."""
    base, unit = real(candidate.placement.name)
    plan = with_choices(base, candidate.zero, candidate.recompute, config.zero_use_reduce_scatter, config.zero_ngroups)
    return candidate.name, plan, None, predict(plan, unit, config.autodist.update_freq, profile,
                                               config.autodist.transient_mem_coef)


def _fastest_fitting(rows: list, exact: dict, budget: float | None, hand: list, mem_constraint: float,
                     guessed: set[str]):
    """The fastest row that fits (ties: the smaller peak), a candidate whose prediction was estimated (a hybrid
    pipeline priced from the tp plan, a tp variant priced from its parts) planned for real first: its row (in
    ``rows`` and in ``hand``, whose record explain prints; no longer ``guessed``) is replaced by the real
    plan's (or dropped when its ILP has no solution), and the choice made again."""
    rows = list(rows)
    while True:
        fitting = [row for row in rows if budget is None or row[3].bytes_per_rank.peak <= budget]
        if not fitting:
            raise _nothing_fits(hand, mem_constraint)
        best = min(fitting, key=lambda row: (row[3].step_seconds, row[3].bytes_per_rank.peak))
        if best[0] not in exact:
            return best
        found = exact.pop(best[0])()
        if found is None:
            rows.remove(best)
            continue
        rows = [found if row[0] == best[0] else row for row in rows]     # (a hand plan and an ILP's of one name)
        for i, (candidate, _, _) in enumerate(hand):
            if candidate.name == best[0]:
                hand[i] = (candidate, found[1], found[3])
                guessed.discard(best[0])
        exact.pop(found[0], None)


def _same_stages(plan: Plan, schedule: str, nstages: int) -> bool:
    """Whether ``schedule`` over ``nstages`` stages runs ``plan``'s stages on the same pipeline ranks (then the
    stage cut, measured by FLOPs before the repeated layers, and every placement are the same: only the
    schedule differs)."""
    p = plan.pipeline
    if nstages != p.nstages:
        return False
    other = build_schedule(schedule, p.nstages, p.nmicros, plan.mesh.pp)
    return other.nstages == p.nstages and tuple(other.ranks_of(s) for s in range(p.nstages)) == p.stage_ranks


def _rescheduled(plan: Plan, schedule: str) -> Plan:
    return dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, schedule=schedule))


def _describe(placement: str, plan: Plan, unit: UnitCosts) -> str:
    parts = [placement]
    if plan.zero.level:
        params = [t for t in plan.tensors.values() if t.kind == "parameter"]
        rows = sum(1 for t in params if t.dp == "zero")
        parts.append(f"ZeRO-{plan.zero.level}" + ("" if rows == len(params) else f" ({rows} of {len(params)} parameters)"))
    recomputed = unit.recomputed(plan.recompute)
    if recomputed:
        parts.append(f"recompute {unit.recompute_class}" + (
            "" if len(recomputed) == len(unit.instances) else f" ({len(recomputed)} of {len(unit.instances)})"))
    return " + ".join(parts)


def _nothing_fits(rows, mem_constraint: float) -> AutodistError:
    candidate, _, predicted = min(rows, key=lambda row: (row[2].bytes_per_rank.peak, row[0].name))
    parts = predicted.bytes_per_rank.parts()
    largest = max(sorted(parts), key=lambda k: parts[k])
    return AutodistError(
        f"dynshard: no plan autodist can build fits pas_config['mem_constraint']={mem_constraint} GB per device: the "
        f"smallest peak is {predicted.bytes_per_rank.peak / GB:.3g} GB ({candidate.name}), most of it "
        f"{largest} ({parts[largest] / GB:.3g} GB). Raise mem_constraint, use more ranks per unit (plan_ngpus) or "
        "units (ZeRO splits over them), or a smaller micro-batch")

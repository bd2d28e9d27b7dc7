"""A pipeline's stage cut under the memory budget: the cut whose slowest stage is lightest among those whose
every pipeline rank fits ``mem_constraint`` (where an interleaved pipeline has millions of cuts, the best a
search finds).

The pp policy cuts by FLOPs alone (:mod:`dynshard.planning.stage_cuts`), and that cut can miss a budget that
another fits: under 1F1B the first rank holds ``pp`` micro-batches' activations and the last one, so moving a
layer off the first stage lowers the step's peak for a slower slowest stage, which can beat recompute or a
plan with more communication. The same exact search takes a memory row: a stage from position ``a`` to
``b`` on pipeline rank ``r`` holds, as :func:`.pipeline_costs.predict_pipeline` prices it,

    (tensors the ops in [a, b) read: shard, gradient, Adam's state, ZeRO's gathered copy)
    + (the stage's share of the forward FLOPs) x (bytes saved for backward a micro-batch) x held[r]
    + (the largest recomputed block) + transient_mem_coef x (the largest output)

where ``held[r]`` is the most micro-batches rank ``r`` holds in the simulated schedule (a schedule's
structure: it does not move with the cut). A tensor two stages read (a tied embedding and LM head) is held by
both; under hybrid a tensor's bytes are its tp shard's, as the candidate's (estimated) placement says. An
interleaved rank's peak sums the tensors of several stages, which a per-stage row cannot see: there every
cut is tried against a row per pipeline rank where there are at most 200,000 cuts
(:func:`~dynshard.planning.stage_cuts.enumerated_cuts`: 32 layers into 4 stages), and beyond (into 8
stages: millions) :func:`~dynshard.planning.stage_cuts.searched_cut` searches, with each stage alone on its
rank (the row above, a lower bound on its rank's) as the relaxation: exact when the relaxation's best cut
fits, or when a cut fits among those no heavier than a local search's; else the local search's cut, its
candidate named with how far over a lower bound its heaviest stage may be. The plan is then made with these
stage starts, as a plan file with an edited cut is (a hybrid's stages priced from the tp plan again, and
planned for real if it wins), and priced again, so what the search compares is the cost model's price of the
plan that runs.
"""

from __future__ import annotations

import numpy as np
import torch.fx as fx

from ..passes import PassContext
from ..passes.cut_stages import cut_space, input_read_positions, stage_start_names
from ..planning import Plan
from .cost_model import UnitCosts
from ..planning.costs import tensor_bytes
from ..planning.stage_cuts import balanced_cuts, fitting_cut
from .pipeline_costs import activation_terms, gathered_bytes


def cut_for_memory(plan: Plan, graph: fx.GraphModule, ctx: PassContext, unit: UnitCosts, held: list[int],
                   budget: float, transient_mem_coef: float) -> tuple[list[str], str] | None:
    """Stage starts (as a plan names them) for ``plan``'s pipeline whose every rank fits ``budget``, the
    slowest stage lightest among those, and '' or, when a local search found them, how far from the best
    they may be; None when the cut is the user's (pipe_split), a stage runs on several ranks, or no cut fits
    (or, searched, none was found). ``graph`` and ``ctx``: the pp policy's cut passes' (the captured graph,
    its inputs)."""
    p = plan.pipeline
    if any(len(owners) != 1 for owners in p.stage_ranks):
        return None
    space = cut_space(graph, ctx)
    if space.markers:
        return None
    weights = np.asarray(space.weights, dtype=np.float64)
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    points = np.asarray([0] + sorted(set(space.candidates)) + [len(weights)], dtype=np.int64)
    held_bytes = _held_between(plan, ctx, input_read_positions(graph), points)
    saved, largest_block = activation_terms(plan, unit)
    fixed = largest_block + transient_mem_coef * unit.largest_output
    per_flop = saved / prefix[-1] if prefix[-1] else 0.0
    micro_batches = [held[owners[0]] for owners in p.stage_ranks]

    def fits(stage: int, starts: np.ndarray, end: int) -> np.ndarray:
        # a stage alone on its rank: under interleaving, what the rank's bytes are at least
        rows, column = np.searchsorted(points, starts), int(np.searchsorted(points, end))
        activations = (prefix[end] - prefix[starts]) * per_flop * micro_batches[stage]
        return held_bytes[rows, column] + activations + fixed <= budget

    if p.nchunks == 1:
        cuts = balanced_cuts(space.weights, space.candidates, p.nstages, fits)
        return None if cuts is None else (stage_start_names(graph, cuts), "")
    ranks = [[s for s, owners in enumerate(p.stage_ranks) if owners[0] == rank] for rank in range(plan.mesh.pp)]

    def excess(bounds: np.ndarray) -> np.ndarray:
        # a rank holds its stages' tensors (one that two of its stages read counts twice: an upper bound)
        # and, per micro-batch held, the activations of its largest stage
        rows, shares = np.searchsorted(points, bounds), prefix[bounds[:, 1:]] - prefix[bounds[:, :-1]]
        over = np.zeros(len(bounds))
        for rank, stages in enumerate(ranks):
            tensors = sum(held_bytes[rows[:, s], rows[:, s + 1]] for s in stages)
            activations = shares[:, stages].max(axis=1) * per_flop * held[rank]
            over += np.maximum(tensors + activations + fixed - budget, 0.0)
        return over

    found = fitting_cut(space.weights, space.candidates, p.nstages, excess, fits)
    return None if found is None else (stage_start_names(graph, found.cuts), found.note())


def _held_between(plan: Plan, ctx: PassContext, reads: list[list[int]], points: np.ndarray) -> np.ndarray:
    """``[i, j]``: the bytes of the tensors read by an op at positions ``points[i]`` to ``points[j]`` (end
    excluded). A tensor counts when its first read at or after the start comes before the end."""
    m = len(points)
    held = np.zeros((m, m))
    for inp in ctx.inputs:
        choice = plan.tensors.get(inp.name)
        positions = np.asarray(reads[inp.index], dtype=np.int64)
        if choice is None or choice.kind == "input" or not len(positions):
            continue
        size = tensor_bytes(plan, choice) + gathered_bytes(plan, choice)
        after = np.searchsorted(positions, points)              # its first read at or after each start
        first = np.where(after < len(positions), positions[np.minimum(after, len(positions) - 1)], np.iinfo(np.int64).max)
        held += size * (first[:, None] < points[None, :])
    return held

"""The fine choices of one candidate, exactly: which instances of the repeated module to recompute and which
parameters take ZeRO rows, for the fastest step under the memory budget (an ILP on HiGHS).

For a candidate (a placement and a ZeRO level; ``base`` is its plan with every eligible parameter in ZeRO
rows) and the cost model of :mod:`.cost_model`:

Repeated layers are tied: instances of the repeated module with equal costs form one group ``g`` of ``n_g``,
and parameters with equal costs (a layer's weight in every layer, or any of one shape and dtype) one group
too. A group's variable is how many of its members take the choice, the first ones in graph order: the
members are interchangeable, so this loses no solution, and branch and bound explores no symmetric copies
(a 32-layer GPT: 12 variables instead of 519).

Variables: ``R_g`` in 0..n_g, instances of group ``g`` recomputed; ``u_g`` 0/1, some of them are (for a group
of more than one; for one, ``R_g`` itself); ``Z_q`` in 0..n_q, parameters of group ``q`` in ZeRO rows (else
replicated over dp; only at a ZeRO level > 0); ``y_rep`` / ``y_zero`` 0/1, some parameter is replicated / in
rows (each kind of collective pays its latency once a program region, and the rows' gathers their
meetings); ``T >= 0`` continuous, the largest recomputed instance's activations (they exist again while its
backward runs).

    minimise   sum_g m * t_g * R_g + sum_q (zero_q - rep_q) * Z_q + a_rep * y_rep + a_zero * y_zero
               (+ a vanishing 1e-15 s per byte of peak, so that among equally fast choices the smaller wins)
    subject to M + sum_g (entry_g - saved_g) * R_g + T + sum_q (mzero_q - mrep_q) * Z_q <= budget
               R_g <= n_g * u_g,  saved_g * u_g <= T       for every group g of instances
               Z_q <= n_q * y_zero,  n_q - Z_q <= n_q * y_rep   for every group q of parameters

``t_g``: an instance's forward seconds; ``rep_q`` / ``zero_q``: the bandwidth seconds of a parameter's
data-parallel collectives and the optimizer's update of it either way; ``a_*``: the latency of each
collective kind the choice uses; ``M``: the peak with no recompute and every parameter replicated; ``entry_g`` / ``saved_g``: what an instance keeps
when recomputed / not; ``mzero_q`` / ``mrep_q``: a parameter's bytes at rest and gathered either way. Every
term is the cost model's own, so the objective of a solution is the step its plan is predicted (tested), and
the uniform choices (the hand plans: nothing or everything recomputed, every parameter in rows) are feasible
points: the optimum is never slower than a hand plan that fits. Tested against trying every choice, and
tied against untied (one variable per instance and parameter) at every budget.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..planning import Plan
from .device_profile import DeviceProfile
from .cost_model import (REDUCTIONS, UnitCosts, dp_waits, gathered_bytes, hidden_share, instance_seconds,
                         parameter_seconds, predict, regions, rest_bytes, update_seconds)
from ..planning.costs import tensor_collectives
from .solver import NANOSECONDS, Solution, solve

MEMORY_TIE = 1e-15          # seconds per byte of peak: breaks ties toward less memory, never more than 1 us/GB


@dataclasses.dataclass(frozen=True)
class Choice:
    plan: Plan
    solution: Solution


def choose(base: Plan, unit: UnitCosts, nmicros: int, profile: DeviceProfile, transient_mem_coef: float,
           budget: float | None, search_recompute: bool, time_limit: float = 30.0, tie: bool = True) -> Choice:
    """The fastest recompute and ZeRO rows for ``base`` (its ZeRO level, its eligible parameters in rows).
    ``tie``: repeated layers' choices as counts (:func:`_tied`); False gives each its own 0/1 variable."""
    instances = list(unit.instances) if search_recompute else []
    rows_eligible = [name for name, t in base.tensors.items() if t.kind == "parameter" and t.dp == "zero"]
    replicated = _with_rows(base, set())
    replicated = dataclasses.replace(replicated, recompute=base.recompute if not search_recompute else ())
    floor = predict(replicated, unit, nmicros, profile, transient_mem_coef).bytes_per_rank.peak
    # each member's coefficients: (seconds, bytes) it adds when recomputed / in rows
    recomputed = [(nmicros * instance_seconds(i, profile), i.entry_bytes - i.saved_bytes, i.saved_bytes)
                  for i in instances]
    in_rows = []
    hidden = hidden_share(profile, unit)
    for name in rows_eligible:
        rows, whole = base.tensors[name], dataclasses.replace(base.tensors[name], dp="replicate")
        in_rows.append((_dp_seconds(base, rows, profile, hidden) + update_seconds(base, rows, profile)
                        - _dp_seconds(replicated, whole, profile, hidden) - update_seconds(replicated, whole, profile),
                        rest_bytes(base, rows) + gathered_bytes(base, rows, nmicros, unit.blocks)
                        - rest_bytes(replicated, whole) - gathered_bytes(replicated, whole, nmicros, unit.blocks)))
    r_groups, z_groups = _tied(recomputed, tie), _tied(in_rows, tie)
    shared = [g for g, members in enumerate(r_groups) if len(members) > 1]   # (their indicator u_g)
    zero_vars = bool(z_groups)
    n_r, n_z = len(r_groups), len(z_groups)
    t_var = n_r + n_z
    u_var = {g: t_var + 1 + k for k, g in enumerate(shared)}
    size = t_var + 1 + len(shared) + (2 if zero_vars else 0)
    cost, memory, counts = np.zeros(size), np.zeros(size), np.ones(size)
    for g, members in enumerate(r_groups):
        cost[g], memory[g], _ = recomputed[members[0]]
        counts[g] = len(members)
    for g, members in enumerate(z_groups):
        cost[n_r + g], memory[n_r + g] = in_rows[members[0]]
        counts[n_r + g] = len(members)
    memory[t_var] = 1.0
    others = [t for t in base.tensors.values() if t.kind == "parameter" and t.dp != "zero"]
    constraints, upper = [], []

    def add(coefficients: dict[int, float], bound: float) -> None:
        row = np.zeros(size)
        for k, value in coefficients.items():
            row[k] = value
        constraints.append(row)
        upper.append(bound)

    if budget is not None:
        constraints.append(memory)
        upper.append(budget - floor)
    for g, members in enumerate(r_groups):
        saved = recomputed[members[0]][2]
        if g in u_var:      # some of the group recomputed -> u_g = 1 -> T >= one instance's activations
            add({g: 1.0, u_var[g]: -float(len(members))}, 0.0)
            add({u_var[g]: saved, t_var: -1.0}, 0.0)
        else:
            add({g: saved, t_var: -1.0}, 0.0)
    if zero_vars:
        y_rep, y_zero = size - 2, size - 1
        cost[y_rep] = regions(unit) * _latency(
            replicated, dataclasses.replace(base.tensors[rows_eligible[0]], dp="replicate"), profile, hidden)
        # (the gathers' phases: their meetings beyond the reduction's, which every choice has)
        cost[y_zero] = regions(unit) * _latency(base, base.tensors[rows_eligible[0]], profile, hidden) + dp_waits(
            base, unit, nmicros, profile, True) - dp_waits(base, unit, nmicros, profile, False)
        for g, members in enumerate(z_groups):
            add({n_r + g: 1.0, y_zero: -float(len(members))}, 0.0)            # some in rows -> y_zero
            add({n_r + g: -1.0, y_rep: -float(len(members))}, -float(len(members)))   # some not -> y_rep
        if others:                  # parameters never in rows: their all-reduce runs anyway
            add({y_rep: -1.0}, -1.0)
    integer = np.ones(size, dtype=int)
    integer[t_var] = 0
    # in nanoseconds: HiGHS stops within an absolute gap of 1e-6 of the objective's unit, which in seconds
    # would call a choice a microsecond slower optimal
    solution = solve(NANOSECONDS * (cost + MEMORY_TIE * memory),
                     np.array(constraints) if constraints else np.zeros((0, size)), upper, integer, time_limit,
                     counts)
    if solution.x == ():
        return Choice(base, solution)
    # in step seconds: the objective is the step with nothing recomputed and every parameter replicated
    # (whose all-reduce latency the y_rep term carries) plus the chosen changes
    offset = predict(replicated, unit, nmicros, profile, transient_mem_coef).step_seconds - (
        cost[size - 2] if zero_vars else 0.0) - MEMORY_TIE * floor
    objective = solution.objective / NANOSECONDS + offset
    bound = None if solution.bound is None else solution.bound / NANOSECONDS + offset     # (None: none proved)
    gap = 0.0 if solution.gap == 0 else None if bound is None else max(objective - bound, 0.0) / max(abs(objective), 1e-12)
    solution = dataclasses.replace(solution, objective=objective, bound=bound, gap=gap)
    x = np.round(np.array(solution.x)).astype(int)
    chosen = sorted(k for g, members in enumerate(r_groups) for k in members[:x[g]])
    if not search_recompute:
        recompute = base.recompute
    elif chosen and len(chosen) == len(instances):
        recompute = (unit.recompute_class,)
    else:
        recompute = tuple(instances[k].path for k in chosen)
    rows = {rows_eligible[k] for g, members in enumerate(z_groups) for k in members[:x[n_r + g]]}
    return Choice(dataclasses.replace(_with_rows(base, rows), recompute=recompute), solution)


def _tied(coefficients: list[tuple], tie: bool) -> list[list[int]]:
    """The members (indices) with equal coefficients, in order of their first member: the instances of a
    repeated layer cost the same, as do parameters of one shape and dtype, so one integer variable (how many
    of them, the first ones taken) holds every choice the 0/1 variables could make at the same price, and
    leaves branch and bound no symmetric copies to explore. ``tie=False``: each member alone."""
    if not tie:
        return [[k] for k in range(len(coefficients))]
    groups: dict[tuple, list[int]] = {}
    for k, key in enumerate(coefficients):
        groups.setdefault(key, []).append(k)
    return list(groups.values())


def _with_rows(plan: Plan, rows: set[str]) -> Plan:
    """``plan`` with only ``rows`` of its ZeRO-eligible parameters in rows (the others replicated)."""
    return dataclasses.replace(plan, tensors={
        name: dataclasses.replace(t, dp="replicate") if t.dp == "zero" and name not in rows else t
        for name, t in plan.tensors.items()})


def _latency(plan: Plan, tensor, profile: DeviceProfile, hidden: float) -> float:
    return sum(profile.alpha_s[kind] * (hidden if kind in REDUCTIONS else 1.0)
               for kind, _, _, _ in tensor_collectives(plan, tensor))


def _dp_seconds(plan: Plan, tensor, profile: DeviceProfile, hidden: float) -> float:
    """A parameter's data-parallel bandwidth seconds, its reductions' share ``hidden`` of them (see
    :func:`.cost_model.hidden_share`)."""
    if hidden == 1.0:
        return parameter_seconds(plan, tensor, profile)
    return parameter_seconds(plan, tensor, profile) - (1 - hidden) * parameter_seconds(plan, tensor, profile,
                                                                                         reductions=True)

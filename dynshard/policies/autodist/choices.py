"""The fine choices of one candidate, exactly: which instances of the repeated module to recompute and which
parameters take ZeRO rows, for the fastest step under the memory budget (an ILP on HiGHS).

For a candidate (a placement and a ZeRO level; ``base`` is its plan with every eligible parameter in ZeRO
rows) and the cost model of :mod:`dynshard.planning.cost_model`:

Variables (0/1 unless said): ``r_i`` recompute instance ``i``; ``z_p`` parameter ``p`` in ZeRO rows (else
replicated over dp; only at a ZeRO level > 0); ``y_rep`` / ``y_zero`` some parameter is replicated / in rows
(each kind of collective pays its latency once a program region, and the rows' gathers their meetings);
``T >= 0`` continuous, the largest recomputed instance's
activations (they exist again while its backward runs).

    minimise   sum_i m * t_i * r_i + sum_p (zero_p - rep_p) * z_p + a_rep * y_rep + a_zero * y_zero
               (+ a vanishing 1e-15 s per byte of peak, so that among equally fast choices the smaller wins)
    subject to M + sum_i (entry_i - saved_i) * r_i + T + sum_p (mzero_p - mrep_p) * z_p <= budget
               saved_i * r_i <= T                      for every instance i
               z_p <= y_zero,  1 - z_p <= y_rep        for every parameter p

``t_i``: instance i's forward seconds; ``rep_p`` / ``zero_p``: the bandwidth seconds of p's data-parallel
collectives either way; ``a_*``: the latency of each collective kind the choice uses; ``M``: the peak
with no recompute and every parameter replicated; ``entry_i`` / ``saved_i``: what instance i keeps when
recomputed / not; ``mzero_p`` / ``mrep_p``: p's bytes at rest and gathered either way. Every term is the
cost model's own, so the objective of a solution is the step its plan is predicted (tested), and the
uniform choices (the hand plans: nothing or everything recomputed, every parameter in rows) are feasible
points: the optimum is never slower than a hand plan that fits.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...planning import Plan
from ...planning.cost_model import (DeviceProfile, UnitCosts, dp_waits, gathered_bytes, instance_seconds,
                                    parameter_seconds, predict, regions, rest_bytes)
from ...planning.costs import tensor_collectives
from ...planning.solver import Solution, solve

MEMORY_TIE = 1e-15          # seconds per byte of peak: breaks ties toward less memory, never more than 1 us/GB
NANOSECONDS = 1e9


@dataclasses.dataclass(frozen=True)
class Choice:
    plan: Plan
    solution: Solution


def choose(base: Plan, unit: UnitCosts, nmicros: int, profile: DeviceProfile, transient_mem_coef: float,
           budget: float | None, search_recompute: bool, time_limit: float = 30.0) -> Choice:
    """The fastest recompute and ZeRO rows for ``base`` (its ZeRO level, its eligible parameters in rows)."""
    instances = list(unit.instances) if search_recompute else []
    rows_eligible = [name for name, t in base.tensors.items() if t.kind == "parameter" and t.dp == "zero"]
    replicated = _with_rows(base, set())
    replicated = dataclasses.replace(replicated, recompute=base.recompute if not search_recompute else ())
    floor = predict(replicated, unit, nmicros, profile, transient_mem_coef)["bytes_per_rank"]["peak"]
    n_r, n_z = len(instances), len(rows_eligible)
    zero_vars = n_z > 0
    size = n_r + n_z + 1 + (2 if zero_vars else 0)
    t_var = n_r + n_z
    cost, memory = np.zeros(size), np.zeros(size)
    for k, instance in enumerate(instances):
        cost[k] = nmicros * instance_seconds(instance, profile)
        memory[k] = instance.entry_bytes - instance.saved_bytes
    memory[t_var] = 1.0
    others = [t for t in base.tensors.values() if t.kind == "parameter" and t.dp != "zero"]
    for k, name in enumerate(rows_eligible):
        rows, whole = base.tensors[name], dataclasses.replace(base.tensors[name], dp="replicate")
        cost[n_r + k] = parameter_seconds(base, rows, profile) - parameter_seconds(replicated, whole, profile)
        memory[n_r + k] = (rest_bytes(base, rows) + gathered_bytes(base, rows, nmicros, unit.blocks)
                           - rest_bytes(replicated, whole))
    constraints, upper = [], []
    if budget is not None:
        constraints.append(memory)
        upper.append(budget - floor)
    for k, instance in enumerate(instances):
        row = np.zeros(size)
        row[k], row[t_var] = instance.saved_bytes, -1.0
        constraints.append(row)
        upper.append(0.0)
    if zero_vars:
        y_rep, y_zero = size - 2, size - 1
        cost[y_rep] = regions(unit) * _latency(
            replicated, dataclasses.replace(base.tensors[rows_eligible[0]], dp="replicate"), profile)
        # (the gathers' phases: their meetings beyond the reduction's, which every choice has)
        cost[y_zero] = regions(unit) * _latency(base, base.tensors[rows_eligible[0]], profile) + dp_waits(
            base, unit, nmicros, profile, True) - dp_waits(base, unit, nmicros, profile, False)
        for k in range(n_z):
            row = np.zeros(size)
            row[n_r + k], row[y_zero] = 1.0, -1.0
            constraints.append(row)
            upper.append(0.0)
            row = np.zeros(size)
            row[n_r + k], row[y_rep] = -1.0, -1.0
            constraints.append(row)
            upper.append(-1.0)
        if others:                  # parameters never in rows: their all-reduce runs anyway
            row = np.zeros(size)
            row[y_rep] = -1.0
            constraints.append(row)
            upper.append(-1.0)
    integer = np.ones(size, dtype=int)
    integer[t_var] = 0
    # in nanoseconds: HiGHS stops within an absolute gap of 1e-6 of the objective's unit, which in seconds
    # would call a choice a microsecond slower optimal
    solution = solve(NANOSECONDS * (cost + MEMORY_TIE * memory),
                     np.array(constraints) if constraints else np.zeros((0, size)), upper, integer, time_limit)
    if solution.x == ():
        return Choice(base, solution)
    # in step seconds: the objective is the step with nothing recomputed and every parameter replicated
    # (whose all-reduce latency the y_rep term carries) plus the chosen changes
    offset = predict(replicated, unit, nmicros, profile, transient_mem_coef)["step_seconds"] - (
        cost[size - 2] if zero_vars else 0.0) - MEMORY_TIE * floor
    objective, bound = solution.objective / NANOSECONDS + offset, solution.bound / NANOSECONDS + offset
    solution = dataclasses.replace(solution, objective=objective, bound=bound,
                                   gap=0.0 if solution.gap == 0 else max(objective - bound, 0.0) / max(abs(objective), 1e-12))
    x = np.round(np.array(solution.x))
    chosen = [instances[k] for k in range(n_r) if x[k] == 1]
    recompute = base.recompute if not search_recompute else (
        (unit.recompute_class,) if chosen and len(chosen) == len(instances) else tuple(i.path for i in chosen))
    plan = dataclasses.replace(_with_rows(base, {name for k, name in enumerate(rows_eligible) if x[n_r + k] == 1}),
                               recompute=recompute)
    return Choice(plan, solution)


def _with_rows(plan: Plan, rows: set[str]) -> Plan:
    """``plan`` with only ``rows`` of its ZeRO-eligible parameters in rows (the others replicated)."""
    return dataclasses.replace(plan, tensors={
        name: dataclasses.replace(t, dp="replicate") if t.dp == "zero" and name not in rows else t
        for name, t in plan.tensors.items()})


def _latency(plan: Plan, tensor, profile: DeviceProfile) -> float:
    return sum(profile.alpha_s[kind] for kind, _, _, _ in tensor_collectives(plan, tensor))

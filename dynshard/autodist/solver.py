"""Integer linear programs on HiGHS (through ``scipy.optimize.milp``), solved so that a result never claims
more than the solver proved.

The LP relaxation is solved first: its optimum is a lower bound on every integer solution. When it is
integral it is the answer (status "optimal", gap 0). Otherwise branch and bound runs with a relative gap
of 0 and a time limit; the result keeps the incumbent, the best bound HiGHS proved and the gap between
them, and its status says "optimal" only when HiGHS proved it, "time limit" otherwise (never "optimal"
after a time limit). One thread, so the same problem gives the same answer.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

TOLERANCE = 1e-9


@dataclasses.dataclass(frozen=True)
class Solution:
    status: str                 # "optimal", "time limit", "infeasible"
    objective: float | None
    bound: float | None         # the proved lower bound
    gap: float | None           # (objective - bound) / |objective|
    seconds: float
    lp_integral: bool           # the LP relaxation's optimum was already integral
    x: tuple[float, ...] = ()

    def record(self) -> dict:
        """What a plan keeps of the solve (no time: a plan is the same bytes for the same inputs)."""
        return {"solver": "HiGHS (scipy.optimize.milp)", "status": self.status, "objective": _round(self.objective),
                "bound": _round(self.bound), "gap": _round(self.gap), "lp_integral": self.lp_integral}


# HiGHS stops within an absolute gap of 1e-6 of the objective's unit: an objective in seconds would call a
# choice a microsecond slower optimal, so the ILPs price in nanoseconds
NANOSECONDS = 1e9


def solve(cost, rows, upper, integer, time_limit: float = 30.0, counts=None, equal=None) -> Solution:
    """Minimise ``cost @ x`` subject to ``rows @ x <= upper`` (and ``A @ x == b`` for ``equal=(A, b)``; either
    matrix may be a scipy sparse one), ``x`` an integer in ``0..counts`` (1 when not given) where ``integer``
    (a 0/1 mask) and ``x >= 0`` elsewhere."""
    from scipy.optimize import Bounds, LinearConstraint, linprog, milp
    from scipy.sparse import issparse

    start = time.perf_counter()
    cost = np.asarray(cost, dtype=float)
    rows = rows if issparse(rows) else np.asarray(rows, dtype=float).reshape(-1, len(cost))
    integer = np.asarray(integer, dtype=int)
    upper_x = np.where(integer == 1, 1.0 if counts is None else np.asarray(counts, dtype=float), np.inf)
    upper = np.asarray(upper, dtype=float)
    constraints = [LinearConstraint(rows, -np.inf, upper)] if rows.shape[0] else []
    equal_rows, equal_to = equal if equal is not None else (None, None)
    if equal_rows is not None:
        constraints.append(LinearConstraint(equal_rows, equal_to, equal_to))
    lp = linprog(cost, A_ub=rows if rows.shape[0] else None, b_ub=upper if rows.shape[0] else None,
                 A_eq=equal_rows, b_eq=equal_to,
                 bounds=list(zip([0.0] * len(cost), [None if u == np.inf else u for u in upper_x])), method="highs")
    if lp.status == 2:
        return Solution("infeasible", None, None, None, time.perf_counter() - start, False)
    # (HiGHS may fail on a relaxation it cannot solve, "Status 4: Solve error", seen on a memory row far below
    # what any choice needs: then no bound is proved here, and branch and bound decides)
    bound = float(lp.fun) if lp.fun is not None else None
    if lp.status == 0 and np.all(np.abs(lp.x[integer == 1] - np.round(lp.x[integer == 1])) < 1e-7):
        x = np.where(integer == 1, np.round(lp.x), lp.x)
        return Solution("optimal", float(cost @ x), bound, 0.0, time.perf_counter() - start, True, tuple(map(float, x)))
    result = milp(cost, constraints=constraints, integrality=integer, bounds=Bounds(np.zeros(len(cost)), upper_x),
                  options={"time_limit": time_limit, "mip_rel_gap": 0.0, "presolve": True, "disp": False})
    seconds = time.perf_counter() - start
    if result.x is None:
        return Solution("infeasible" if result.status == 2 else "time limit", None, bound, None, seconds, False)
    objective = float(result.fun)
    proved = getattr(result, "mip_dual_bound", None) or bound
    proved = None if proved is None else float(proved)
    gap = 0.0 if result.status == 0 else None if proved is None else \
        abs(objective - proved) / max(abs(objective), TOLERANCE)
    return Solution("optimal" if result.status == 0 else "time limit", objective, proved if result.status else objective,
                    gap, seconds, False, tuple(map(float, result.x)))


def _round(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.6g}")

"""Where a pipeline's stages start: the cut that makes the slowest stage as fast as it can be, exactly.

Given each op's weight (its forward FLOPs) in graph order and the positions a stage may start at (before a
layer, a pivot, any op), the cut is ``nstages - 1`` increasing positions. A pipeline's steady state runs at
the pace of its heaviest stage, so the cut minimises the heaviest stage's weight (a min-max linear
partition, solved exactly by dynamic programming over the allowed positions); among the cuts that reach that
minimum, it takes the one closest to equal parts (the least sum of ``|weight before cut k - k / nstages of
the total|``), so that stages the heaviest does not constrain are balanced too, and a cut into equal layers
is the even one.

Under a memory budget a stage may also be refused: ``fits(stage, starts, end)`` says, for stage ``stage``
running from each position of ``starts`` to ``end``, whether its rank's bytes fit. The same two passes then
range over the cuts whose every stage fits (a stage's bytes depend on the stage, e.g. 1F1B's first stage
holds the most micro-batches, so the test is per stage), and there is no cut when none fits.

Both passes are O(nstages x positions^2) comparisons, vectorised per position (numpy): a graph of 3,000 ops
cut anywhere into 8 stages takes well under a second.

When what fits is a property of a pipeline rank rather than of a stage (an interleaved rank holds several
stages), ``enumerated_cuts`` tries every cut instead, with the same two criteria, where there are at most
``limit`` of them (a 32-layer model cut into 4 stages at its layers: 4,495).
"""

from __future__ import annotations

from typing import Callable

import itertools
import math

import numpy as np

Fits = Callable[[int, np.ndarray, int], np.ndarray]
_INF = np.iinfo(np.int64).max // 4


def balanced_cuts(weights: list[int], candidates: list[int], nstages: int,
                  fits: Fits | None = None) -> list[int] | None:
    """``nstages - 1`` increasing positions from ``candidates`` (a stage starts before the op there) that
    minimise the heaviest stage, then the distance from equal parts; fewer when too few positions exist.
    With ``fits``: only cuts whose every stage fits, None when there is none."""
    n = len(weights)
    points = _positions(candidates, n)
    if nstages <= 1 or len(points) - 1 < nstages:
        if fits is not None and not _all_fit(fits, [int(p) for p in points[:nstages]] + [n]):
            return None
        return [int(p) for p in points[1:-1][:max(nstages - 1, 0)]]
    prefix = np.concatenate([[0], np.cumsum(np.asarray(weights, dtype=np.int64))])
    at = prefix[points]                 # the weight before each allowed position
    allowed = _allowed(fits, points)
    heaviest = _least_heaviest(at, nstages, allowed)
    if heaviest >= _INF:
        return None
    return [int(points[i]) for i in _closest_to_equal(at, nstages, heaviest, allowed)]


def enumerated_cuts(weights: list[int], candidates: list[int], nstages: int,
                    fits_all: Callable[[np.ndarray], np.ndarray], limit: int = 200_000) -> list[int] | None:
    """The cut ``balanced_cuts`` would choose, among the cuts ``fits_all`` accepts: given every cut as the rows
    of a (cuts, nstages + 1) array of stage bounds (0, the starts, ``len(weights)``), which fit. Every cut is
    tried; None when none fits, or when there are more than ``limit``."""
    n = len(weights)
    points = _positions(candidates, n)
    if nstages <= 1 or len(points) - 1 < nstages or math.comb(len(points) - 2, nstages - 1) > limit:
        return None
    inner = np.asarray(list(itertools.combinations(range(1, len(points) - 1), nstages - 1)), dtype=np.int64)
    bounds = np.hstack([np.zeros((len(inner), 1), dtype=np.int64), inner,
                        np.full((len(inner), 1), len(points) - 1, dtype=np.int64)])
    prefix = np.concatenate([[0], np.cumsum(np.asarray(weights, dtype=np.int64))])
    at = prefix[points]
    heaviest = np.diff(at[bounds], axis=1).max(axis=1)
    ok = np.asarray(fits_all(points[bounds]), dtype=bool)
    if not ok.any():
        return None
    least = heaviest[ok].min()
    k = np.arange(1, nstages)
    distance = np.abs(nstages * at[inner] - k * int(at[-1])).sum(axis=1)
    best = int(np.argmin(np.where(ok & (heaviest == least), distance, _INF)))      # (ties: the first cut)
    return [int(points[i]) for i in inner[best]]


def _positions(candidates: list[int], n: int) -> np.ndarray:
    """0, the allowed stage starts inside the graph in order, and ``n``."""
    return np.asarray([0] + sorted({c for c in candidates if 0 < c < n}) + [n], dtype=np.int64)


def _allowed(fits: Fits | None, points: np.ndarray) -> Callable[[int, np.ndarray, int], np.ndarray]:
    """Per stage, which start indices (into ``points``) may run it up to an end index."""
    if fits is None:
        return lambda stage, earlier, j: np.ones(len(earlier), dtype=bool)
    return lambda stage, earlier, j: np.asarray(fits(stage, points[earlier], int(points[j])), dtype=bool)


def _all_fit(fits: Fits, bounds: list[int]) -> bool:
    return all(bool(fits(s, np.asarray([a]), b)[0]) for s, (a, b) in enumerate(zip(bounds, bounds[1:])))


def _least_heaviest(at: np.ndarray, nstages: int, allowed) -> int:
    """The least possible weight of the heaviest stage (positions ``at``: prefix weights, first 0, last the
    total), ``_INF`` when no cut has every stage allowed."""
    m = len(at)
    best = np.full(m, _INF, dtype=np.int64)     # one stage: everything up to each position
    first = np.zeros(1, dtype=np.int64)
    for j in range(1, m):
        if allowed(0, first, j)[0]:
            best[j] = at[j] - at[0]
    for stages in range(2, nstages + 1):
        current = np.full(m, _INF, dtype=np.int64)
        for j in range(stages, m):
            earlier = np.arange(stages - 1, j)
            ok = allowed(stages - 1, earlier, j) & (best[earlier] < _INF)
            if ok.any():
                current[j] = np.maximum(best[earlier], at[j] - at[earlier])[ok].min()
        best = current
    return int(best[m - 1])


def _closest_to_equal(at: np.ndarray, nstages: int, heaviest: int, allowed) -> list[int]:
    """The indices of the cut positions whose stages all weigh at most ``heaviest`` (and are allowed) and
    whose prefix weights are closest to equal parts (the least sum of |nstages x prefix - k x total|, exact
    in integers)."""
    m, total = len(at), int(at[-1])
    cost = np.full(m, _INF, dtype=np.int64)
    cost[0] = 0                         # no cut yet: the first stage starts at position 0
    back: list[np.ndarray] = []
    for k in range(1, nstages):
        current = np.full(m, _INF, dtype=np.int64)
        came = np.zeros(m, dtype=np.int64)
        for j in range(k, m - 1):
            earlier = np.arange(k - 1, j)
            ok = (at[j] - at[earlier] <= heaviest) & (cost[earlier] < _INF) & allowed(k - 1, earlier, j)
            if not ok.any():
                continue
            options = np.where(ok, cost[earlier], _INF)
            i = int(np.argmin(options))
            current[j] = options[i] + abs(nstages * int(at[j]) - k * total)
            came[j] = earlier[i]
        cost = current
        back.append(came)
    starts = np.arange(m)
    last = np.where((total - at <= heaviest) & allowed(nstages - 1, starts, m - 1), cost, _INF)
    last[m - 1] = _INF
    j = int(np.argmin(last))
    cuts = [j]
    for came in reversed(back[1:]):
        j = int(came[j])
        cuts.append(j)
    return cuts[::-1]

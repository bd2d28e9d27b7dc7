"""Where a pipeline's stages start: the cut that makes the slowest stage as fast as it can be, exactly.

Given each op's weight (its forward FLOPs) in graph order and the positions a stage may start at (before a
layer, a pivot, any op), the cut is ``nstages - 1`` increasing positions. A pipeline's steady state runs at
the pace of its heaviest stage, so the cut minimises the heaviest stage's weight (a min-max linear
partition, solved exactly by dynamic programming over the allowed positions); among the cuts that reach that
minimum, it takes the one closest to equal parts (the least sum of ``|weight before cut k - k / nstages of
the total|``), so that stages the heaviest does not constrain are balanced too, and a cut into equal layers
is the even one.

Both passes are O(nstages x positions^2) comparisons, vectorised per position (numpy): a graph of 3,000 ops
cut anywhere into 8 stages takes well under a second.
"""

from __future__ import annotations

import numpy as np


def balanced_cuts(weights: list[int], candidates: list[int], nstages: int) -> list[int]:
    """``nstages - 1`` increasing positions from ``candidates`` (a stage starts before the op there) that
    minimise the heaviest stage, then the distance from equal parts; fewer when too few positions exist."""
    n = len(weights)
    points = [0] + sorted({c for c in candidates if 0 < c < n}) + [n]
    if nstages <= 1 or len(points) - 1 < nstages:
        return points[1:-1][:max(nstages - 1, 0)]
    prefix = np.concatenate([[0], np.cumsum(np.asarray(weights, dtype=np.int64))])
    at = prefix[points]                 # the weight before each allowed position
    heaviest = _least_heaviest(at, nstages)
    return [points[i] for i in _closest_to_equal(at, nstages, heaviest)]


def _least_heaviest(at: np.ndarray, nstages: int) -> int:
    """The least possible weight of the heaviest stage (positions ``at``: prefix weights, first 0, last the
    total)."""
    m = len(at)
    inf = np.iinfo(np.int64).max
    best = at - at[0]                   # one stage: everything up to each position
    best[0] = inf
    for stages in range(2, nstages + 1):
        current = np.full(m, inf, dtype=np.int64)
        for j in range(stages, m):
            earlier = np.arange(stages - 1, j)
            current[j] = np.maximum(best[earlier], at[j] - at[earlier]).min()
        best = current
    return int(best[m - 1])


def _closest_to_equal(at: np.ndarray, nstages: int, heaviest: int) -> list[int]:
    """The indices of the cut positions whose stages all weigh at most ``heaviest`` and whose prefix weights
    are closest to equal parts (the least sum of |nstages x prefix - k x total|, exact in integers)."""
    m, total = len(at), int(at[-1])
    inf = np.iinfo(np.int64).max // 4
    cost = np.full(m, inf, dtype=np.int64)
    cost[0] = 0                         # no cut yet: the first stage starts at position 0
    back: list[np.ndarray] = []
    for k in range(1, nstages):
        current = np.full(m, inf, dtype=np.int64)
        came = np.zeros(m, dtype=np.int64)
        for j in range(k, m - 1):
            earlier = np.arange(k - 1, j)
            fits = (at[j] - at[earlier] <= heaviest) & (cost[earlier] < inf)
            if not fits.any():
                continue
            options = np.where(fits, cost[earlier], inf)
            i = int(np.argmin(options))
            current[j] = options[i] + abs(nstages * int(at[j]) - k * total)
            came[j] = earlier[i]
        cost = current
        back.append(came)
    last = np.where(total - at <= heaviest, cost, inf)
    last[m - 1] = inf
    j = int(np.argmin(last))
    cuts = [j]
    for came in reversed(back[1:]):
        j = int(came[j])
        cuts.append(j)
    return cuts[::-1]

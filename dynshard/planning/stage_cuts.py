"""Where a pipeline's stages start: the cut that makes the slowest stage as fast as it can be, exactly (but
under a budget per rank with too many cuts to try, see the end).

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
``limit`` of them (a 32-layer model cut into 4 stages at its layers: 4,495). Beyond that (into 8 stages:
2.6 million), ``searched_cut`` looks for a cut whose ranks fit and says whether it is the best:

- exact when the best cut of a per-stage relaxation (``fits``: each stage alone on its rank, which every
  stage of a cut that fits passes) fits: the relaxation's heaviest stage is a lower bound;
- else a local search (steepest descent over cuts a move or two apart, from that cut and the one with no
  budget) finds a cut that fits, and every cut whose stages weigh no more than its heaviest (or, when
  those are more than ``limit``, no more than a weight that leaves at most ``limit``) is tried as
  ``enumerated_cuts`` tries them all: a fit there is exact again;
- else the local search's cut, with what bounds its heaviest stage from below (``FoundCut.note``): the
  relaxation's, or one above the weight every cut up to which was tried.

``fitting_cut`` takes ``enumerated_cuts``' cut where it can and ``searched_cut``'s otherwise. A 32-layer
model into 8 stages takes tens of milliseconds.
"""

from __future__ import annotations

from typing import Callable

import dataclasses
import itertools
import math

import numpy as np

Fits = Callable[[int, np.ndarray, int], np.ndarray]
Excess = Callable[[np.ndarray], np.ndarray]
_INF = np.iinfo(np.int64).max // 4
_REACH = 8          # how far the local search moves two cuts at once (one moves anywhere between its neighbours)


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
    best = _best_fitting(bounds, _prefix_at(weights, points), np.asarray(fits_all(points[bounds]), dtype=bool))
    return None if best is None else [int(points[i]) for i in best[1:-1]]


@dataclasses.dataclass(frozen=True)
class FoundCut:
    """A cut whose every rank fits, and how far from the best it may be."""
    cuts: list[int]
    exact: bool         # the heaviest stage and distance from equal parts of ``enumerated_cuts``' cut
    heaviest: int       # its heaviest stage's weight
    bound: int          # no cut that fits has a lighter heaviest stage

    def note(self) -> str:
        """'' when exact, else that a local search found it and how far over the bound its heaviest stage is
        at most (rounded up to a tenth of a percent)."""
        if self.exact:
            return ""
        if self.heaviest <= self.bound:
            return "local search: heaviest stage at a lower bound"
        over = math.ceil(1000 * (self.heaviest - self.bound) / self.bound) / 10      # (a bound of 0: no weight)
        return f"local search: heaviest stage at most {over:g}% over a lower bound"


def fitting_cut(weights: list[int], candidates: list[int], nstages: int, excess: Excess,
                fits: Fits | None = None, limit: int = 200_000) -> FoundCut | None:
    """A cut whose every rank fits: ``enumerated_cuts``' (exact) where there are at most ``limit`` cuts, else
    ``searched_cut``'s. ``excess``: for cuts as ``enumerated_cuts`` passes them, how far their ranks are over
    (0: they fit). None when none fits, or (searched) none was found."""
    points = _positions(candidates, len(weights))
    if nstages > 1 and len(points) - 1 >= nstages and math.comb(len(points) - 2, nstages - 1) > limit:
        return searched_cut(weights, candidates, nstages, excess, fits, limit)
    cuts = enumerated_cuts(weights, candidates, nstages, lambda rows: np.asarray(excess(rows)) <= 0, limit)
    if cuts is None:
        return None
    heaviest = int(np.diff(_prefix_at(weights, np.asarray([0, *cuts, len(weights)]))).max())
    return FoundCut(cuts, True, heaviest, heaviest)


def searched_cut(weights: list[int], candidates: list[int], nstages: int, excess: Excess,
                 fits: Fits | None = None, limit: int = 200_000, steps: int = 1_000) -> FoundCut | None:
    """A cut whose ``excess`` is 0 without trying every cut: exact when a relaxation's best cut fits, or when
    one fits among the (at most ``limit``) cuts no heavier than the local search's; else the local search's.

    1. ``fits`` (per stage, as ``balanced_cuts`` takes it) must pass every stage of a cut that fits (a
       relaxation: e.g. a stage alone on its rank). Its best cut bounds the heaviest stage from below (None
       when no cut passes: none fits) and is the answer when its ranks fit.
    2. Otherwise a steepest descent from it, and from the cut with no budget, over the cuts one move away
       (``_neighbours``): to the one with the least excess, then the lightest stages (heaviest first), then
       the least distance from equal parts (ties: the first), while that improves, at most ``steps`` times.
    3. Every cut whose stages weigh at most the heaviest stage found (or the most that leaves at most
       ``limit`` cuts) is tried, as ``enumerated_cuts`` tries every cut: a fit there is exact; none
       raises the bound above that weight (and, when step 2 found nothing, the one least over is a last
       start for it).
    None when no cut was found (none fits when step 1 or 3 covered every cut)."""
    n = len(weights)
    points = _positions(candidates, n)
    if nstages <= 1 or len(points) - 1 < nstages:
        return None
    relaxed = balanced_cuts(weights, candidates, nstages, fits)
    if relaxed is None:
        return None
    at = _prefix_at(weights, points)

    def over(rows: np.ndarray) -> np.ndarray:      # (rows of indices into points)
        return np.asarray(excess(points[rows]), dtype=np.float64)

    first = _index_row(points, relaxed)
    bound = int(np.diff(at[first]).max())
    if over(first[None])[0] <= 0:
        return FoundCut(relaxed, True, bound, bound)
    free = _index_row(points, balanced_cuts(weights, candidates, nstages))
    local = _local_search([first] + ([free] if (free != first).any() else []), at, over, steps)
    heaviest = int(np.diff(at[local]).max()) if local is not None else int(at[-1])
    most = _most_enumerable(at, nstages, bound, heaviest, limit)
    if most is not None:
        rows = _cuts_no_heavier(at, nstages, most)
        excesses = over(rows)
        best = _best_fitting(rows, at, excesses <= 0)
        if best is not None:
            found = int(np.diff(at[best]).max())
            return FoundCut([int(points[i]) for i in best[1:-1]], True, found, found)
        bound = most + 1
        if local is None:       # (one more start: the light cut least over)
            local = _local_search([rows[int(np.argmin(excesses))]], at, over, steps)
            heaviest = int(np.diff(at[local]).max()) if local is not None else heaviest
    if local is None:
        return None
    return FoundCut([int(points[i]) for i in local[1:-1]], False, heaviest, bound)


def _prefix_at(weights: list[int], points: np.ndarray) -> np.ndarray:
    """The weight before each of ``points``."""
    return np.concatenate([[0], np.cumsum(np.asarray(weights, dtype=np.int64))])[points]


def _index_row(points: np.ndarray, cuts: list[int]) -> np.ndarray:
    """A cut's bound row as indices into ``points``."""
    return np.asarray([0, *np.searchsorted(points, cuts), len(points) - 1], dtype=np.int64)


def _distance(rows: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Per bound row (indices), the distance from equal parts: the sum of |nstages x prefix - k x total|."""
    nstages = rows.shape[1] - 1
    return np.abs(nstages * at[rows[:, 1:-1]] - np.arange(1, nstages) * int(at[-1])).sum(axis=1)


def _best_fitting(rows: np.ndarray, at: np.ndarray, ok: np.ndarray) -> np.ndarray | None:
    """Of the bound rows (indices) where ``ok``, the one with the lightest heaviest stage, then the least
    distance from equal parts (ties: the first); None when none is ok."""
    if not ok.any():
        return None
    heaviest = np.diff(at[rows], axis=1).max(axis=1)
    least = heaviest[ok].min()
    return rows[int(np.argmin(np.where(ok & (heaviest == least), _distance(rows, at), _INF)))]


def _local_search(starts: list[np.ndarray], at: np.ndarray, over: Excess, steps: int) -> np.ndarray | None:
    """The best cut that fits of the steepest descents from each of ``starts`` (bound rows of indices),
    None when none reaches one."""
    ends = [_descended(row, at, over, steps) for row in starts]
    fitting = [(key, row) for row, key in ends if key[0] <= 0]
    return min(fitting, key=lambda pair: pair[0])[1] if fitting else None


def _keys(rows: np.ndarray, at: np.ndarray, over: Excess) -> list[np.ndarray]:
    """What the descent minimises, most significant first: the excess, the stage weights heaviest first, the
    distance from equal parts."""
    stages = -np.sort(-np.diff(at[rows], axis=1), axis=1)
    return [over(rows), *stages.T, _distance(rows, at)]


def _descended(row: np.ndarray, at: np.ndarray, over: Excess, steps: int) -> tuple[np.ndarray, tuple]:
    """The local optimum the steepest descent from ``row`` reaches, and its key."""
    current = tuple(k[0].item() for k in _keys(row[None], at, over))
    for _ in range(steps):
        rows = _neighbours(row)
        keys = _keys(rows, at, over)
        best = int(np.lexsort(keys[::-1])[0])         # (stable: ties go to the first row)
        key = tuple(k[best].item() for k in keys)
        if key >= current:
            break
        row, current = rows[best], key
    return row, current


def _neighbours(row: np.ndarray) -> np.ndarray:
    """The bound rows (indices, sorted, without ``row``) that move one of ``row``'s cuts anywhere between its
    neighbours, two of them by at most ``_REACH`` positions each, or a run of consecutive cuts together by at
    most ``_REACH`` (stages shifted: what moving weight from one rank to another several stages away takes)."""
    last = len(row) - 1
    moved = []
    for k in range(1, last):
        moved.append(_with(row, [k], [np.arange(row[k - 1] + 1, row[k + 1])]))
        for j in range(k + 1, last):
            adjacent = j == k + 1       # (then each may move past where the other was)
            first = _near(row, k, row[k - 1], row[j + 1] - 1 if adjacent else row[k + 1])
            second = _near(row, j, row[k - 1] + 1 if adjacent else row[j - 1], row[j + 1])
            a, b = (grid.ravel() for grid in np.meshgrid(first, second, indexing="ij"))
            moved.append(_with(row, [k, j], [a[a < b], b[a < b]]))
            shifts = np.arange(-_REACH, _REACH + 1)
            shifts = shifts[(row[k] + shifts > row[k - 1]) & (row[j] + shifts < row[j + 1]) & (shifts != 0)]
            run = np.repeat(row[None], len(shifts), axis=0)
            run[:, k:j + 1] += shifts[:, None]
            moved.append(run)
    rows = np.unique(np.concatenate(moved), axis=0)
    return rows[(rows != row).any(axis=1)]


def _near(row: np.ndarray, k: int, after: int, before: int) -> np.ndarray:
    """The positions at most ``_REACH`` from cut ``k``'s, after ``after`` and before ``before``."""
    return np.arange(max(after + 1, row[k] - _REACH), min(before, row[k] + _REACH + 1))


def _with(row: np.ndarray, columns: list[int], values: list[np.ndarray]) -> np.ndarray:
    """Copies of ``row``, one per value, with ``columns`` set to ``values``."""
    rows = np.repeat(row[None], len(values[0]), axis=0)
    for column, column_values in zip(columns, values):
        rows[:, column] = column_values
    return rows


def _most_enumerable(at: np.ndarray, nstages: int, least: int, most: int, limit: int) -> int | None:
    """The heaviest stage weight, from ``least`` to ``most``, up to which there are at most ``limit`` cuts;
    None when even ``least`` has more."""
    if _count_no_heavier(at, nstages, least, limit) > limit:
        return None
    while least < most:         # (bisection: the count grows with the weight)
        middle = (least + most + 1) // 2
        if _count_no_heavier(at, nstages, middle, limit) > limit:
            most = middle - 1
        else:
            least = middle
    return least


def _count_no_heavier(at: np.ndarray, nstages: int, most: int, limit: int) -> int:
    """How many cuts have every stage weigh at most ``most``, or ``limit + 1`` when more (saturated so that
    the counts stay exact in int64)."""
    m = len(at)
    lightest = np.searchsorted(at, at - most, side="left")    # per end: the first start no heavier than most
    ways = np.zeros(m, dtype=np.int64)
    ways[0] = 1
    for _ in range(nstages):
        before = np.concatenate([[0], np.cumsum(ways)])
        ways = np.minimum(before[:m] - before[lightest], limit + 1)
    return int(ways[-1])


def _cuts_no_heavier(at: np.ndarray, nstages: int, most: int) -> np.ndarray:
    """Every cut whose stages weigh at most ``most``, as bound rows (indices), built a stage at a time. A
    stage ends where the rest can still be cut into the stages left, which is a range: from the first such
    position (the fewest stages the rest needs only falls as the start moves on) to the last that leaves a
    position per stage."""
    m = len(at)
    farthest = np.searchsorted(at, at + most, side="right") - 1     # per start: the last end no heavier
    earliest = _earliest_ends(farthest, nstages)
    rows = np.zeros((1, 1), dtype=np.int64)
    for left in range(nstages - 1, -1, -1):
        last = rows[:, -1]
        low = np.maximum(last + 1, earliest[left])
        high = np.minimum(farthest[last], m - 1 - left)
        counts = np.maximum(high - low + 1, 0)
        which = np.repeat(np.arange(len(rows)), counts)
        offsets = np.arange(len(which)) - np.repeat(np.cumsum(counts) - counts, counts)
        rows = np.hstack([rows[which], (low[which] + offsets)[:, None]])
    return rows


def _earliest_ends(farthest: np.ndarray, nstages: int) -> np.ndarray:
    """Per number of stages left, the first position from which the rest can be cut into them, a stage from
    each start ending at most at ``farthest`` of it (the number of positions when none)."""
    m = len(farthest)
    can = np.zeros(m, dtype=bool)
    can[m - 1] = True
    earliest = [m - 1]
    for _ in range(1, nstages):
        reachable = np.concatenate([[0], np.cumsum(can)])       # can[i + 1 : farthest[i] + 1] has a true
        can = reachable[farthest + 1] - reachable[1:] > 0
        earliest.append(int(np.argmax(can)) if can.any() else m)
    return np.asarray(earliest)


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

"""The pipeline's stage cut: the slowest stage as light as any cut makes it, found exactly."""

from __future__ import annotations

import itertools
import random

from dynshard.planning.stage_cuts import balanced_cuts, enumerated_cuts


def _stages(weights, cuts):
    bounds = [0, *cuts, len(weights)]
    return [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]


def _distance_from_equal(weights, cuts):
    k, total = len(cuts) + 1, sum(weights)
    return sum(abs(k * sum(weights[:c]) - (s + 1) * total) for s, c in enumerate(cuts))


def test_the_cut_is_the_best_of_every_cut_trying_them_all():
    """Against enumerating every cut of 1,500 random graphs (up to 12 ops, 2-5 stages, random positions a
    stage may start at): the heaviest stage is the least any cut reaches, and among those cuts the distance
    from equal parts is the least too."""
    rng = random.Random(0)
    tried = 0
    while tried < 1500:
        n, nstages = rng.randint(2, 12), rng.randint(2, 5)
        weights = [rng.choice([0, 0, 1, 2, 3, 5, 8, 20]) for _ in range(n)]
        candidates = sorted(rng.sample(range(1, n), rng.randint(0, n - 1)))
        if len(candidates) < nstages - 1:
            continue
        tried += 1
        cuts = balanced_cuts(weights, candidates, nstages)
        assert len(cuts) == nstages - 1 and cuts == sorted(set(cuts)) and set(cuts) <= set(candidates)
        best = min((max(_stages(weights, c)), _distance_from_equal(weights, c))
                   for c in itertools.combinations(candidates, nstages - 1))
        assert (max(_stages(weights, cuts)), _distance_from_equal(weights, cuts)) == best, (weights, candidates)


def test_a_heavy_lm_head_moves_the_cut_where_equal_parts_would_not():
    """An embedding, six equal layers and an LM head three layers heavy, in three stages: cutting nearest
    to thirds of the FLOPs (the rule before) gives stages of 11, 16 and 12; the best cut gives 15, 12, 12."""
    weights = [3, 4, 4, 4, 4, 4, 4, 12]
    cuts = balanced_cuts(weights, list(range(1, 8)), 3)
    assert cuts == [4, 7] and _stages(weights, cuts) == [15, 12, 12]
    assert _stages(weights, [3, 7]) == [11, 16, 12]


def test_equal_layers_are_cut_evenly_and_too_few_positions_give_what_exists():
    assert balanced_cuts([1] + [4] * 8 + [1], list(range(1, 10)), 4) == [3, 5, 7]
    assert balanced_cuts([4, 4, 4, 4], [2], 3) == [2]


def test_under_a_memory_budget_the_cut_is_the_best_of_every_cut_whose_stages_fit():
    """Each op also holds bytes, and a stage's rank holds its ops' bytes times the micro-batches its stage
    keeps in flight (1F1B: ``nstages - stage``) plus the stage's parameters: against enumerating every cut of
    1,500 random graphs, the cut is the best of those whose every stage fits, and None when none fits."""
    rng = random.Random(1)
    tried = none = moved = 0
    while tried < 1500:
        n, nstages = rng.randint(2, 12), rng.randint(2, 5)
        weights = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(n)]
        held = [rng.choice([0, 1, 2, 5]) for _ in range(n)]
        kept = [rng.choice([0, 0, 3, 10]) for _ in range(n)]
        budget = rng.randint(5, 60)
        candidates = sorted(rng.sample(range(1, n), rng.randint(0, n - 1)))
        if len(candidates) < nstages - 1:
            continue
        tried += 1

        def stage_bytes(stage, a, b):
            return (nstages - stage) * sum(held[a:b]) + sum(kept[a:b])

        def fits(stage, starts, end):
            return [stage_bytes(stage, int(a), end) <= budget for a in starts]

        def all_fit(cuts):
            bounds = [0, *cuts, n]
            return all(stage_bytes(s, a, b) <= budget for s, (a, b) in enumerate(zip(bounds, bounds[1:])))

        cuts = balanced_cuts(weights, candidates, nstages, fits)
        fitting = [c for c in itertools.combinations(candidates, nstages - 1) if all_fit(c)]
        if not fitting:
            assert cuts is None, (weights, held, kept, budget, candidates)
            none += 1
            continue
        assert cuts is not None and all_fit(cuts) and set(cuts) <= set(candidates)
        best = min((max(_stages(weights, c)), _distance_from_equal(weights, c)) for c in fitting)
        assert (max(_stages(weights, cuts)), _distance_from_equal(weights, cuts)) == best
        moved += cuts != balanced_cuts(weights, candidates, nstages)
    assert none > 100 and moved > 100       # (the budgets bind: some graphs have no cut, others a moved one)


def test_a_row_per_rank_of_interleaved_stages_finds_the_best_of_every_cut_whose_ranks_fit():
    """Interleaved: stage s on rank s % ranks, and a rank holds the bytes of all its stages. Against
    enumerating every cut of 1,000 random graphs: the best of the cuts whose every rank fits, None when none
    does; with no budget, the cut the per-stage search makes."""
    rng = random.Random(2)
    tried = none = 0
    while tried < 1000:
        n, ranks = rng.randint(4, 12), 2
        nstages = ranks * rng.randint(1, 2)
        weights = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(n)]
        held = [rng.choice([0, 1, 2, 5]) for _ in range(n)]
        budget = rng.randint(5, 40)
        candidates = sorted(rng.sample(range(1, n), rng.randint(0, n - 1)))
        if len(candidates) < nstages - 1:
            continue
        tried += 1

        def rank_bytes(bounds):
            return [sum(sum(held[a:b]) for s, (a, b) in enumerate(zip(bounds, bounds[1:])) if s % ranks == r)
                    for r in range(ranks)]

        def fits_all(rows):
            return [max(rank_bytes([int(x) for x in row])) <= budget for row in rows]

        cuts = enumerated_cuts(weights, candidates, nstages, fits_all)
        fitting = [c for c in itertools.combinations(candidates, nstages - 1) if fits_all([[0, *c, n]])[0]]
        if not fitting:
            assert cuts is None
            none += 1
            continue
        best = min((max(_stages(weights, c)), _distance_from_equal(weights, c)) for c in fitting)
        assert cuts is not None and fits_all([[0, *cuts, n]])[0] and set(cuts) <= set(candidates)
        assert (max(_stages(weights, cuts)), _distance_from_equal(weights, cuts)) == best
        free = enumerated_cuts(weights, candidates, nstages, lambda rows: [True] * len(rows))
        assert (max(_stages(weights, free)), _distance_from_equal(weights, free)) == (
            max(_stages(weights, balanced_cuts(weights, candidates, nstages))),
            _distance_from_equal(weights, balanced_cuts(weights, candidates, nstages)))
    assert none > 50
    assert enumerated_cuts([1] * 40, list(range(1, 40)), 8, lambda rows: [True] * len(rows), limit=1000) is None

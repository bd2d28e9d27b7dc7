"""The ranks of a plan unit compare a digest of their inputs: a sampler over the whole world (each rank of
a unit fed its own batch) fails on every rank with the fix, instead of training silently wrong."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from dynshard.runtime.unit_inputs import digest
from workers_unit_inputs import fed_per_rank


@pytest.mark.parametrize("policy", ["tp", "data", "pp"])
def test_ranks_of_a_unit_fed_different_batches_fail_on_every_rank_at_the_first_call(policy):
    results = run_ranks(fed_per_rank, 2, policy, 2, 100, 0)
    for result in results:
        assert result["call"] == 0, result
        assert "ranks 0 and 1 of plan unit 0" in result["error"]
        assert "dynshard.data_parallel_rank(plan_ngpus)" in result["error"]


def test_the_check_repeats_every_nth_call_and_can_be_switched_off():
    every_two, off = run_ranks(fed_per_rank, 2, "tp", 2, 2, 1), run_ranks(fed_per_rank, 2, "tp", 2, 0, 0)
    assert [r["call"] for r in every_two] == [2, 2]        # calls 0 and 2 are checked; 1 slips through
    assert "input 'x'" in every_two[0]["error"] or "input 'y'" in every_two[0]["error"]
    assert [r["error"] for r in off] == [None, None]


def test_digest_tells_apart_other_values_and_another_row_order():
    x = torch.randn(6, 5)
    assert torch.equal(digest(x), digest(x.clone()))
    assert not torch.equal(digest(x), digest(x.flip(0)))
    assert not torch.equal(digest(x), digest(x + 1e-3))
    tokens = torch.randint(0, 50, (4, 8))
    assert not torch.equal(digest(tokens), digest(tokens.roll(1, 0)))
    nan = torch.tensor([float("nan"), 1.0])
    assert torch.isclose(digest(nan), digest(nan.clone()), equal_nan=True).all()

"""Ranks that compile different plans fail at once on every rank, saying who differs and in what."""

from __future__ import annotations

import pytest

from distributed import run_ranks
from workers_agreement import disagreements

EXPECTED = {   # scenario: what the message must name
    "config": "rank 1 differs from rank 0: config policy is 'tp' on rank 0, 'data' on rank 1",
    "model": "rank 1 differs from rank 0: input 'blocks.0.0.weight' has shape (32, 16) float32 on rank 0, "
             "(64, 16) float32 on rank 1",
    "batch": "rank 1 differs from rank 0: input 'x' has shape (4, 16) float32 on rank 0, (2, 16) float32 on rank 1",
    "load_plan_path": "the ranks take their plan from different sources: rank 0 from the policy; rank 1 from "
                      "the plan file load_plan_path (DYNSHARD_LOAD_PLAN_PATH)",
    "autodist": "the ranks take their plan from different sources: rank 0 from autodist's search "
                "(policy='autodist'); rank 1 from the policy",
}


@pytest.fixture(scope="module")
def job():
    """The scenarios of workers_agreement.disagreements on 2 gloo ranks, run once for this module."""
    return run_ranks(disagreements, 2, timeout=120)


@pytest.mark.parametrize("scenario", EXPECTED)
def test_ranks_that_compile_different_plans_all_raise_a_mismatch_error(job, scenario):
    for rank, result in enumerate(r[scenario] for r in job):
        assert result["error"] is not None, f"rank {rank} compiled a plan the other rank does not share"
        assert EXPECTED[scenario] in result["error"], result["error"]
        assert result["seconds"] < 20, f"rank {rank} took {result['seconds']:.0f}s to raise"
    assert job[0][scenario]["error"] == job[1][scenario]["error"]


def test_agreeing_ranks_train_after_a_mismatch(job):
    assert [r["agreeing"]["error"] for r in job] == [None, None]


def test_a_rank_that_never_compiles_is_named_after_the_timeout(job):
    absent = job[0]["absent"]
    assert absent["error"] is not None and "rank 1 did not reach it" in absent["error"], absent["error"]
    assert "up to 3s" in absent["error"] and "TIMEOUT" in absent["error"], absent["error"]
    assert absent["seconds"] < 20

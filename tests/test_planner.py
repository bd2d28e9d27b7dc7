"""Planners (``dynshard.planner``): a policy that returns the whole Plan, mesh and pipeline included, before
the layout exists; rank 0 runs it, every rank executes what it returned, as a loaded plan."""

from __future__ import annotations

import json

import pytest

import dynshard
from distributed import run_ranks
from parity import assert_trains_like_one_process
from workers_planner import EDITED, compile_expecting_error, offline_choice, train_with


def test_a_planner_sees_every_policys_plan_and_returns_one_offline():
    found = run_ranks(offline_choice, 1, timeout=300)[0]
    for name, text in found["seen"].items():
        assert text == found["made"][name], name       # planning.plan(...) is the policy's own plan
    assert found["chosen"] == found["made"]["hybrid"]
    chosen = json.loads(found["chosen"])
    assert chosen["mesh"] == {"world": 8, "dp": 2, "pp": 2, "tp": 2} and chosen["pipeline"]["starts"]
    assert set(found["priced"]) == {"tp", "data"} and all(s > 0 for s in found["priced"].values())


def test_a_planners_edited_tp_plan_is_what_every_rank_runs_and_it_trains_like_one_process():
    results = run_ranks(train_with, 2, "tp_with_first_layer_whole", timeout=300)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")
        plan = json.loads(result["plans"][0])
        assert plan["tensors"][EDITED]["tp"] == "R" and plan["tensors"]["blocks.0.2.weight"]["tp"] == "S1", plan
    assert results[0]["plans"] == results[1]["plans"]


def test_a_planners_pipeline_with_a_moved_stage_boundary_trains_like_one_process():
    results = run_ranks(train_with, 2, "pipeline_cut_earlier", timeout=300)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")
    (first, second), = results[0]["modules"]       # the one pipeline's two stages: the cut the planner moved
    assert any(m.startswith("blocks.1") for m in second) and not any(m.startswith("blocks.1") for m in first), \
        results[0]["modules"]


@pytest.mark.parametrize("name, message", [
    ("made_for_another_world", "was not made for this graph: it was made for 4 ranks and this job has 2"),
    ("failing", "no plan of mine fits this model"),
    ("not_a_plan", "returned str, not a dynshard.Plan"),
])
def test_a_planner_that_fails_or_returns_no_plan_for_this_graph_stops_every_rank_within_seconds(name, message):
    """Rank 0 raises what the planner raised (or PlannerError); the others PlannerError with its text."""
    results = run_ranks(compile_expecting_error, 2, name, timeout=180)
    for rank, result in enumerate(results):
        assert result["error"] and message in result["error"][1], (rank, result)
        assert result["seconds"] < 30, result
    assert results[1]["error"][0] == "PlannerError"


def test_a_planner_is_a_policy_never_called_as_a_placement_policy():
    @dynshard.planner
    def mine(planning):
        return planning.plan(policy="tp")

    config = dynshard.Config(policy=mine, plan_ngpus=2)
    assert "planner" in config.describe() and "mine" in config.describe()
    with pytest.raises(TypeError, match="is a planner"):
        mine(None, config)
    with pytest.raises(TypeError, match="takes a callable"):
        dynshard.planner("tp")

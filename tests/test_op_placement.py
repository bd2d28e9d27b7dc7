"""The per-op placement ILP over DTensor's strategies (autodist's search space, item 2): it finds what trying
every option of every node finds, repeated layers tied choose what untied ones choose, sharding propagation
given its plan places every value as the ILP did, and a job trains like one process on that plan."""

from __future__ import annotations

import json

import pytest

from distributed import run_ranks
from parity import assert_trains_like_one_process
from workers_op_placement import (autodist_candidates, ilp_beside_every_choice, per_op_budget_sweep, per_op_report,
                                  train_on_plan)


@pytest.mark.parametrize("model_name, profile", [
    ("mlp1024", "cuda"),        # the matmuls split, the rest whole
    ("mlp64", "dear"),          # compute dear, collectives free: everything it can split
    pytest.param("mlp16", "cpu", marks=pytest.mark.slow),     # gloo's latency: nothing split
])
def test_the_per_op_ilp_finds_what_trying_every_option_of_every_node_finds(model_name, profile):
    """A two-layer MLP on 2 ranks: the ILP's optimum (its z variables standing for each read's redistribution)
    equals the least objective over all 78,732 assignments of an option to each node, each evaluated
    directly."""
    result = run_ranks(ilp_beside_every_choice, 1, model_name, profile, timeout=300)[0]
    assert result["tried"] == 78732
    assert result["ilp"] == pytest.approx(result["best"], rel=1e-7)
    assert result["ilp_checked"] == pytest.approx(result["ilp"], rel=1e-9)
    assert result["split"] == (profile != "cpu")


def test_propagation_given_the_per_op_plan_places_every_value_as_the_ilp_did_and_beats_tp():
    """A GPT with d 1024 on 2 ranks under the CUDA profile: the ILP runs the attention on the batch's shards
    and the MLP and vocabulary tensor-parallel; given that plan, sharding propagation makes every value's
    placement the ILP chose (no redistribution of its own), and the cost model prices it below the tp
    policy's plan."""
    result = run_ranks(per_op_report, 1, "wide-gpt2", "cuda", timeout=300)[0]
    assert result["status"] == "optimal" and result["lp_integral"]
    assert result["mismatches"] == [] and result["unsaid"] == []
    assert result["predicted"]["per op"] < result["predicted"]["tp"]
    assert result["objective"] == pytest.approx(result["predicted"]["per op"], rel=0.1)
    plan = json.loads(result["plan"])
    assert plan["tensors"]["blocks.0.fc1.weight"]["tp"] == "S0" and plan["tensors"]["blocks.0.fc2.weight"]["tp"] == "S1"
    assert plan["tensors"]["wte.weight"]["tp"] == "S0"
    assert any(a["tp"] == "S0" for a in plan["activations"].values())       # (the batch's shards)


def test_repeated_layers_tied_choose_the_plan_untied_layers_choose():
    """Tied, each layer's nodes share the first layer's variables: fewer edges, the same objective and plan."""
    tied, untied = (run_ranks(per_op_report, 1, "wide-gpt4", "cuda", tie, timeout=300)[0] for tie in (True, False))
    assert tied["edges"] < untied["edges"] / 3
    assert tied["objective"] == pytest.approx(untied["objective"], rel=1e-9)
    assert tied["plan"] == untied["plan"]


def test_under_a_tighter_memory_budget_the_per_op_plan_holds_less_and_is_slower():
    """The memory row: a GPT with d 1024 on 2 ranks under the CUDA profile, budgets of 99% down to 95% of what
    its plan holds without one (splitting saves time and memory alike, so little is left to trade: its plan
    is near the least a rank can hold). Each plan holds at most its budget, each tighter budget costs at
    least as much time, propagation places each plan as planned, and a budget below the least it can hold is
    an error that names it."""
    rows = run_ranks(per_op_budget_sweep, 1, "wide-gpt2", "cuda", (0.99, 0.97, 0.95, 0.5), timeout=300)[0]
    free, *constrained, impossible = rows
    assert free[0] is None and free[3]
    objective = free[2]
    for budget, held, seconds, planned in constrained:
        assert held <= budget * (1 + 1e-9) and planned, (budget, held)
        assert seconds > objective * (1 + 1e-6), (budget, seconds, objective)
        objective = seconds
    assert "a rank holding at most" in impossible[1]


def test_under_a_budget_its_plan_misses_autodist_chooses_the_per_op_plan_with_its_memory_row():
    """The same GPT under mem_constraint 1.6 GB: the per-op plan (1.65 GB) is over it; the ILP with its memory
    row places a plan that fits, faster than every other candidate that fits (recompute or ZeRO rows). The plan
    records that ILP's solve, and explain says it."""
    chosen, candidates, solve, explained = run_ranks(
        autodist_candidates, 1, "wide-gpt2", {"device_profile": "cuda", "update_freq": 1, "mem_constraint": 1.6},
        timeout=300)[0]
    assert solve["status"] == "optimal" and solve["gap"] == 0 and solve["held_bytes"] <= solve["budget_bytes"]
    assert f"per-op ILP over DTensor's strategies ({solve['nodes']} nodes" in explained
    free, fitting = candidates["tp, placed per op"], candidates["tp, placed per op within mem_constraint"]
    assert not free[2] and fitting[2] and fitting[1] < free[1] and fitting[0] > free[0]
    assert chosen == "tp, placed per op within mem_constraint"
    assert all(step > fitting[0] for name, (step, _, fits) in candidates.items() if fits and name != chosen)


def test_a_job_trains_like_one_process_on_the_per_op_plan(tmp_path):
    """The test GPT under a profile where compute is dear and collectives free: the ILP splits every op it can
    (parameters at rest split and gathered where used whole, values read in other placements by some of
    their readers). Two ranks train on that plan like one process (SGD with momentum, strict), issuing the
    forward collectives the plan predicts."""
    report = run_ranks(per_op_report, 1, "gpt", "dear", timeout=300)[0]
    assert report["mismatches"] == [] and report["unsaid"] == []
    plan = json.loads(report["plan"])
    assert any(a["readers"] for a in plan["activations"].values())
    path = tmp_path / "per_op.json"
    path.write_text(report["plan"])
    for rank, result in enumerate(run_ranks(train_on_plan, 2, str(path), timeout=600)):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["collectives"] == report["collectives"], rank

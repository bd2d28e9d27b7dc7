"""The per-op placement ILP over DTensor's strategies (autodist's search space, item 2): it finds what trying
every option of every node finds, repeated layers tied choose what untied ones choose, sharding propagation
given its plan places every value as the ILP did, and a job trains like one process on that plan."""

from __future__ import annotations

import json

import pytest

from distributed import run_ranks
from parity import assert_trains_like_one_process
from workers_op_placement import (autodist_candidates, graph_left_as_it_was, ilp_beside_every_choice,
                                  per_op_budget_sweep, per_op_report, train_on_plan, unit_flops)


@pytest.mark.parametrize("model_name, profile", [
    ("mlp1024x1024", "cuda"),   # the matmuls split, the rest whole (on 8 rows a launch costs more than they)
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
    # (the ILP ranks memory-bound ops by the bytes they touch; the cost model prices the plan's fused traffic)
    assert result["predicted"]["per op"] < result["predicted"]["tp"] < result["objective"]
    plan = json.loads(result["plan"])
    assert plan["tensors"]["blocks.0.fc1.weight"]["tp"] == "S0" and plan["tensors"]["blocks.0.fc2.weight"]["tp"] == "S1"
    assert plan["tensors"]["wte.weight"]["tp"] == "S0"
    assert any(a["tp"] == "S0" for a in plan["activations"].values())       # (the batch's shards)


def test_a_loss_over_the_batchs_shards_is_an_option_and_under_gloo_the_ilp_runs_the_model_on_them():
    """DTensor's ``nll_loss_forward`` strategy refuses log-probabilities split on their classes. Asked with that
    placement among the others, it had given no strategy at all: the ILP could only gather the log-probabilities
    or split the vocabulary. Asked again per combination, its batch split is an option (with its total weight,
    a second partial output, made whole). On the bench GPT under the CPU profile (gloo's latency) the ILP then
    runs the model on the batch's shards as ``data`` does, with the two all-reduces of the loss's sums, where it
    had split the vocabulary (a reduce-scatter, an all-gather and three all-reduces, 0.2033 s predicted)."""
    result = run_ranks(per_op_report, 1, "bench-gpt", "cpu", timeout=300)[0]
    assert result["mismatches"] == [] and result["unsaid"] == []
    assert result["collectives"] == {"all_reduce": 2}
    assert result["predicted"]["per op"] < 0.85 * result["predicted"]["tp"]


def test_on_the_ilps_plan_with_the_loss_over_the_batchs_shards_padded_targets_train_like_one_process(tmp_path):
    """The same plan, the bench GPT's targets padded (-100, a different count in each row, so each rank's
    rows hold a different share of the loss's weight): two ranks train like one process (SGD, strict)."""
    path = tmp_path / "per_op.json"
    path.write_text(run_ranks(per_op_report, 1, "bench-gpt", "cpu", timeout=300)[0]["plan"])
    for rank, result in enumerate(run_ranks(train_on_plan, 2, str(path), "bench-gpt", timeout=600)):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["collectives"] == {"all_reduce": 2}, rank


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
    assert solve.status == "optimal" and solve.gap == 0 and solve.held_bytes <= solve.budget_bytes
    assert f"per-op ILP over DTensor's strategies ({solve.nodes} nodes" in explained
    free, fitting = candidates["tp, placed per op"], candidates["tp, placed per op within mem_constraint"]
    assert not free[2] and fitting[2] and fitting[1] < free[1] and fitting[0] > free[0]
    assert chosen == "tp, placed per op within mem_constraint"
    assert all(step > fitting[0] for name, (step, _, fits) in candidates.items() if fits and name != chosen)


@pytest.mark.parametrize("model_name", ["fused-gpt", "llama"])
def test_placing_candidates_on_one_lowered_graph_leaves_it_as_it_was(model_name):
    """A search places every candidate on one lowered graph, not on copies of it: the tp policy (its trials),
    the per-op ILP's plan given, data and tp + sequence parallel leave its nodes, arguments and values as they
    were."""
    assert run_ranks(graph_left_as_it_was, 1, model_name, timeout=300)[0] == {
        "per op": True, "data": True, "tp + sp": True}


def test_a_fused_projection_costs_what_its_three_projections_cost():
    """nanoGPT's c_attn, split into one matmul per block for the unit: the cost model counts the FLOPs and
    bytes of the blocks' matmuls (they had no values on FakeTensors, and counted nothing)."""
    assert run_ranks(unit_flops, 1, "fused-gpt")[0] == run_ranks(unit_flops, 1, "gpt")[0]


def test_a_fused_projection_is_split_by_blocks_where_its_three_projections_are_split():
    """Under a profile where compute is dear, the ILP holds the fused c_attn weight as this rank's rows of each
    block (``S0x3``, the tp policy's placement for it) where it splits the unfused q, k and v weights, and
    places everything else alike; propagation places every value as it planned."""
    fused, unfused = (run_ranks(per_op_report, 1, name, "dear", timeout=300)[0] for name in ("fused-gpt", "gpt"))
    assert fused["mismatches"] == [] and fused["unsaid"] == []
    fused_tp = {name: t["tp"] for name, t in json.loads(fused["plan"])["tensors"].items()}
    unfused_tp = {name: t["tp"] for name, t in json.loads(unfused["plan"])["tensors"].items()}
    for layer in (0, 1):
        attn = f"blocks.{layer}.attn"
        assert fused_tp.pop(f"{attn}.c_attn.weight") == "S0x3"
        assert {unfused_tp.pop(f"{attn}.{p}.weight") for p in "qkv"} == {"S0"}
        # (the biases split alike: Megatron's column-parallel bias, equally fast and held in half)
        assert fused_tp.pop(f"{attn}.c_attn.bias") == "S0x3"
        assert {unfused_tp.pop(f"{attn}.{p}.bias") for p in "qv"} == {"S0"}
    assert fused_tp == unfused_tp       # (collectives are free in this profile: how many it issues is a tie)


@pytest.mark.parametrize("model_name", ["gpt", "fused-gpt", "llama", "gpt2"])
def test_a_job_trains_like_one_process_on_the_per_op_plan(tmp_path, model_name):
    """A test model under a profile where compute is dear and collectives free: the ILP splits every op it can
    (parameters at rest split and gathered where used whole, a fused projection's blocks, values read in other
    placements by some of their readers; transformers' Llama with grouped-query attention, and GPT-2 with its
    fused ``Conv1D`` projection). Two ranks train on that plan like one process (SGD with momentum, strict),
    issuing the forward collectives the plan predicts."""
    report = run_ranks(per_op_report, 1, model_name, "dear", timeout=300)[0]
    assert report["mismatches"] == [] and report["unsaid"] == []
    plan = json.loads(report["plan"])
    assert any(a["readers"] for a in plan["activations"].values())
    path = tmp_path / "per_op.json"
    path.write_text(report["plan"])
    for rank, result in enumerate(run_ranks(train_on_plan, 2, str(path), model_name, timeout=600)):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["collectives"] == report["collectives"], rank

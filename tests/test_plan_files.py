"""The plan as a value: a job saves the plans it ran, a job loads them (no policy runs) and trains the same,
a plan edited by hand is honoured, a plan made for something else fails on every rank, and plans made
offline for a job's world equal the job's own."""

from __future__ import annotations

import json
import re
import time

import pytest

from distributed import run_ranks
from parity import assert_trains_like_one_process
from workers_plan_files import edit, load_edited, load_expecting_error, offline, plan_64_ranks, save_then_load

CASES = {
    "dp": dict(kind="spmd", policy="dp", plan_ngpus=1, world=2),
    "tp": dict(kind="spmd", policy="tp", plan_ngpus=2, world=2, model="gpt"),
    "zero3": dict(kind="spmd", policy="dp", plan_ngpus=1, world=2, options={"use_zero": 3}),
    "tp_zero1": dict(kind="spmd", policy="tp", plan_ngpus=2, world=4, options={"use_zero": 1}),
    "pp_1f1b": dict(kind="pipeline", policy="pp", plan_ngpus=2, world=2),
    "hybrid": dict(kind="pipeline", policy="hybrid", plan_ngpus=4, world=4, pas_config={"pipeline_nstages": 2}),
}
SLOW = {"tp_zero1", "hybrid"}      # 4 ranks


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES])
def test_a_saved_plan_loads_bit_for_bit_and_trains_like_one_process_without_a_policy(tmp_path, name):
    case = CASES[name]
    results = run_ranks(save_then_load, case["world"], case, str(tmp_path), timeout=600)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result["first"], f"rank {rank} planning")
        assert_trains_like_one_process(result["second"], f"rank {rank} loading")
    saved = results[0]["saved"]
    assert results[0]["again"] == saved             # the loaded job ran, and saved, exactly that plan
    if case["kind"] == "spmd":                      # explain(model).plans: the plan each program runs
        assert [r["second"]["plans"] for r in results] == [[saved]] * case["world"]
    plan = json.loads(saved)
    assert plan["mesh"]["world"] == case["world"] and plan["policy"] == case["policy"]
    if name == "tp_zero1":
        assert plan["mesh"] == {"world": 4, "dp": 2, "pp": 1, "tp": 2} and plan["zero"]["level"] == 1
        assert {t["dp"] for t in plan["tensors"].values() if t["kind"] == "parameter"} == {"zero"}
    if name == "tp":
        assert any(t["tp"] != "R" for t in plan["tensors"].values())
    if case["kind"] == "pipeline":
        assert plan["pipeline"]["starts"] == ["blocks.2"] and plan["pipeline"]["schedule"] == "1f1b"
    if name == "hybrid":        # each stage's tp placements are in the plan, planned with the cut
        assert plan["tensors"]["blocks.0.fc1.weight"]["tp"] == "S0" and plan["tensors"]["blocks.3.fc2.weight"]["tp"] == "S1"


def test_a_hand_edited_plan_is_honoured_a_parameter_made_whole_and_a_stage_boundary_moved(tmp_path):
    tp = run_ranks(offline, 1, CASES["tp"], 2)[0][0]
    whole = "blocks.0.fc1.weight"
    assert json.loads(tp)["tensors"][whole]["tp"] == "S0"
    path = tmp_path / "tp.plan.json"

    def make_whole(data):
        data["tensors"][whole]["tp"] = "R"
        data["tensors"]["blocks.0.fc1.bias"]["tp"] = "R"
        data["recompute"] = ["Block"]

    path.write_text(edit(tp, make_whole))
    results = run_ranks(load_edited, 2, CASES["tp"], str(path), timeout=300)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["parallel_dims"][whole] is None and result["parallel_dims"]["blocks.1.fc1.weight"] == 0
        assert result["local_numel"][whole] == 2 * result["local_numel"]["blocks.1.fc1.weight"]

    pp = run_ranks(offline, 1, CASES["pp_1f1b"], 2)[0][0]
    assert json.loads(pp)["pipeline"]["starts"] == ["blocks.2"]
    path = tmp_path / "pp.plan.json"
    path.write_text(edit(pp, lambda data: data["pipeline"].update(starts=["blocks.1"])))
    results = run_ranks(load_edited, 2, CASES["pp_1f1b"], str(path), timeout=300)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")
    assert results[0]["modules"][0] == [("wte", "wpe", "blocks.0"), ("blocks.1", "blocks.2", "blocks.3", "ln_f",
                                                                       "lm_head")]


def test_a_loaded_plan_runs_as_it_says_whatever_the_jobs_config_asks(tmp_path):
    """The plan is what runs: a job whose config asks for ZeRO-3, bf16 compute and recompute, given a plain
    dp plan, keeps every parameter whole, computes in float32 (so it trains like one process) and records
    the plan it was given."""
    dp = run_ranks(offline, 1, CASES["dp"], 2)[0][0]
    path = tmp_path / "dp.plan.json"
    path.write_text(dp)
    asks = {"use_zero": 3, "mixed_precision": {"param_dtype": "bfloat16"}, "recompute_modules": "Linear"}
    results = run_ranks(load_edited, 2, CASES["dp"], str(path), asks, timeout=300)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["local_numel"] == {name: result["params"][name].numel() for name in result["local_numel"]}
        assert result["plans"] == [dp]
        assert not [c for c in result["collectives"] if c[1] != "all_reduce"]     # no ZeRO gathers


def test_a_plan_for_other_shapes_another_world_or_a_corrupt_file_fails_on_every_rank_at_once(tmp_path):
    mlp = dict(kind="spmd", policy="tp", plan_ngpus=2)
    other_world = run_ranks(offline, 1, mlp, 4)[0][0]
    (tmp_path / "world4.json").write_text(other_world)
    (tmp_path / "corrupt.json").write_text(other_world[:200])
    (tmp_path / "not_a_plan.json").write_text('{"placements": {}}')
    two = run_ranks(offline, 1, mlp, 2)[0][0]
    (tmp_path / "batch4.json").write_text(two)
    for name, batch, expected in [
            ("world4.json", 4, "it was made for 4 ranks and this job has 2"),
            ("batch4.json", 8, "input 'x' is [4, 16] float32 in the plan and [8, 16] float32 here"),
            ("corrupt.json", 4, "is not valid JSON"),
            ("not_a_plan.json", 4, "is not a dynshard plan"),
            ("missing.json", 4, "cannot read the plan file")]:
        path = str(tmp_path / name)
        results = run_ranks(load_expecting_error, 2, path, batch, timeout=120)
        for rank, result in enumerate(results):
            assert result["error"] is not None, (name, rank)
            kind, message = result["error"]
            assert kind == "PlanFileError" and path in message and expected in message, (name, rank, message)
            assert result["seconds"] < 20, (name, result)


@pytest.mark.parametrize("world,case,meta", [(2, "tp", True), pytest.param(4, "tp_zero1", False, marks=pytest.mark.slow),
                                             (2, "pp_1f1b", False)])
def test_plans_made_offline_for_the_jobs_world_equal_the_jobs_own(tmp_path, world, case, meta):
    """(the tp GPT planned on the meta device: its graph bakes the device into torch.arange, which the plan's
    fingerprint leaves out)"""
    made = run_ranks(offline, 1, CASES[case], world, meta)[0]
    job = run_ranks(save_then_load, world, CASES[case], str(tmp_path), timeout=600)
    assert made == [job[0]["saved"]]


def test_an_offline_plan_for_64_ranks_of_a_32_layer_gpt_on_the_meta_device_takes_seconds():
    import dynshard

    start = time.perf_counter()
    (text, explained), = run_ranks(plan_64_ranks, 1, timeout=120)[0]
    seconds = time.perf_counter() - start       # (with the process's start and imports)
    assert seconds < 60, seconds
    plan = dynshard.Plan.from_json(text)
    assert (plan.mesh.dp, plan.mesh.pp, plan.mesh.tp) == (4, 4, 4) and plan.zero.level == 1
    assert plan.pipeline.starts == ("blocks.8", "blocks.16", "blocks.24")
    assert plan.tensors["blocks.9.attn.q.weight"].tp == "S0" and plan.tensors["wte.weight"].tp == "S0"
    assert "pipeline rank 3 (stages 3)" in explained and "all_gather  dp" in explained
    # per micro-batch: Megatron's 2 per layer, the vocabulary's lookup and loss (68); 16 micro-batches a step
    assert re.search(r"all_reduce +tp +1088 ", explained), explained

"""policy="autodist": its typed pas_config, a space that holds the hand policies' own plans, a memory budget
that moves the choice and is kept, the same plan for the same inputs, and a job that trains like one
process on the plan it chose."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import dynshard
from dynshard.config import ConfigError
from dynshard.planning import Plan
from dynshard.autodist.choices import choose
from dynshard.autodist.cost_model import predict
from dynshard.autodist.device_profile import DEFAULT_PROFILES
from dynshard.autodist.space import with_choices
from distributed import run_ranks
from parity import assert_trains_like_one_process
from workers_pipeline import pipeline_parity
from workers_transformers import train_transformers
from workers_autodist import (candidate_plans_beside_hand_plans, estimated_variants_beside_planned,
                              llama3_8b_over_64_ranks, llama_with_zero_faster_than_without,
                              hand_predictions_beside_autodists, hybrid_candidates,
                              hybrid_stage_cut_under_a_budget, interleaved_stage_cut_under_a_budget, measured_peaks,
                              memory_budget_sweep, nothing_fits, offline_autodist,
                              pipeline_candidates_beside_hand_plans, planned_units_of, predicted_tp_collectives,
                              stage_cut_under_a_budget, traced_tp_collectives, train_step_without_pipeline,
                              train_with_autodist, within_partition_degree)


@pytest.mark.parametrize("pas_config, message", [
    ({"mem_constraint": 70, "bogus": 1}, "no option 'bogus'"),
    ({"mem_constraint": -1}, "GB per device, a positive number"),
    ({"update_freq": 0}, "'update_freq'] must be a positive integer"),
    ({"use_bf16": True}, "set mixed_precision"),
    ({"use_fp16": True, "use_bf16": True}, "choose one"),
    ({"explore_pipeline": True}, "needs use_end2end=True"),
    ({"partition_constraints_path": "/no/pins.json"}, "cannot read the partition constraints file"),
    ({"pipeline_scheduler": "1f1b_plus"}, "searches the pipeline schedules"),
    ({"pipeline_scheduler": "chimera_direct", "update_freq": 4}, "plan_ngpus must be 4"),
    ({"transient_mem_coef": "2"}, "transient_mem_coef"),
])
def test_bad_pas_config_values_are_errors_that_say_what_to_change(pas_config, message):
    with pytest.raises(ConfigError, match=message):
        dynshard.Config(policy="autodist", plan_ngpus=2, pas_config=pas_config)


def test_nnscalers_plan_file_keys_map_onto_the_configs():
    config = dynshard.Config(policy="autodist", pas_config={"save_plan_path": "a.json", "mem_constraint": 70})
    assert config.save_plan_path == "a.json" and config.autodist.mem_constraint_bytes == 70 * 1024 ** 3
    with pytest.raises(ConfigError, match="differ; set one"):
        dynshard.Config(policy="autodist", save_plan_path="b.json", pas_config={"save_plan_path": "a.json"})


@pytest.mark.slow       # (128 plans made twice: about two minutes)
def test_every_candidate_is_the_plan_its_hand_policy_makes():
    """tp, tp + sequence (or batch) parallelism, data, and tp with each proper subset of the kinds of layer it
    splits left whole (pinned), or run on the unit's batch shards (pinned, ``batch_parallel``), at every ZeRO
    level over 2 units, with and without recompute: each candidate is byte for byte the plan that policy and
    config make (autodist's space holds them; a variant is read off tp's plan, and equals tp's with pins; one of
    several kinds is priced from its parts and planned for real with the estimate's placements)."""
    rows = run_ranks(candidate_plans_beside_hand_plans, 1, 4, timeout=600)[0]
    names = [name for name, _, _ in rows]
    attention, mlp = "blocks.*.attn.{k,proj,q,v}", "blocks.*.{fc1,fc2}"
    subsets = {attention, mlp, "wte", f"{mlp} and {attention}", f"wte and {attention}", f"wte and {mlp}"}
    variants = {f"tp, {kinds} {where}" for kinds in subsets for where in ("whole", "on batch shards")}
    assert len(names) == 16 * 4 * 2 and {"tp", "tp + sequence parallel + ZeRO-3", "tp + batch parallel + ZeRO-2",
                                         "data + ZeRO-1 + recompute Block",
                                         "tp, wte whole + ZeRO-3 + recompute Block"} | variants <= set(names)
    for name, candidate, hand in rows:
        assert candidate == hand, name


@pytest.mark.parametrize("model_name", ["gpt", pytest.param("llama", marks=pytest.mark.slow)])
def test_a_variant_of_several_kinds_priced_from_its_parts_is_priced_as_its_plan(model_name):
    """Each tp variant with several kinds of layer whole or on batch shards is priced from the variants with
    one kind each (their changes to tp, or to tp with batch parallelism, summed), and not planned: the
    estimate places every tensor and activation as the plan autodist makes for real, finds the same forward
    collectives, and predicts the same step seconds and peak bytes (each term)."""
    rows = run_ranks(estimated_variants_beside_planned, 1, model_name, timeout=300)[0]
    expected = {"gpt": 6, "llama": 2 * (2 ** 4 - 2 - 4)}[model_name]
    assert len(rows) == expected, [name for name, _, _ in rows]
    for name, (estimate, collectives, tensors, activations), (real, *planned) in rows:
        assert (collectives, tensors, activations) == tuple(planned), name
        assert estimate.step_seconds == pytest.approx(real.step_seconds, rel=1e-9), name
        assert dataclasses.asdict(estimate.bytes_per_rank) == pytest.approx(dataclasses.asdict(real.bytes_per_rank),
                                                                             rel=1e-9), name


def test_a_tighter_memory_budget_moves_the_choice_toward_saving_memory_and_the_plan_fits_it():
    free, *tighter, error = run_ranks(memory_budget_sweep, 1, 4, timeout=300)[0]
    free = json.loads(free)
    peaks = sorted({c["peak_bytes"] for c in free["predicted"]["autodist"]["candidates"]}, reverse=True)
    chosen = [free]
    for peak, plan in zip((peaks[len(peaks) // 3], peaks[2 * len(peaks) // 3], peaks[-1]), map(json.loads, tighter)):
        assert plan["predicted"]["bytes_per_rank"]["peak"] <= peak
        assert plan["predicted"]["step_seconds"] >= chosen[-1]["predicted"]["step_seconds"]
        chosen.append(plan)
    assert chosen[-1]["predicted"]["bytes_per_rank"]["peak"] <= peaks[-1] < free["predicted"]["bytes_per_rank"]["peak"]
    assert len({p["predicted"]["autodist"]["chosen"] for p in chosen}) >= 3
    assert error.startswith("AutodistError") and "mem_constraint" in error and "smallest peak" in error, error


def test_the_same_inputs_give_a_byte_identical_plan():
    first, second = (run_ranks(offline_autodist, 1, 4, {"update_freq": 2}, timeout=300)[0] for _ in range(2))
    assert first == second and Plan.from_json(first).to_json() == first      # (its typed prediction too)
    plan = json.loads(first)
    assert plan["policy"] == "autodist" and plan["predicted"]["autodist"]["status"] == "optimal"
    assert plan["predicted"]["autodist"]["chosen"] == min(plan["predicted"]["autodist"]["candidates"],
                                                          key=lambda c: c["step_seconds"])["plan"]


def test_a_two_rank_job_trains_like_one_process_on_the_plan_autodist_chose_and_saves_it(tmp_path):
    results = run_ranks(train_with_autodist, 2, str(tmp_path / "plan.json"), timeout=600)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["plans"] == [result["saved"]]       # explain(model).plans: the plan it ran, saved
    plan = json.loads(results[0]["saved"])
    assert plan["policy"] == "autodist" and plan["mesh"]["tp"] == 2
    assert plan["predicted"]["autodist"]["chosen"] in {c["plan"] for c in plan["predicted"]["autodist"]["candidates"]}
    assert "autodist chose" in results[0]["explain"]


def test_under_a_budget_autodist_keeps_some_kinds_of_layer_whole_and_the_job_trains_like_one_process(tmp_path):
    """The test GPT on 2 ranks under 0.0005 GB: data does not fit, tp does, and tp with its vocabulary and
    attention whole (their all-reduces gone, their weights held whole), the MLP split, fits and is predicted
    faster than tp and than any one kind left whole: autodist chooses it, and the job runs that plan like one
    process."""
    results = run_ranks(train_with_autodist, 2, str(tmp_path / "plan.json"), {"mem_constraint": 0.0005}, timeout=600)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")
    plan = json.loads(results[0]["saved"])
    chosen = plan["predicted"]["autodist"]["chosen"]
    assert chosen.startswith("tp, wte and blocks.*.attn.{k,proj,q,v} whole"), chosen
    assert plan["tensors"]["wte.weight"]["tp"] == plan["tensors"]["blocks.0.attn.q.weight"]["tp"] == "R"
    assert plan["tensors"]["blocks.0.fc1.weight"]["tp"] == "S0"
    rows = {c["plan"]: c for c in plan["predicted"]["autodist"]["candidates"]}
    singles = [c for name, c in rows.items() if name.startswith("tp, ") and " and " not in name.split(" whole")[0]]
    assert singles and all(c["step_seconds"] > plan["predicted"]["step_seconds"] for c in singles if c["fits"])
    assert not rows["data"]["fits"] and rows["tp"]["fits"] and rows["tp"]["step_seconds"] > plan["predicted"]["step_seconds"]


@pytest.mark.parametrize("mem_constraint", [0.00045, pytest.param(0.00055, marks=pytest.mark.slow)])
def test_the_chosen_plans_measured_peak_stays_under_mem_constraint_and_its_prediction(mem_constraint):
    """A training step's peak per rank (parameters, gradients, Adam's state, activations, temporaries), as
    dynshard.peak_memory measures it on the steady steps, under the budget and under the predicted peak (an
    upper bound: the activations predicted are the eager autograd's saved set)."""
    for rank, result in enumerate(run_ranks(measured_peaks, 2, mem_constraint, timeout=300)):
        predicted = result["predicted"]
        assert result["binds"], result["chosen"]        # (the fastest plan is over the budget)
        for at_start, during in result["peaks"][1:]:
            # at rest: the parameters and Adam's moments as predicted, and Adam's step counters (4 bytes each)
            assert 0 < at_start - predicted.parameters - predicted.optimizer < 1024, (rank, result)
            assert during > predicted.gradients, (rank, result)
            assert at_start + during <= predicted.peak <= mem_constraint * 1024 ** 3, (rank, result)


def test_a_budget_nothing_fits_fails_on_every_rank_before_any_step():
    errors = run_ranks(nothing_fits, 2, timeout=300)
    for error in errors:
        assert error.startswith("AutodistError") and "mem_constraint" in error and "smallest peak" in error, error


def _every_choice(base, unit, nmicros, profile) -> list[tuple[float, float]]:
    """(step seconds, peak bytes) of every recompute set with every set of parameters in ZeRO rows."""
    eligible = [name for name, t in base.tensors.items() if t.kind == "parameter" and t.dp == "zero"]
    paths = [i.path for i in unit.instances]
    found = []
    for mask in range(2 ** (len(paths) + len(eligible))):
        recompute = tuple(p for k, p in enumerate(paths) if mask >> k & 1)
        rows = {name for k, name in enumerate(eligible) if mask >> (len(paths) + k) & 1}
        plan = dataclasses.replace(base, recompute=recompute, tensors={
            name: dataclasses.replace(t, dp="replicate") if t.dp == "zero" and name not in rows else t
            for name, t in base.tensors.items()})
        predicted = predict(plan, unit, nmicros, profile, 2.0)
        found.append((predicted.step_seconds, predicted.bytes_per_rank.peak))
    return found


@pytest.mark.parametrize("level", [1, 3])
def test_the_ilp_finds_what_trying_every_recompute_and_zero_choice_finds(level):
    """2 blocks of an MLP and its 10 parameters over 2 units: 4096 choices, each priced, against the ILP's one
    solve at each of 17 budgets from the tightest to the loosest."""
    (placement, base, unit), = run_ranks(planned_units_of, 1, "mlp", 2, 1, timeout=300)[0]
    base = with_choices(Plan.from_json(base), level, (), False, 1)
    profile = DEFAULT_PROFILES["cpu"]
    every = _every_choice(base, unit, 1, profile)
    low, high = min(peak for _, peak in every), max(peak for _, peak in every)
    chosen = set()
    for budget in [low + (high - low) * k / 16 for k in range(17)]:
        choice = choose(base, unit, 1, profile, 2.0, budget, search_recompute=True)
        expected = min(step for step, peak in every if peak <= budget)
        assert choice.solution.status == "optimal" and choice.solution.gap == 0.0
        got = predict(choice.plan, unit, 1, profile, 2.0)
        assert got.bytes_per_rank.peak <= budget
        assert got.step_seconds == pytest.approx(expected, rel=1e-9), budget
        chosen.add((choice.plan.recompute, tuple(t.dp for t in choice.plan.tensors.values())))
    assert len(chosen) >= 2         # (the budgets move the choice)


def test_repeated_layers_tied_choose_as_fast_a_plan_as_a_variable_for_each_instance_and_parameter():
    """A 6-layer GPT over 2 units at each ZeRO level, at 9 budgets from the tightest to the loosest: the
    ILP with each repeated layer's instances and parameters as counts has far fewer variables and reaches
    the same optimum as the ILP with a 0/1 variable each; its plan fits and is predicted at its objective."""
    (placement, base, unit), = run_ranks(planned_units_of, 1, "gpt, 6 layers", 2, 1, timeout=300)[0]
    profile = DEFAULT_PROFILES["cpu"]
    chosen = set()
    for level in (1, 2, 3):
        plan = with_choices(Plan.from_json(base), level, (), False, 1)
        peaks = [predict(with_choices(plan, level, recompute, False, 1), unit, 1, profile, 2.0).bytes_per_rank.peak
                 for recompute in ((), (unit.recompute_class,))]     # (every parameter in rows)
        low, high = min(peaks), max(peaks) * 1.2      # (the predicted peak is rounded up to bytes: it fits itself)
        for budget in [low + (high - low) * k / 8 for k in range(9)]:
            tied, untied = (choose(plan, unit, 1, profile, 2.0, budget, search_recompute=True, tie=tie)
                            for tie in (True, False))
            assert tied.solution.status == untied.solution.status == "optimal", (level, budget)
            assert len(tied.solution.x) < len(untied.solution.x) / 4
            assert tied.solution.objective == pytest.approx(untied.solution.objective, rel=1e-9), (level, budget)
            got = predict(tied.plan, unit, 1, profile, 2.0)
            assert got.bytes_per_rank.peak <= budget
            # (predict rounds to 6 significant digits: up to 5e-6 apart)
            assert got.step_seconds == pytest.approx(tied.solution.objective, rel=5e-6), (level, budget)
            chosen.add((len(tied.plan.recompute), sum(t.dp == "zero" for t in tied.plan.tensors.values())))
    # (the budgets move both choices: some instances recomputed, not all; parameters in rows or not)
    assert any(0 < n < 6 for n, _ in chosen) and {rows > 0 for _, rows in chosen} == {True, False}, chosen


def test_a_recomputed_block_is_priced_as_the_forward_ops_its_backward_runs_again():
    """Both partitioners re-run what the backward reads, matmuls and attention included, not the whole forward:
    a block's output projection (fc2) feeds only its output, so it is not run again, and under tp neither is
    the attention's projection, whose reduced output is kept instead (test_recompute counts the matmuls the
    compiled backward runs again: 5 a block under dp, 4 under tp). The price is FlopCounterMode's count of
    the rest on real tensors (split in two under tp); a recompute keeps the block's input, and under tp the
    reduced projection."""
    from torch.utils.flop_counter import FlopCounterMode

    from models import GPT, GPTConfig

    cfg = GPTConfig()
    x = torch.randn(4, cfg.seq, cfg.d_model)        # (a rank's micro-batch: the batch of 4 rows on each rank)
    with FlopCounterMode(display=False) as counter:
        GPT(cfg).blocks[0](x)
    flops = {name: sum(counts.values()) for name, counts in counter.get_flop_counts().items()}
    again = {"dp": flops["Block"] - flops["Block.fc2"],
             "tp": (flops["Block"] - flops["Block.fc2"] - flops["Block.attn.proj"]) / 2}
    kept = {"dp": x.numel() * x.element_size(), "tp": 2 * x.numel() * x.element_size()}
    units = {placement.name: unit for placement, _, unit in
             run_ranks(planned_units_of, 1, "gpt", 2, 1, timeout=300)[0] + run_ranks(
                 planned_units_of, 1, "gpt", 2, 2, timeout=300)[0]}
    for name in ("dp", "tp"):
        assert len(units[name].instances) == cfg.layers
        for instance in units[name].instances:
            assert again[name] > 0, name
            assert instance.flop_seconds == pytest.approx(again[name] / DEFAULT_PROFILES["cpu"].flops_per_s, rel=1e-12), name
            assert instance.entry_bytes == kept[name], name


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_autodists_plan_of_a_transformers_llama_trains_like_one_process(world):
    """SGD with momentum, strict parity; at 4 ranks the plan is split over tp and replicated (or ZeRO) over
    2 data-parallel units."""
    results = run_ranks(train_transformers, world, "llama", 2, False, 3, "autodist", timeout=600)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert "autodist chose" in result["explain"]


def test_exploring_pipelines_autodist_runs_the_pipeline_it_chose_through_train_step_like_one_process():
    """The example GPT on 2 ranks, 4 micro-batches: the built-in CPU profile prices a 2-stage pipeline below
    tp and data (whose collectives pay gloo's latency per micro-batch); train_step learns at the first call
    that the plan is a pipeline, and runs its schedule."""
    results = run_ranks(pipeline_parity, 2, "gpt", 2, {"explore_pipeline": True, "update_freq": 4}, "train_step", 2,
                        8, "autodist", timeout=600)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["modules"] and len(result["modules"][0]) == 2        # it ran as 2 pipeline stages


def test_autodists_interleaved_pipeline_runs_two_stages_a_rank_through_train_step_like_one_process():
    """Restricted to 1f1b_interleaved (pas_config's pipeline_scheduler), the search prices two stages per
    pipeline rank, cut where the slowest stage is lightest, and the job runs the four stages it chose."""
    results = run_ranks(pipeline_parity, 2, "gpt", 2, {"explore_pipeline": True, "update_freq": 4,
                                                       "pipeline_scheduler": "1f1b_interleaved"},
                        "train_step", 2, 8, "autodist", timeout=600)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["modules"] and len(result["modules"][0]) == 4        # 4 stages, 2 on each rank


def test_autodists_chimera_pipeline_runs_each_stage_on_two_ranks_through_train_step_like_one_process():
    """Restricted to chimera_direct over a unit of 4, the search prices its two lanes (every stage on two ranks,
    each pair summing its copies' gradients once a step) and the job runs the plan it chose like one process."""
    results = run_ranks(pipeline_parity, 4, "gpt", 4, {"explore_pipeline": True, "update_freq": 4,
                                                       "pipeline_scheduler": "chimera_direct"},
                        "train_step", 2, 8, "autodist", timeout=600)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["schedules"] == ["chimera_direct"] and len(result["modules"][0]) == 4, result["modules"]


@pytest.mark.slow       # (about 40 s; the stage-cut search is tested fast in test_stage_cuts)
def test_under_a_budget_the_balanced_cut_misses_autodist_moves_the_stage_cut_and_trains_like_one_process():
    """An 8-layer GPT in 2 stages under 1F1B: the first rank holds two micro-batches, the last one. One byte
    under the FLOPs-balanced cut's peak (4 | 4 layers), autodist cuts where the slowest stage is lightest among
    the cuts whose ranks fit: it is the fastest fitting of the pp policy's plans cut before each layer
    (pipe_split(), priced by the same model), and train_step runs it like one process."""
    found = run_ranks(stage_cut_under_a_budget, 1, timeout=300)[0]
    free, tight, budget, every = (Plan.from_json(found["free"]), Plan.from_json(found["tight"]), found["budget"],
                                  found["every"])
    assert free.pipeline.starts == ("blocks.4",) and every["blocks.4"][1] == free.predicted.cost.bytes_per_rank.peak
    fitting = {start: cost for start, cost in every.items() if cost[1] <= budget}
    best = min(fitting, key=lambda start: fitting[start])
    assert tight.pipeline.starts == (best,) != free.pipeline.starts
    assert tight.predicted.cost.bytes_per_rank.peak == every[best][1] <= budget
    assert tight.predicted.cost.step_seconds == pytest.approx(every[best][0], rel=1e-5)
    assert "within mem_constraint" in tight.pipeline.how
    results = run_ranks(pipeline_parity, 2, "gpt8", 2, {
        "explore_pipeline": True, "update_freq": 4, "max_partition_degree": 1, "pipeline_scheduler": "1f1b",
        "recompute_modules": "", "mem_constraint": budget / 1024 ** 3}, "train_step", 2, 16, "autodist", timeout=600)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["modules"][0][1][0] == best           # the second stage starts where autodist cut


@pytest.mark.slow       # (about 30 s; the pp policy's moved cut trains in the default suite)
def test_under_a_budget_a_hybrid_pipelines_stage_cut_moves_where_the_hybrid_policys_fastest_fitting_cut_is():
    """The same 8-layer GPT in 2 stages of tp 2 (4 ranks): one byte under the balanced hybrid candidate's peak,
    autodist offers the hybrid with its cut moved, priced from the tp plan as every hybrid candidate is. That
    candidate is the fastest fitting of the hybrid policy's plans cut before each layer (pipe_split(), planned
    for real and priced by the same model), at the same price."""
    found = run_ranks(hybrid_stage_cut_under_a_budget, 1, timeout=300)[0]
    budget, every, tight = found["budget"], found["every"], Plan.from_json(found["tight"])
    assert found["free"]["hybrid pp 2 x tp 2 1f1b"].fits
    rows = {c.plan: c for c in tight.predicted.autodist.candidates}
    assert not rows["hybrid pp 2 x tp 2 1f1b"].fits
    fitting = {start: cost for start, cost in every.items() if cost[1] <= budget}
    best = min(fitting, key=lambda start: fitting[start])
    moved = rows[f"hybrid pp 2 x tp 2 1f1b, stages at {best}"]
    assert moved.fits and moved.peak_bytes == every[best][1]
    assert moved.step_seconds == pytest.approx(every[best][0], rel=1e-5)
    # chosen (nothing else fits), it is planned for real: the hybrid policy's stages with that cut
    assert tight.predicted.autodist.chosen == f"hybrid pp 2 x tp 2 1f1b, stages at {best}"
    assert tight.pipeline.starts == (best,) and "within mem_constraint" in tight.pipeline.how
    assert all(t.tp is not None for t in tight.tensors.values())
    assert tight.predicted.cost.bytes_per_rank.peak == every[best][1]


def test_under_a_budget_an_interleaved_pipelines_cut_moves_by_a_row_per_rank():
    """The 8-layer GPT in 4 stages, 2 a rank (1F1B interleaved): a rank holds two stages' tensors, so every cut
    is tried against a row per pipeline rank. One byte under the balanced candidate's peak, autodist offers
    a cut whose ranks fit, priced as the pp policy's plan with pipe_split() at that cut is."""
    found = run_ranks(interleaved_stage_cut_under_a_budget, 1, timeout=300)[0]
    rows = {c.plan: c for c in Plan.from_json(found["tight"]).predicted.autodist.candidates}
    assert found["free"]["pp 1f1b_interleaved"].fits and not rows["pp 1f1b_interleaved"].fits
    moved = rows[found["moved"]]
    assert moved.fits and moved.peak_bytes == found["cut"][1] <= found["budget"]
    assert moved.step_seconds == pytest.approx(found["cut"][0], rel=1e-5)


def test_a_plan_without_a_pipeline_still_trains_through_train_step_when_pipelines_are_explored():
    """The same search with 2 units of one rank (no pipeline possible): train_step's first call runs the plain
    program, and the others accumulate as without autodist."""
    results = run_ranks(train_step_without_pipeline, 2, timeout=600)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")


@pytest.mark.slow       # (Inductor compiles 8 programs on 2 ranks: about 2 minutes)
def test_the_plan_predicts_the_tp_collectives_its_program_issues():
    """tp, tp + sequence parallel, data and tp with the attention on batch shards (its weights' gradients
    all-reduced over the unit) on the test GPT and transformers' Llama: count and bytes per
    micro-batch, as explain traces them under Inductor: Megatron's pairs and sequence parallelism's mirrored
    in the backward, a loss's reductions (vocabulary-parallel, or its exact mean over batch shards) not, and
    one all-reduce for each gradient that a split reader leaves partial (a position embedding read on
    sequence shards or broadcast over batch shards included; a tied table once per reader). (aot_eager's
    program keeps one more all-reduce of the loss's in the backward, which Inductor drops.)"""
    predicted = run_ranks(predicted_tp_collectives, 1, timeout=600)[0]
    traced = run_ranks(traced_tp_collectives, 2, "inductor", timeout=900)[0]
    assert predicted == traced


def _assert_the_fastest_fitting_plan_is_chosen(plan: Plan) -> None:
    """The chosen plan's step is the least of every fitting row's, and why_not rules each other fitting row out
    by a number: slower (or as fast and no smaller), or, for a row priced from other plans, an estimate."""
    record, step = plan.predicted.autodist, plan.predicted.cost.step_seconds
    fitting = [c for c in record.candidates if c.fits]
    assert step == min(c.step_seconds for c in fitting), (record.chosen, step)
    explained = dynshard.explain([plan])
    for c in fitting:
        if c.plan != record.chosen:
            reason = explained.why_not(c.plan)
            expected = ("predicted slower", "as fast") + (("an estimate",) if c.estimated else ())
            assert any(e in reason for e in expected), (c.plan, reason)


def test_the_chosen_plan_is_the_fastest_fitting_plan_it_priced_when_zero_beats_the_plain_plan():
    """Issue 49: when ZeRO-2's rows are faster than no ZeRO, a placement's plain plan is not its fastest, so
    skipping the ILPs of a placement whose plain plan a hand plan beat (the search did, on the premise that ZeRO
    and recompute only add time) left the choice to the ILPs of the rest: a plan slower than hand plans the
    table lists as fitting, which why_not could not rule out. Every ILP now runs, and every hand plan is a
    candidate itself."""
    plan = Plan.from_json(run_ranks(llama_with_zero_faster_than_without, 1, timeout=300)[0])
    _assert_the_fastest_fitting_plan_is_chosen(plan)


def test_why_not_says_what_rules_a_hand_plan_out():
    plan = Plan.from_json(run_ranks(offline_autodist, 1, 4, {"mem_constraint": 0.0006}, timeout=300)[0])
    rows = plan.predicted.autodist.candidates
    too_big = next(c.plan for c in rows if not c.fits)
    slower = next(c.plan for c in rows if c.fits and c.step_seconds > plan.predicted.cost.step_seconds)
    explained = dynshard.explain([plan])
    assert "is over mem_constraint=0.0006 GB" in explained.why_not(too_big)
    assert "predicted slower" in explained.why_not(slower)
    with pytest.raises(ValueError, match="priced no plan"):
        explained.why_not("pp 1f1b")


def test_exploring_pipelines_over_a_unit_of_four_prices_the_hybrid_pp_x_tp_factorisation():
    found = run_ranks(hybrid_candidates, 1, timeout=300)[0]
    rows = {c.plan: c for c in found["candidates"]}
    for schedule in ("1f1b", "gpipe", "zb1p", "1f1b_interleaved"):     # (interleaved: two stages a pipeline rank)
        assert {f"pp {schedule}", f"hybrid pp 2 x tp 2 {schedule}", f"hybrid pp 2 x tp 2 {schedule} + ZeRO-3"} <= set(rows)
    hybrid, pp = rows["hybrid pp 2 x tp 2 1f1b"], rows["pp 1f1b"]
    # its stages' tp collectives are priced (pp has none), and recompute shrinks its peak
    assert hybrid.compute_seconds > 0 and hybrid.step_seconds != pp.step_seconds
    assert rows["hybrid pp 2 x tp 2 1f1b + recompute Block"].peak_bytes < hybrid.peak_bytes
    # the hybrid policy's own plan, planned offline with the same profile, carries the same price
    assert found["hybrid"].cost.step_seconds == hybrid.step_seconds
    assert found["hybrid"].cost.bytes_per_rank.peak == hybrid.peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("plan_ngpus", [2, 4])
def test_every_pipeline_candidate_is_the_plan_its_policy_makes_and_zero_shrinks_its_peak(plan_ngpus):
    """2 stages x 2 units (and units of 4: 4 stages, or 2 stages of tp 2, the hybrid policy's): each schedule at
    ZeRO 0-3, with and without recompute, byte for byte the plan its policy makes; ZeRO rows shrink the state
    at rest and add the step's whole replicas."""
    rows = run_ranks(pipeline_candidates_beside_hand_plans, 1, 2 * plan_ngpus, plan_ngpus, timeout=900)[0]
    if plan_ngpus == 4:
        assert {"hybrid pp 2 x tp 2 1f1b", "hybrid pp 2 x tp 2 zb1p + ZeRO-2 + recompute Block",
                "pp chimera_direct", "pp chimera_direct + recompute Block"} <= {n for n, *_ in rows}
        assert not any("chimera" in n and "ZeRO" in n for n, *_ in rows)      # (ZeRO 0 only: two copies a stage)
        # a hybrid's stages are priced from the tp plan: every tensor placed, and every collective in its stage,
        # as the hybrid policy places them
        assert all(estimate for name, *_, estimate in rows if name.startswith("hybrid")), rows
    assert {name for name, *_ in rows} >= {"pp 1f1b", "pp gpipe + ZeRO-3", "pp zb1p + ZeRO-1 + recompute Block"}
    for name, candidate, hand, _, _ in rows:
        assert json.loads(candidate)["pipeline"] is not None and candidate == hand, name
    memory = {name: bytes_ for name, _, _, bytes_, _ in rows}
    assert memory["pp 1f1b + ZeRO-1"].optimizer < memory["pp 1f1b"].optimizer
    assert memory["pp 1f1b + ZeRO-1"].gathered > 0 == memory["pp 1f1b"].gathered


def test_a_hand_plan_planned_offline_with_a_device_profile_carries_the_prediction_autodist_gave_it():
    found = run_ranks(hand_predictions_beside_autodists, 1, timeout=300)[0]
    priced = {c.plan: c for c in found["candidates"]}
    for name, predicted in found["hand"].items():
        assert predicted.cost.step_seconds == priced[name].step_seconds, name
        assert predicted.cost.bytes_per_rank.peak == priced[name].peak_bytes, name
        assert predicted.device_profile.name == "cpu-gloo (built-in)"


def test_a_hybrid_stages_costs_are_carried_from_one_rank_and_the_tp_unit_by_amdahls_law():
    from dynshard.autodist.cost_model import UnitCosts
    from dynshard.autodist.pipeline_costs import unit_at

    whole = UnitCosts(forward_flop_seconds=800.0, forward_bytes=100.0, saved_bytes=1000.0, largest_output=64.0,
                      replicated_grad_bytes=0.0)
    split = UnitCosts(forward_flop_seconds=100.0, forward_bytes=100.0, saved_bytes=400.0, largest_output=16.0,
                      replicated_grad_bytes=12.0, replicated_grads=3)      # over 8 ranks
    assert unit_at(whole, split, 8, 1) is whole and unit_at(whole, split, 8, 8) is split
    four = unit_at(whole, split, 8, 4)
    assert four.forward_flop_seconds == pytest.approx(200.0)       # all of it split: 800 / 4
    assert four.forward_bytes == pytest.approx(100.0)       # none of it split
    kept = (400 / 1000 - 1 / 8) / (1 - 1 / 8)               # the activations' unsplit part
    assert four.saved_bytes == pytest.approx(1000 * (kept + (1 - kept) / 4))
    assert (four.replicated_grads, four.replicated_grad_bytes) == (3, 12.0)


def test_a_partition_degree_below_the_unit_leaves_only_pipelines_whose_stages_split_within_it():
    found = run_ranks(within_partition_degree, 1, timeout=300)[0]
    assert found["candidates"] and all(c.startswith(("pp ", "hybrid pp 2 x tp 2 ")) for c in found["candidates"])
    plan = json.loads(found["plan"])
    assert plan["pipeline"] is not None and plan["mesh"]["tp"] <= 2
    with pytest.raises(ConfigError, match="max_partition_degree.*explore_pipeline=True"):
        dynshard.Config(policy="autodist", plan_ngpus=4, pas_config={"max_partition_degree": 2})


def test_at_llama3_8b_shapes_over_64_ranks_the_chosen_plan_is_the_fastest_fitting_plan_it_priced():
    """Issue 49's report: units of 8 over 64 ranks chose a tp variant with recompute at 0.7712 s while the
    table listed tp + sequence parallel + ZeRO-2 at 0.5782 s, fitting. The chosen plan is now the fastest
    fitting row, and why_not names the number that rules each other fitting row out."""
    plan = Plan.from_json(run_ranks(llama3_8b_over_64_ranks, 1, timeout=600)[0])
    _assert_the_fastest_fitting_plan_is_chosen(plan)

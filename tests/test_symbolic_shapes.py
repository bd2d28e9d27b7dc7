"""Graphs with symbolic sizes (``dynamic=True``, ``mark_dynamic``, automatic dynamic shapes): one plan and one
Dynamo graph for every length, each unit holding its own lengths, training like one process (gloo). Units of
one rank (dp, ZeRO) and of several (tp, data, sequence parallel) compile one program, on symbols; recompute
alone, pipeline stages and a program DTensor cannot place on symbols a program per size, from the one plan."""

from __future__ import annotations

import json
import time

import pytest

from distributed import run_ranks
from parity import assert_trains_like_one_process
from workers_symbolic_shapes import (modes_and_ends, pipeline_duck_shaped, pipeline_lengths,
                                     pipeline_then_eval_generate_and_save, saved_then_loaded,
                                     split_logits_over_lengths, tp_lm_eval_at_other_batch_sizes, train_lengths,
                                     train_lengths_in_units, train_one_row_on_one_rank, trainer_padding,
                                     BranchOnRows)

STEPS = 25     # 50 distinct lengths over the two ranks


@pytest.mark.parametrize("options", [
    {"compiler": "aot_eager"},
    {"compiler": "aot_eager", "use_zero": 1},
    {"compiler": "aot_eager", "use_zero": 3},
    {"compiler": "inductor", "use_zero": 2},
], ids=["dp", "zero1", "zero3", "zero2-inductor"])
def test_every_length_on_every_rank_trains_like_one_process_from_one_program(options):
    for rank, result in enumerate(run_ranks(train_lengths, 2, options, STEPS)):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["graphs"] == 1, f"rank {rank}: {result['graphs']} graphs for {STEPS} lengths"
        assert result["programs"] == 1


@pytest.mark.parametrize("options", [
    {"compiler": "aot_eager"},
    pytest.param({"compiler": "aot_eager", "use_zero": 3}, marks=pytest.mark.slow),
], ids=["dp", "zero3"])
def test_automatic_dynamic_shapes_compile_each_ranks_first_length_then_one_symbolic_program(options):
    """Neither dynamic=True nor mark_dynamic: step 0 compiles static at each rank's own length (the ranks agree
    on the family and compare their collectives), step 1 the symbolic program every later length runs."""
    for rank, result in enumerate(run_ranks(train_lengths, 2, options, STEPS, "automatic")):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["graphs"] == 2, f"rank {rank}: {result['graphs']} graphs for {STEPS} lengths"
        assert result["programs"] == 2
        (static, symbolic) = result["plans"]
        assert static["tensors"]["x"]["shape"] == [2, 3 + rank, 8], static["tensors"]["x"]
        assert symbolic["tensors"]["x"]["shape"] == [2, "d0", 8], symbolic["tensors"]["x"]


def test_first_programs_that_would_communicate_otherwise_are_refused_on_every_rank_before_their_collectives():
    """Automatic dynamic shapes, one row on rank 1 at step 0 and a Python branch on the rows (no gradient for a
    layer): each rank planned its first program at its own sizes, and at the backward's compile the ranks
    compare its collectives: PlanMismatchError on every rank, naming the rank that differs."""
    results = run_ranks(train_one_row_on_one_rank, 2, {"compiler": "aot_eager"}, 2, 0, "automatic", BranchOnRows)
    for rank, result in enumerate(results):
        error = result["error"] or ""
        assert error.startswith("PlanMismatchError: dynshard: the ranks planned their own programs"), error
        assert "rank 1 would not communicate as rank 0 does: the backward's collectives differ" in error, error
        assert result["losses"] == []


@pytest.mark.parametrize("world, plan_ngpus, pp, options, stays_on", [
    (2, 1, 1, {}, True),                            # units of one rank: each compiles alone
    (2, 2, 1, {}, True),                            # one tp unit: its ranks read one batch
    (4, 2, 1, {}, True),                            # dp x tp: each unit compiles alone, its ranks together
    (2, 2, 2, {}, False),                           # pp: a stage graph is traced again per micro-batch
    (2, 2, 1, {"gather_outputs": False}, False),    # a graph receiving a split value compiles static only
], ids=["dp", "tp", "dp-x-tp", "pp", "tp-split-outputs"])
def test_automatic_dynamic_shapes_stay_on_where_the_ranks_that_compile_again_are_the_ranks_that_agree(
        world, plan_ngpus, pp, options, stays_on):
    """Elsewhere they are turned off at the first compile (dynamic=True or mark_dynamic give one symbolic
    graph)."""
    import torch

    import dynshard
    from dynshard import compat
    from dynshard.backend.shapes import limit_automatic_dynamic
    from dynshard.runtime.mesh import Layout

    layout = Layout(world_size=world, rank=0, plan_ngpus=plan_ngpus, device_type="cpu", mesh=None, pp_size=pp)
    with torch._dynamo.config.patch(automatic_dynamic_shapes=True, automatic_dynamic_local_pgo=False):
        limit_automatic_dynamic(layout, dynshard.Config(**options))
        assert compat.automatic_dynamic_shapes() == stays_on


def test_mark_dynamic_on_the_length_compiles_one_program():
    for rank, result in enumerate(run_ranks(train_lengths, 2, {"compiler": "aot_eager"}, 6, "mark_dynamic")):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["graphs"] == 1


def test_accumulation_over_lengths_trains_like_one_process():
    for rank, result in enumerate(run_ranks(train_lengths, 2, {"compiler": "aot_eager", "use_zero": 1}, 6, "dynamic",
                                            2)):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["graphs"] == 1


@pytest.mark.parametrize("options, plan_ngpus", [({"use_zero": 1}, 1), ({"policy": "tp"}, 2)], ids=["zero1", "tp"])
def test_the_plan_names_symbolic_dimensions_and_a_loaded_plan_serves_other_lengths(tmp_path, options, plan_ngpus):
    """Under tp the loaded plan's one program is compiled on symbols, as the saving job's was."""
    path, options = str(tmp_path / "plans.json"), {"compiler": "aot_eager", **options}
    saving = run_ranks(saved_then_loaded, 2, path, options, False, plan_ngpus)
    for rank, result in enumerate(run_ranks(saved_then_loaded, 2, path, options, True, plan_ngpus)):
        assert_trains_like_one_process(result, f"rank {rank} (loaded plan)")
        assert result["graphs"] == 1 and result["symbolic"] == [True] and result["sizes"] == [()], result
    (plan,) = saving[0]["plans"]
    shapes = {name: t["shape"] for name, t in plan["tensors"].items() if t["kind"] == "input"}
    assert shapes == {"x": [2, "d0", 8], "target": [2, 8]}, shapes
    assert [t["shape"] for t in plan["tensors"].values() if t["kind"] == "size"] == [["d0"]]
    assert json.loads(result["saved"])["tensors"]["x"]["shape"] == [2, "d0", 8]


@pytest.mark.parametrize("options", [{}, {"policy": "tp", "plan_ngpus": 2}], ids=["dp", "tp"])
def test_eval_modes_compile_once_each_and_the_ragged_last_batch_compiles_nothing(options):
    """A mode (no_grad, inference_mode) is a program of its own, for every size; a batch of one row is
    another graph (Dynamo keeps sizes 0 and 1 static). Under tp too, each compiled once, on symbols; there the
    ragged last batch (3 rows, odd) is a graph of its own: DTensor's view rule for a reshape asks whether its
    batch could be split over the unit (``guard_or_false(B % 2 == 0)``), a guard on Dynamo's backed symbol."""
    ragged = 4 if options else 3
    for seen in run_ranks(modes_and_ends, 2, options):
        assert seen[:-1] == [("train", 1), ("no_grad", 2), ("inference_mode", 3), ("ragged last batch", ragged),
                             ("one row", ragged + 1)], seen
        assert seen[-1] and all(program == (True, ()) for program in seen[-1]), seen[-1]


@pytest.mark.parametrize("options", [
    {"compiler": "aot_eager"},
    {"compiler": "aot_eager", "use_zero": 3},
    pytest.param({"compiler": "inductor", "use_zero": 2}, marks=pytest.mark.slow),
], ids=["dp", "zero3", "zero2-inductor"])
def test_a_batch_of_one_row_on_one_rank_compiles_alone_and_trains_like_one_process(options):
    """Dynamo keeps a size of 1 out of the symbolic family, so only that rank compiles: its program of the
    agreed family is planned and compiled with no message (the others are inside their step)."""
    results = run_ranks(train_one_row_on_one_rank, 2, options, 4, 2)
    for rank, result in enumerate(results):
        assert result["error"] is None, f"rank {rank}: {result['error']}"
        assert_trains_like_one_process(result, f"rank {rank}")
    assert [r["graphs"] for r in results] == [1, 2]
    assert [r["programs"] for r in results] == [1, 2]


def test_a_program_compiled_alone_that_would_communicate_otherwise_is_refused_before_its_collectives():
    """A batch of one row that takes another code path (no gradient for a layer, so one all-reduce fewer):
    the rank that compiled it alone raises at its backward's compile (AOTAutograd compiles it with the
    forward when the backward saves sizes: Dynamo then wraps the error), within seconds, not at a timeout."""
    start = time.perf_counter()
    results = run_ranks(train_one_row_on_one_rank, 2, {"compiler": "aot_eager"}, 4, 2, "dynamic", BranchOnRows)
    error = results[1]["error"]
    assert "AloneCompileError: dynshard: rank 1 compiled a new program of a graph alone" in error, error
    assert "its backward issues 6 collectives, the family's first program 8" in error, error
    assert "Connection closed by peer" in results[0]["error"], results[0]["error"]    # rank 1 exited
    assert time.perf_counter() - start < 120


@pytest.mark.parametrize("world", [2, pytest.param(1, marks=pytest.mark.slow)], ids=["dp", "one-process"])
def test_recompute_over_lengths_trains_like_one_process_from_one_graph_and_a_program_per_length(world):
    """recompute_modules tags an ATen graph of static sizes: a program per length, from the one plan."""
    for rank, result in enumerate(run_ranks(train_lengths, world, {"compiler": "aot_eager",
                                                                   "recompute_modules": "ROOT"}, 4)):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["graphs"] == 1 and len(result["plans"]) == 1, result
        (sizes,) = result["sizes"]
        assert len(set(sizes)) == 4, sizes
        assert result["saved"] == [0], result["saved"]      # ROOT: every activation recomputed


@pytest.mark.parametrize("options, dynamic", [
    ({"compiler": "aot_eager"}, True),
    ({"compiler": "aot_eager"}, None),
    ({"compiler": "aot_eager", "use_zero": 3}, True),
], ids=["dp", "dp-automatic", "zero3"])
def test_trainer_with_a_padding_collator_trains_like_one_process(options, dynamic):
    """dynamic=True, or torch.compile's default (automatic dynamic shapes: the first lengths static, each
    rank's own)."""
    results = run_ranks(trainer_padding, 2, options, 6, 1, dynamic)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["graphs"] <= 3, result["graphs"]
    lengths = [shape[1] for result in results for shape in result["lengths"]]
    assert len(set(lengths)) >= 6, lengths      # the ranks' own lengths, step after step


TP = {"policy": "tp", "compiler": "aot_eager"}


@pytest.mark.parametrize("world, options, accumulation", [
    (2, {}, 1),
    pytest.param(4, {}, 1, marks=pytest.mark.slow),
    pytest.param(2, {"compiler": "inductor"}, 1, marks=pytest.mark.slow),
    pytest.param(4, {"use_zero": 3}, 2, marks=pytest.mark.slow),
    pytest.param(2, {"policy": "data"}, 1, marks=pytest.mark.slow),
    (2, {"policy": "autodist"}, 1),        # searched once, at the first call's sizes; it chooses tp here
], ids=["one-unit", "two-units", "inductor", "two-units-zero3-accumulation", "data", "autodist"])
def test_tp_trains_every_length_like_one_process_from_one_graph_and_one_plan(world, options, accumulation):
    """tp 2: one plan, made at the first call's sizes, and one program compiled on Dynamo's symbols for every
    length (50 lengths: 50 steps of one unit, or 25 of two units holding different ones)."""
    for rank, result in enumerate(run_ranks(train_lengths_in_units, world, {**TP, **options}, 100 // world, 2,
                                            None, accumulation)):
        assert result["error"] is None, result["error"]
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["graphs"] == 1 and len(result["plans"]) == 1, result
        assert result["symbolic"] == [True] and result["sizes"] == [()], result
        # tp split the parameters; data splits the batch's rows, and each rank holds the parameters whole
        assert (result["local"]["up.weight"][0] < 32) == (options.get("policy") != "data"), result["local"]


def test_automatic_dynamic_shapes_under_two_units_of_tp_compile_each_units_symbolic_program_at_its_own_step():
    """torch.compile's default over 2 units of 2 tp ranks: unit 1's length does not change at step 1, so
    unit 0 compiles its symbolic program at step 1, alone (its family agreed at step 0), and unit 1 at step 2;
    their gradients' collectives are checked against the family's first program. 2 graphs per rank for 4
    lengths per unit, exact."""
    per_step = [[5, 6], [9, 6], [12, 13], [7, 4]]
    for rank, result in enumerate(run_ranks(train_lengths_in_units, 4, TP, 4, 2, per_step, 1, "TokenMLP",
                                            "automatic")):
        assert result["error"] is None, result["error"]
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["graphs"] == 2 and result["symbolic"] == [False, True], result


def test_a_program_dtensor_cannot_place_on_symbols_compiles_per_size_on_every_rank_and_trains_like_one_process():
    """An op whose sharding rule refuses symbolic sizes (a custom op, OpaqueToSymbols): the program on symbols
    fails on every rank, which all learn it, and each compiles a program per length from the one graph and
    plan (4 lengths, 4 programs' sizes), training like one process."""
    for rank, result in enumerate(run_ranks(train_lengths_in_units, 2, TP, 4, 2, None, 1, "OpaqueToSymbols")):
        assert result["error"] is None, result["error"]
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["graphs"] == 1 and len(result["plans"]) == 1, result
        assert result["symbolic"] == [False] and len(result["sizes"][0]) == 4, result


def test_a_split_value_with_symbolic_sizes_is_refused_on_every_rank_and_automatic_shapes_keep_it_static():
    """A graph that receives another program's split output (a DTensor) compiles static shapes only: with
    dynamic=True every rank raises SymbolicShapesError at its first compile; with torch.compile's default the
    job keeps automatic dynamic shapes off, and each length compiles its own graphs."""
    for result in run_ranks(split_logits_over_lengths, 2, True):
        error = result["error"] or ""
        assert "SymbolicShapesError: dynshard: input" in error and "receives" in error, error
        assert "split (a DTensor)" in error and "compile without dynamic=True" in error, error
        assert result["steps"] == 0
    for result in run_ranks(split_logits_over_lengths, 2, None):
        assert result["error"] is None and result["steps"] == 3, result["error"]
        assert result["graphs"] == 6, result["graphs"]      # two graphs (the break) per length


def test_sequence_parallel_over_lengths_it_does_not_divide_trains_like_one_process_from_a_second_program():
    """The program on symbols splits the sequence over the unit's 2 ranks: DTensor guards its evenness, so an odd
    length compiles a second graph, whose plan (made at an odd length) leaves the sequence whole. Exact on both."""
    results = run_ranks(train_lengths_in_units, 2, {**TP, "pas_config": {"sequence_parallel": True}}, 0, 2,
                        [[4], [6], [5], [7]])
    for rank, result in enumerate(results):
        assert result["error"] is None, result["error"]
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["graphs"] == 2 and result["symbolic"] == [True, True], result
        even, odd = result["plans"]
        assert even["activations"] and not odd["activations"], (even["activations"], odd["activations"])


@pytest.mark.parametrize("options, dynamic", [
    ({"policy": "tp"}, True),
    ({"policy": "tp"}, None),
    ({"policy": "pp", "use_end2end": True, "pas_config": {"pipeline_nmicros": 2}}, True),
], ids=["tp", "tp-automatic", "pp"])
def test_trainer_with_a_padding_collator_in_one_unit_of_two_ranks_trains_like_one_process(options, dynamic):
    """tp-automatic: torch.compile's default, the first length static and the second one program on symbols (the
    unit's ranks read one batch, so they compile at the same step). tp under dynamic=True: the batch is
    symbolic too, flattened with Llama's split heads (the math attention's batched matmul) into a
    ``_StridedShard`` whose split factor is the batch: one program on symbols as well. pp: the padding mask transformers reads by the batch's positions splits into micro-batches, and
    Trainer's clipping (accelerate's get_total_norm) sees the global norm."""
    (result, _) = run_ranks(trainer_padding, 2, {"compiler": "aot_eager", **options}, 6, 2, dynamic)
    assert_trains_like_one_process(result)
    assert result["graphs"] == (1 if dynamic else 2) and len(set(result["lengths"])) == 6, result["lengths"]
    if options["policy"] == "tp":
        assert result["symbolic"] == ([True] if dynamic else [False, True]), result["symbolic"]


@pytest.mark.parametrize("dynamic, name", [(None, "llama"), (True, "llama"), (None, "gpt2")],
                         ids=["automatic", "dynamic", "gpt2-automatic"])
def test_a_tp_lm_trained_over_lengths_and_evaluated_at_other_batch_sizes_runs_on_symbols_like_one_process(
        dynamic, name):
    """Eval under no_grad at 3 and 5 rows after training at 2: the symbolic batch meets the split heads
    flattened into it (a ``_StridedShard`` whose split factor is the batch), placed on symbols
    (compat.strided_shards): one eval program for both batch sizes, exact. GPT-2's repeated blocks are
    outlined: a block's output that is a view of its input is re-applied outside it, sizes read from the
    caller's inputs (outline_repeated_blocks.unalias_subgraph_outputs)."""
    for result in run_ranks(tp_lm_eval_at_other_batch_sizes, 2, dynamic, name):
        assert max(result["differences"]) < 1e-5, result["differences"]
        assert result["symbolic"] == ([False, True, True] if dynamic is None else [True, True]), result


@pytest.mark.slow
def test_trainer_with_a_padding_collator_over_two_units_of_tp_trains_like_one_process_from_two_graphs():
    """docs/transformers.md's unit recipe at torch.compile's default over 2 units of 2 tp ranks, each unit
    padding its own rows: each unit compiles its first length static and its second on symbols, alone."""
    results = run_ranks(trainer_padding, 4, {"compiler": "aot_eager", "policy": "tp"}, 6, 2, None)
    for result in results:
        assert_trains_like_one_process(result)
        assert result["graphs"] == 2 and result["symbolic"] == [False, True], result["symbolic"]


PP = {"policy": "pp", "plan_ngpus": 2, "compiler": "aot_eager", "use_end2end": True,
      "pas_config": {"pipeline_nmicros": 2}}


@pytest.mark.parametrize("world, options, entry, per_step", [
    (2, PP, "plain", [[5], [9], [12], [7]]),
    pytest.param(2, {**PP, "pas_config": {"pipeline_nmicros": 2, "pipeline_scheduler": "1f1b"}}, "train_step",
                 [[5], [9], [12], [7]], marks=pytest.mark.slow),
    pytest.param(4, {**PP, "use_zero": 1}, "plain", [[5, 6], [9, 4], [12, 13], [7, 3]], marks=pytest.mark.slow),
    pytest.param(4, {**PP, "policy": "hybrid", "plan_ngpus": 4,
                     "pas_config": {"pipeline_nmicros": 2, "pipeline_nstages": 2}}, "plain",
                 [[5], [9], [12], [7]], marks=pytest.mark.slow),
], ids=["pp", "pp-1f1b-train-step", "pp-two-units-zero1", "hybrid"])
def test_a_pipeline_trains_every_length_like_one_process_from_one_graph_and_one_plan(world, options, entry,
                                                                                     per_step):
    """A symbolic batch split into micro-batches (a Llama, sizes of its batch read inside the graph): the
    stages compiled once per micro-batch shape, from the one plan; Dynamo traces once (no re-trace at the
    micro-batch shape). Two units hold different lengths."""
    results = run_ranks(pipeline_lengths, world, options, per_step, entry)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")
        assert result["graphs"] == 1 and len(result["plans"]) == 1, result
        (shapes,) = result["shapes"]
        unit = rank // options["plan_ngpus"]
        assert [s[1] for s in shapes] == [(2, lengths[unit]) for lengths in per_step], shapes   # 4 rows, 2 micro


def test_a_pipeline_refuses_a_batch_symbol_dynamo_shares_with_the_length_on_every_rank():
    for message in run_ranks(pipeline_duck_shaped, 2, PP):
        assert "SymbolicShapesError: dynshard:" in message, message
        assert "input idx (d0, 4 rows) with the same symbol as dim 1 of idx (d0)" in message, message


def test_after_symbolic_pipeline_training_eval_generate_and_save_pretrained_match_one_process(tmp_path):
    """eval at an unseen batch and length; generate inside summon_full_params (every rank takes part in each
    stage's broadcast, holder or not); save_pretrained read back in one process."""
    results = run_ranks(pipeline_then_eval_generate_and_save, 2, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["eval"] < 1e-5 and result["generate_equal"], (rank, result)
    assert results[0]["loaded"] < 1e-5, results[0]

"""Recompiling while gradients exist (2 ranks, tp, plan_ngpus=2) trains like one process.

After a backward, parameters hold local shards and local ``.grad`` tensors. A dynshard frame compiled
then (a shorter micro-batch during accumulation, eval or inference_mode before zero_grad, a new batch
size after ``zero_grad(set_to_none=False)``) must trace global shapes, gradients included; a frame
compiled by another backend (``torch.compile(opt.step)``) must trace the local shards and compile once.
Parity with SGD with momentum: every parameter update depends on every gradient so far.
"""

from __future__ import annotations

import pytest

from distributed import run_ranks
from parity import assert_trains_like_one_process as one_process
from workers_recompile import recompile_scenarios


@pytest.fixture(scope="module")
def outcome():
    # the optimizer scenario first: training_loop then starts after a torch._dynamo.reset() (which
    # drops Dynamo's compile callbacks) and a dynshard compile, and still needs global shapes
    return run_ranks(recompile_scenarios, 2, ["compiled_opt_step_aot_eager", "training_loop", "training_loop_zero3",
                                                  "training_loop_autodist"])


def assert_trains_like_one_process(results: list[dict], scenario: str) -> None:
    for rank, ranks_results in enumerate(results):
        result = ranks_results[scenario]
        assert "error" not in result, f"rank {rank} {scenario} failed:\n{result.get('error')}"
        one_process(result, f"rank {rank} {scenario}")


def new_graphs_per_step(result: dict) -> list[int]:
    graphs = result["graphs"]
    return [later - earlier for earlier, later in zip(graphs, graphs[1:])]


def test_recompiles_with_gradients_set_train_like_one_process(outcome):
    # accumulation with a shorter micro-batch, eval before zero_grad, zero_grad(set_to_none=False)
    # then a new batch size: all on GPT-2-style layers (view(B, T, H, C // H) needs global shapes)
    assert_trains_like_one_process(outcome, "training_loop")


def test_recompiles_with_zero3_rows_and_their_gradients_train_like_one_process(outcome):
    assert_trains_like_one_process(outcome, "training_loop_zero3")
    for rank in outcome:
        assert max(rank["training_loop_zero3"]["eval_errors"]) < 1e-5


def test_autodists_recompiles_and_evals_train_like_one_process_on_the_weights_its_first_plan_split(outcome):
    """Each new graph (a shorter micro-batch, eval, inference_mode) is searched again, over the parameters
    the first program placed (fixed): the weights stay split as first chosen, and it all matches one process.
    Under automatic dynamic shapes: the shorter micro-batch (2) compiles one program on symbols, which splits a
    view of the batch over the unit (DTensor guards its evenness), so step 1's odd size (3) compiles once more."""
    assert_trains_like_one_process(outcome, "training_loop_autodist")
    for rank in outcome:
        result = rank["training_loop_autodist"]
        assert max(result["eval_errors"]) < 1e-5, result["eval_errors"]
        assert "tp=S(1)" in result["explain"] and result["explain"].count("autodist chose") == 3, result["explain"]
        assert new_graphs_per_step(result) == [1, 0], result["graphs"]


def test_eval_and_inference_mode_before_zero_grad_match_one_process(outcome):
    for rank in outcome:
        errors = rank["training_loop"]["eval_errors"]
        assert len(errors) == 6 and max(errors) < 1e-5, errors


def test_each_shape_and_mode_compiles_once(outcome):
    for rank in outcome:
        # step 1 compiles its new micro-batch size (3); step 2 compiles nothing
        assert new_graphs_per_step(rank["training_loop"]) == [1, 0]


def test_compiled_optimizer_step_sees_local_shards(outcome):
    assert_trains_like_one_process(outcome, "compiled_opt_step_aot_eager")
    for rank in outcome:
        # step 1 recompiles once (momentum buffers exist from then on); after that no guard fails,
        # as it would on every call had the step been traced with global shapes
        assert new_graphs_per_step(rank["compiled_opt_step_aot_eager"])[1:] == [0, 0]


@pytest.mark.slow
def test_compiled_optimizer_step_with_inductor():
    results = run_ranks(recompile_scenarios, 2, ["compiled_opt_step_inductor"])
    assert_trains_like_one_process(results, "compiled_opt_step_inductor")
    for rank in results:
        assert new_graphs_per_step(rank["compiled_opt_step_inductor"])[1:] == [0, 0]

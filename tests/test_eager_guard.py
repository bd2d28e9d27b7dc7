"""A module holding this rank's shards refuses calls that bypass its compiled program (they would compute
on shards), a whole parameter whose gradient is reduced refuses them in training, and a dynshard frame that
reaches Dynamo's recompile limit raises instead of running eagerly; summon_full_params makes the tensors
whole for evaluation and transformers' generate."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from parity import assert_trains_like_one_process
from workers_eager_guard import (RECOMPILE_LIMIT, eager_calls_after_tp, eager_calls_under_dp, generate_after_tp,
                                 generate_on_tp_llama, recompile_limit_under)
from workers_transformers import VOCAB


def test_an_eager_call_on_shards_fails_on_every_rank_and_summoned_params_compute_like_one_process():
    for result in run_ranks(eager_calls_after_tp, 2):
        assert "summon_full_params" in result["eager_error"], result["eager_error"]
        eager, compiled, reference = result["summoned"]
        assert abs(eager - reference) <= 1e-5 * abs(reference) and abs(compiled - reference) <= 1e-5 * abs(reference)
        assert_trains_like_one_process(result)       # training went on, shards back in place


def test_generate_after_tensor_parallel_training_is_refused_on_shards_and_exact_when_summoned():
    for result in run_ranks(generate_after_tp, 2):
        assert result["local_vocab"] == VOCAB // 2          # the embedding is split along the vocabulary
        assert "model.generate" in result["error"], result["error"]
        assert torch.equal(result["generated"], result["expected"])


RECOMPILE_CASES = {
    "dp": {}, "dp + ZeRO-1": {"use_zero": 1}, "dp + ZeRO-3": {"use_zero": 3},
    "tp": {"policy": "tp", "plan_ngpus": 2}, "data": {"policy": "data", "plan_ngpus": 2},
}


@pytest.mark.parametrize("case", list(RECOMPILE_CASES))
def test_reaching_the_recompile_limit_raises_on_every_rank_naming_the_guard_and_the_fix(case):
    # before: Dynamo ran the frame eagerly; under dp nothing reduced its gradients (replicas drifted apart
    # silently), under tp and ZeRO-3 it computed on shards
    results = run_ranks(recompile_limit_under, 2, RECOMPILE_CASES[case])
    for rank, result in enumerate(results):
        assert result["error_type"] == "RecompileLimitError", (rank, result["error"])
        assert result["error_step"] == RECOMPILE_LIMIT, result["error"]
        message = result["error"]
        assert f"recompile_limit ({RECOMPILE_LIMIT})" in message and "'forward'" in message, message
        assert "temperature ==" in message and "torch.tensor(value)" in message, message
        assert_trains_like_one_process(result, f"rank {rank}")     # every step before the limit, exact


@pytest.mark.parametrize("dynamic", [False, None], ids=["static", "automatic-dynamic"])
def test_new_sequence_lengths_go_symbolic_or_at_the_recompile_limit_name_the_shape_and_padding(dynamic):
    # transformers' Llama (its forward is a decorator's wrapper, args=(self, ...)) fed a new length per step:
    # with torch.compile's automatic dynamic shapes the second length compiles the symbolic graph, which
    # serves every later one; with dynamic=False every length is a graph, up to the limit
    for rank, result in enumerate(run_ranks(recompile_limit_under, 2, {"policy": "tp", "plan_ngpus": 2}, "llama",
                                            dynamic)):
        assert_trains_like_one_process(result, f"rank {rank}")
        if dynamic is None:
            assert result["error"] is None and len(result["losses"]) == RECOMPILE_LIMIT + 2, result["error"]
            assert result["graphs"] == 2, result["graphs"]
            continue
        assert result["error_type"] == "RecompileLimitError", (rank, result["error"])
        assert "size mismatch" in result["error"] and "pad_to_multiple_of" in result["error"], result["error"]


def test_an_eager_call_with_gradients_under_dp_is_refused_and_exact_under_no_grad():
    for result in run_ranks(eager_calls_under_dp, 2):
        assert result["error_type"] == "EagerCallError" and "torch.no_grad()" in result["error"], result["error"]
        assert result["eager"] == pytest.approx(result["compiled"], rel=1e-6)
        for before, after in zip(result["grads"], result["grads_after"]):
            torch.testing.assert_close(after, 2 * before)      # the refused call left no gradient behind


def test_generate_on_a_tensor_parallel_llama_is_refused_at_the_embedding():
    # the frame Dynamo compiles is transformers' decorator wrapper (the model in its *args): its modules
    # were found and hooked, the vocabulary-split embedding included (before: a raw IndexError)
    result = run_ranks(generate_on_tp_llama, 2)[0]
    assert result["error_type"] == "EagerCallOnShardsError" and "Embedding" in result["error"], result["error"]
    assert "model.embed_tokens" in result["guarded"] and "lm_head" in result["guarded"], result["guarded"]

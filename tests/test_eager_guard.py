"""A module holding this rank's shards refuses calls that bypass its compiled program (they would compute
on shards); summon_full_params makes the tensors whole for evaluation and transformers' generate."""

from __future__ import annotations

import torch

from distributed import run_ranks
from parity import assert_trains_like_one_process
from workers_eager_guard import eager_calls_after_tp, generate_after_tp
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

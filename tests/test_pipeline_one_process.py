"""One-process pipelines (one real rank): train_step and plain calls train like one process; recompute."""

from __future__ import annotations

import pytest

from distributed import run_ranks
from workers_pipeline_one_process import plain_call_parity, recompute_saved_bytes, train_step_parity


@pytest.mark.parametrize("scheduler, nchunks", [("1f1b", 1), ("1f1b_interleaved", 2), ("zb1p", 1)])
def test_one_process_pipelines_train_like_gradient_accumulation(scheduler, nchunks):
    assert run_ranks(train_step_parity, 1, scheduler, nchunks) == [nchunks]


def test_plain_calls_of_a_graph_holding_its_batch_size_trace_it_again_per_micro_batch():
    """The test GPT views its input as (B, T, heads, -1): B is traced as a number, so the whole batch's
    graph cannot run a micro-batch; Dynamo traces the model again at the micro-batch shape."""
    run_ranks(plain_call_parity, 1, "gpt")


def test_plain_calls_combine_the_micro_batches_into_the_whole_batch():
    run_ranks(plain_call_parity, 1, "mlp")


def test_recompute_modules_inside_pipeline_stages_keeps_fewer_activations():
    saved = run_ranks(recompute_saved_bytes, 1)[0]
    assert all(after < before / 4 for before, after in zip(saved[""], saved["Block"])), saved

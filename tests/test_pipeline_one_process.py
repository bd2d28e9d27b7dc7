"""One-process pipelines (one real rank): train_step and plain calls train like one process; recompute."""

from __future__ import annotations

import pytest

from distributed import run_ranks
from workers_pipeline_one_process import all_device_first, plain_call_parity, recompute_saved_bytes, train_step_parity


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


def test_1f1b_plus_on_one_rank_and_a_tensor_shared_with_the_all_device_segment_is_refused():
    result = run_ranks(all_device_first, 1)[0]
    assert result["losses"] == 4
    assert "wte.weight is read by the all-device segment of 1f1b_plus and by pipeline stage(s) 1" in result["error"]
    assert "Untie it, or use pipeline_scheduler '1f1b'" in result["error"]

"""policy="pp" on real gloo ranks: every schedule trains like one process, ranks hold their stages only,
p2p sends the minimum, and what explain and the trace show."""

from __future__ import annotations

import json
import os

import pytest

from distributed import run_ranks
from parity import (assert_losses_close, assert_ranks_train_like_one_process, assert_tensors_close,
                    assert_tensors_equal, assert_trains_like_one_process)
from workers_pipeline import (deferred_weight_gradients, meta_pipeline, pipeline_checkpoint, pipeline_explain,
                              pipeline_parity)


def _layer_fraction(result) -> float:
    layers = [n for n in result["total"] if n.startswith("blocks.")]
    return sum(result["held"][n] for n in layers) / sum(result["total"][n] for n in layers)


def test_1f1b_on_two_ranks_trains_the_tied_gpt_like_gradient_accumulation():
    results = run_ranks(pipeline_parity, 2, "gpt", 2, {"pipeline_nmicros": 4}, "train_step", 2)
    assert_ranks_train_like_one_process(results)
    assert [_layer_fraction(r) for r in results] == [0.5, 0.5]
    assert results[0]["held"]["wte.weight"] == results[1]["held"]["wte.weight"] > 0    # tied: on both ends
    assert results[0]["modules"][0] == [("wte", "wpe", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "ln_f",
                                                                                  "lm_head")]
    # the minimum: each micro-batch's boundary activation forward and its gradient backward, nothing else
    assert sum(r["sent_bytes"][0] for r in results) == results[0]["p2p_bytes"][0] == 4 * 2 * (2 * 16 * 32 * 4)


def test_interleaved_1f1b_runs_two_stages_per_rank():
    results = run_ranks(pipeline_parity, 2, "gpt", 2, {"pipeline_nmicros": 4, "pipeline_scheduler": "1f1b_interleaved",
                                                       "pipeline_nchunks": 2}, "train_step", 2)
    assert_ranks_train_like_one_process(results)
    assert results[0]["modules"][0][0] == ("wte", "wpe", "blocks.0")
    assert [_layer_fraction(r) for r in results] == [0.5, 0.5]


def test_gpipe_relays_a_skip_connection_over_every_stage():
    results = run_ranks(pipeline_parity, 2, "skip", 2, {"pipeline_nmicros": 4, "pipeline_scheduler": "gpipe"},
                        "train_step", 2)
    assert_ranks_train_like_one_process(results)


def test_pipeline_times_data_parallel_units_with_zero3_holds_a_quarter_of_the_model_per_rank():
    """pp 2 x dp 2 with ZeRO-3: a rank holds ZeRO rows of its stage's parameters (about 1/4 of the model);
    whole replicas are gathered once per step and gradients reduce-scattered once per step."""
    results = run_ranks(pipeline_parity, 4, "mlp_split", 2, {"pipeline_nmicros": 2}, "train_step", 2, 8, "pp",
                        {"use_zero": 3})
    assert_ranks_train_like_one_process(results)
    for result in results:
        assert sum(result["held"].values()) <= 0.27 * sum(result["total"].values())


def test_dummy_micro_batches_scale_fn_infer_step_explain_and_trace(tmp_path):
    results = run_ranks(pipeline_explain, 2, "gpt", 2, {"pipeline_nmicros": 4},
                        env={"TEST_TRACE_DIR": str(tmp_path)})
    for result in results:
        assert_losses_close(result["losses"], result["ref_losses"])
        assert_losses_close(result["outputs"], result["ref_outputs"], "infer_step outputs")
        assert result["grads"]          # a rank holds the gradients of its own stages only
        assert_tensors_close(result["grads"], {n: result["ref_grads"][n] for n in result["grads"]}, "grads")
    report = results[0]["report"]
    assert "pipeline stages 0, 1" in report and "schedule 1f1b" in report
    stage = results[0]["pipeline"].stages[0]
    # (FLOPs: two layers' matmuls, 1,572,864, and their attention, 2 x 65,536)
    assert (stage.ranks, stage.flops, stage.receives, stage.modules) == ((0,), 1703936, 0, ("wte", "wpe", "blocks.0",
                                                                                         "blocks.1"))
    assert stage.saved_bytes > 0 and results[1]["pipeline"].stages[0].saved_bytes == 0   # rank 1 runs stage 1
    for rank in range(2):
        with open(os.path.join(tmp_path, f"dynshard_trace_rank{rank}.json")) as f:
            events = json.load(f)["traceEvents"]
        kinds = {e["cat"] for e in events}
        assert {"forward", "backward", "step"} <= kinds
        assert sum(1 for e in events if e["cat"] == "forward") == 4 + 4      # train_step, then infer_step


@pytest.mark.slow
def test_interleaved_with_two_chunks_on_four_ranks():
    results = run_ranks(pipeline_parity, 4, "gpt", 4, {"pipeline_nmicros": 4, "pipeline_scheduler": "1f1b_interleaved",
                                                       "pipeline_nchunks": 2}, "train_step", 2)
    assert_ranks_train_like_one_process(results)


@pytest.mark.slow       # (8 ranks on 2 cores: about 40 s)
def test_chimera_direct_over_two_data_parallel_units_trains_like_one_process():
    """Two units of 4 (autodist prices chimera_direct over units too, at ZeRO 0): each stage's two copies sum
    their gradients within the unit, then the units average theirs."""
    pas_config = {"pipeline_nmicros": 4, "pipeline_scheduler": "chimera_direct"}
    results = run_ranks(pipeline_parity, 8, "gpt", 4, pas_config, "train_step", 2, timeout=900)
    assert_ranks_train_like_one_process(results)


def test_chimera_direct_runs_each_stage_on_two_ranks_in_two_directions():
    """4 stages on 4 ranks: micro-batches 0, 2 go down (stage s on rank s), 1, 3 up (on rank 3 - s); each
    stage's two copies sum their gradients once per step. Plain calls (odd steps) run GPipe on the down lane."""
    results = run_ranks(pipeline_parity, 4, "gpt", 4, {"pipeline_nmicros": 4, "pipeline_scheduler": "chimera_direct"},
                        "alternate", 2)
    assert_ranks_train_like_one_process(results)
    assert [_layer_fraction(r) for r in results] == [0.5] * 4          # stages r and 3 - r
    # each micro-batch crosses the 3 boundaries of its lane once forward and once backward
    assert sum(r["sent_bytes"][0] for r in results) == results[0]["p2p_bytes"][0] == 4 * 3 * 2 * (2 * 16 * 32 * 4)


def test_1f1b_plus_runs_the_embedding_on_every_rank_and_pipelines_the_layers():
    """nnScaler's 1f1b_plus: the ops before the first layer (both embeddings) are a segment split over both
    ranks (vocab parallel), run for each micro-batch just before stage 1; the layers are two 1F1B stages."""
    results = run_ranks(pipeline_parity, 2, "untied_gpt", 2, {"pipeline_nmicros": 4, "pipeline_scheduler": "1f1b_plus"},
                        "alternate", 2)
    assert_ranks_train_like_one_process(results)
    for result in results:
        assert result["held"]["wte.weight"] == 64 * 32 // 2         # vocab parallel over both ranks
        assert result["modules"][0][0] == ("wte", "wpe")
    assert [_layer_fraction(r) for r in results] == [0.5, 0.5]
    # per micro-batch: stage 1 -> 2 forward and backward, and the embedding's output gradient broadcast once
    ran = [i for i, p2p in enumerate(results[0]["p2p_bytes"]) if p2p]     # the plans that ran micro-batches
    assert ran and all(results[0]["p2p_bytes"][i] == 4 * 3 * (2 * 16 * 32 * 4) for i in ran), results[0]["p2p_bytes"]
    assert sum(r["sent_bytes"][ran[-1]] for r in results) == results[0]["p2p_bytes"][ran[-1]]


def test_1f1b_plus_under_hybrid_splits_the_embedding_over_the_whole_unit():
    """2 stages x tp 2 on 4 ranks; the all-device segment is tensor parallel over all 4."""
    results = run_ranks(pipeline_parity, 4, "untied_gpt", 4, {"pipeline_nmicros": 2, "pipeline_nstages": 2,
                                                              "pipeline_scheduler": "1f1b_plus"}, "train_step", 2, 8,
                        "hybrid")
    assert_ranks_train_like_one_process(results)
    assert [r["held"]["wte.weight"] for r in results] == [64 * 32 // 4] * 4
    assert [r["held"]["blocks.0.fc1.weight"] for r in results] == [128 * 32 // 2] * 2 + [0, 0]


def test_a_meta_built_model_initialises_like_one_process_and_each_rank_keeps_its_stages():
    results = run_ranks(meta_pipeline, 2)
    assert_ranks_train_like_one_process(results)
    for result in results:
        held = result["held_during_init"]
        # at any time: what this rank keeps, plus one module whole, plus the tied embedding until the LM head
        bound = result["held_after"] + result["largest_module_bytes"] + result["tied_bytes"]
        assert len(held) > 10 and max(held) <= bound < result["whole_bytes"], (held, bound, result["whole_bytes"])
        assert result["held_after"] < 0.75 * result["whole_bytes"]


def test_a_pipeline_checkpoint_loads_under_data_parallelism_and_under_the_pipeline(tmp_path):
    results = run_ranks(pipeline_checkpoint, 2, str(tmp_path))
    for result in results:
        for policy in ("dp", "pp"):
            assert result[policy]["extra"] == {"step": 2}
            assert_tensors_equal(result[policy]["params"], result["saved"], f"{policy} params")


def test_plain_forward_and_backward_run_gpipe_over_the_micro_batches_of_the_batch():
    """``loss = model(batch); loss.backward()``: the whole batch's loss and gradients (pp x dp x ZeRO-1, 4 ranks)."""
    results = run_ranks(pipeline_parity, 4, "mlp_split", 2, {"pipeline_nmicros": 4}, "plain", 2, 8, "pp",
                        {"use_zero": 1})
    assert_ranks_train_like_one_process(results)


def test_hybrid_runs_two_tensor_parallel_stages_on_four_ranks_with_recompute():
    results = run_ranks(pipeline_parity, 4, "gpt", 4, {"pipeline_nmicros": 2, "pipeline_nstages": 2}, "train_step",
                        2, 8, "hybrid", {"recompute_modules": "Block"})
    assert_ranks_train_like_one_process(results)
    # bytes stage 0 keeps for its backward per micro-batch on rank 0: 182400 without recompute (measured)
    assert 0 < results[0]["saved"][0][0] <= 0.25 * 182400, results[0]["saved"]
    for rank, result in enumerate(results):
        first_stage = rank < 2
        assert result["held"]["blocks.0.fc1.weight"] == (128 * 32 // 2 if first_stage else 0)
        assert result["held"]["blocks.3.fc1.weight"] == (0 if first_stage else 128 * 32 // 2)
        assert result["held"]["wte.weight"] == 64 * 32 // 2      # vocab parallel, tied, on both stages


def test_a_plain_call_under_hybrid_cuts_the_stages_tensors_before_autograd_records_them():
    """``loss = model(batch)`` under hybrid: the first call's stage programs cut their tp shards before the
    pipeline's autograd node records the parameters (a gradient accumulator keeps the shape it first saw)."""
    results = run_ranks(pipeline_parity, 4, "gpt", 4, {"pipeline_nmicros": 2, "pipeline_nstages": 2}, "plain",
                        2, 8, "hybrid")
    assert_ranks_train_like_one_process(results)


def test_a_tensor_given_twice_reaches_both_arguments_when_the_model_is_traced_at_the_micro_batch_shape():
    from workers_pipeline import llama_labels_are_the_inputs

    for rank, result in enumerate(run_ranks(llama_labels_are_the_inputs, 2)):
        assert_trains_like_one_process(result, f"rank {rank}")


def test_zero_bubble_splits_each_backward_and_trains_like_one_process():
    """zb1p: input gradients first (the previous stage waits for them), weight gradients in the bubbles."""
    results = run_ranks(pipeline_parity, 2, "gpt", 2, {"pipeline_nmicros": 4, "pipeline_scheduler": "zb1p"},
                        "train_step", 2)
    assert_ranks_train_like_one_process(results)


def test_hybrid_with_zero3_stores_rows_of_the_tensor_parallel_shards():
    """One tp-2 stage per unit, 2 units (4 ranks), ZeRO-3: each rank stores half the rows of its tp shard,
    gathered once per step; trains like one process."""
    results = run_ranks(pipeline_parity, 4, "gpt", 2, {"pipeline_nmicros": 2, "pipeline_nstages": 1}, "train_step",
                        2, 8, "hybrid", {"use_zero": 3})
    assert_ranks_train_like_one_process(results)
    assert [r["held"]["blocks.0.fc1.weight"] for r in results] == [128 * 32 // 4] * 4
    assert [r["held"]["wte.weight"] for r in results] == [64 * 32 // 4] * 4


@pytest.mark.slow
def test_hybrid_two_stages_times_tp_2_times_dp_2_with_zero1_on_eight_ranks():
    results = run_ranks(pipeline_parity, 8, "gpt", 4, {"pipeline_nmicros": 2, "pipeline_nstages": 2}, "train_step",
                        2, 8, "hybrid", {"use_zero": 1})
    assert_ranks_train_like_one_process(results)
    assert [r["held"]["blocks.0.fc1.weight"] for r in results] == [1024, 1024, 0, 0] * 2
    assert [r["held"]["wte.weight"] for r in results] == [512] * 8      # tied: on both stages, rows of tp shards


def test_zero_bubble_under_hybrid_defers_the_weight_gradients_of_tensor_parallel_stages():
    """zb1p with 2 stages x tp 2: each stage's tp program compiles the split backward; every W action adds
    its stage's weight gradients (32 or 33 tensors per micro-batch on the test GPT)."""
    results = run_ranks(deferred_weight_gradients, 4, "gpt", 4, {"pipeline_nmicros": 4, "pipeline_nstages": 2,
                                                                "pipeline_scheduler": "zb1p"}, "train_step", 2, 8,
                        "hybrid")
    assert_ranks_train_like_one_process(results)
    assert all(len(r["deferred"]) == 2 * 4 and min(r["deferred"]) >= 32 for r in results), [r["deferred"] for r in results]


def test_plain_calls_of_a_graph_holding_its_batch_size_trace_it_again_per_micro_batch():
    """The test GPT's attention views (B, T, heads, -1) with B a traced number: the whole batch's graph
    cannot run a micro-batch, so Dynamo traces the model again at the micro-batch shape (tied head)."""
    results = run_ranks(pipeline_parity, 2, "gpt", 2, {"pipeline_nmicros": 4, "pipeline_scheduler": "gpipe"},
                        "plain", 2)
    assert_ranks_train_like_one_process(results)

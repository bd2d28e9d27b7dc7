"""transformers' own checkpoints of a dynshard model hold the whole trained model (issue: nothing lost).

Before: after tp or ZeRO-3 training, ``save_pretrained`` and Trainer's ``checkpoint-N`` wrote rank 0's
shards or rows without a word, ``from_pretrained`` failed on the size mismatch, and the other ranks' parts
were gone; Trainer's optimizer.pt held rank 0's pieces, and resuming a compiled model loaded nothing.
"""

from __future__ import annotations

import pytest

from distributed import run_ranks
from parity import assert_trains_like_one_process
from workers_pretrained import (lora_adapters_saved, pipeline_whole_state, save_pretrained_after_training,
                                save_pretrained_on_rank_zero_alone, second_model_of_the_class, trainer_checkpoints,
                                trainer_resumed)
from workers_trainer import VOCAB

POLICIES = {"tp": {"policy": "tp", "plan_ngpus": 2}, "ZeRO-3": {"use_zero": 3}, "dp": {},
            "pp": {"policy": "pp", "plan_ngpus": 2, "use_end2end": True, "pas_config": {"pipeline_nmicros": 2}},
            "hybrid": {"policy": "hybrid", "plan_ngpus": 4, "use_end2end": True,      # 2 stages x tp 2, 4 ranks
                       "pas_config": {"pipeline_nmicros": 2, "pipeline_nstages": 2}}}


@pytest.mark.parametrize("policy", ["tp", "ZeRO-3"])
def test_save_pretrained_on_every_rank_writes_the_whole_model_that_from_pretrained_loads(policy, tmp_path):
    results = run_ranks(save_pretrained_after_training, 2, POLICIES[policy], str(tmp_path))
    assert results[1]["local_shapes"]["model.embed_tokens.weight"][0] < VOCAB      # the ranks held pieces
    result = results[0]
    assert "model.safetensors" in result["files"], result["files"]
    assert_trains_like_one_process({"losses": [], "ref_losses": [], **{k: result[k] for k in ("params", "ref_params")}})


def test_save_pretrained_on_rank_zero_alone_is_refused_within_seconds_and_a_rank_s_torch_save_says_the_fix(tmp_path):
    results = run_ranks(save_pretrained_on_rank_zero_alone, 2, str(tmp_path / "out"))
    result = results[0]
    assert result["error"] is not None and "every rank" in result["error"], result
    assert result["seconds"] < 10 and not [f for f in result["files"] if f.endswith(".safetensors")], result
    assert result["reloaded_exact"]                  # the save called next on every rank wrote the whole model
    for rank, each in enumerate(results):
        assert f"rank {rank}'s pieces" in each["plain"] and "dynshard.gather_state_dict(model)" in each["plain"], each
        assert f"rank {1 - rank}'s pieces" in each["other"] and f"rank {rank} stores other pieces" in each["other"]


@pytest.mark.parametrize("policy", ["tp", pytest.param("ZeRO-3", marks=pytest.mark.slow), "dp", "pp",
                                    pytest.param("hybrid", marks=pytest.mark.slow)])
def test_trainer_checkpoints_load_in_one_process_and_resume_ends_like_the_uninterrupted_run(policy, tmp_path):
    directory, world = str(tmp_path / "run"), POLICIES[policy].get("plan_ngpus", 2)
    trained = run_ranks(trainer_checkpoints, world, POLICIES[policy], directory)
    first = trained[0]
    # checkpoint-4: the weights one process trained on the same batches, and SGD's momentum, both whole
    assert_trains_like_one_process(first, "checkpoint-4 through from_pretrained")
    resumed = run_ranks(trainer_resumed, world, POLICIES[policy], directory)
    for rank, result in enumerate(resumed):
        # a new job resumed from checkpoint-2 (weights, momentum, schedule) ends where the first job ended
        assert_trains_like_one_process({"losses": [], "ref_losses": [], "params": result["resumed"],
                                        "ref_params": trained[rank]["uninterrupted"]}, f"resumed, rank {rank}")


def test_peft_save_pretrained_writes_the_whole_lora_adapters_under_tp(tmp_path):
    results = run_ranks(lora_adapters_saved, 2, POLICIES["tp"], str(tmp_path))
    assert results[0]["split_adapters"], "no adapter was split: the test would not show the gather"
    result = results[0]
    assert "adapter_model.safetensors" in result["files"], result["files"]
    assert len(result["params"]) == 12, sorted(result["params"])      # A and B of 3 targets in 2 layers
    assert_trains_like_one_process({"losses": [], "ref_losses": [], "params": result["params"],
                                    "ref_params": result["ref_params"]}, "adapters through PeftModel.from_pretrained")


def test_a_pipeline_s_whole_model_and_optimizer_state_gather_to_rank_zero_as_one_process_holds_them():
    # what Trainer's checkpoint-N and save_pretrained write under pp: each rank holds only its stages' tensors
    # and their optimizer state; rank 0 gets every stage's (the tied embedding / LM head once)
    results = run_ranks(pipeline_whole_state, 2, "pp2")
    assert results[1]["empty"]
    assert_trains_like_one_process(results[0], "pp, rank 0's gathered state")


def test_a_second_model_of_the_class_served_the_first_one_s_frame_saves_whole_and_refuses_eager_calls(tmp_path):
    results = run_ranks(second_model_of_the_class, 2, str(tmp_path / "second"))
    for rank, result in enumerate(results):
        assert result["split"] and result["eager"] == "EagerCallOnShardsError", (rank, result)
    assert results[0]["exact"]          # from_pretrained: the second model whole, as it was before its step

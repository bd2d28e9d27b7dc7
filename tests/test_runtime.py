"""What happens at run time on 2 real ranks under tensor parallelism (plan_ngpus=2)."""

from __future__ import annotations

import pytest

from distributed import run_ranks
from workers import runtime_scenarios


@pytest.fixture(scope="module")
def outcome():
    results = run_ranks(runtime_scenarios, 2)
    return results[0], results[1]


def test_sharding_parameters_in_place_never_triggers_a_second_compile(outcome):
    for rank in outcome:
        assert rank["dynamo_graphs"] == 1      # after 3 steps: the first trace is the only one
        assert rank["training_programs"] == 1


def test_parameters_carry_their_parallel_dim(outcome):
    dims = outcome[0]["parallel_dims"]
    assert dims["blocks.0.fc1.weight"] == 0 and dims["blocks.0.fc2.weight"] == 1
    assert dims["blocks.0.attn.q.weight"] == 0 and dims["blocks.0.attn.proj.weight"] == 1
    assert dims["blocks.0.ln1.weight"] is None and dims["wpe.weight"] is None
    assert dims["wte.weight"] == 0       # vocab parallel: the tied embedding and LM head split by rows


def test_tied_parameters_stay_tied(outcome):
    assert all(rank["tied"] for rank in outcome)


def test_a_batch_of_a_new_size_trains_like_one_process(outcome):
    for rank in outcome:
        got, expected = rank["new_batch_loss"]
        assert got == pytest.approx(expected, rel=1e-5)


def test_inference_under_no_grad_and_eval_matches_one_process(outcome):
    for rank in outcome:
        assert rank["inference_error"] < 1e-5
        assert rank["inference_requires_grad"] is False


def test_collect_and_relocate_state_dict_round_trip(outcome):
    for rank in outcome:
        assert rank["keys_match"]
        assert rank["relocated_shapes_match"]
        assert rank["round_trip_error"] == 0
        assert rank["collected_error"] < 1e-5


def test_a_graph_break_keeps_training_correct(outcome):
    for rank in outcome:
        for got, expected in rank["graph_break_losses"]:
            assert got == pytest.approx(expected, rel=1e-5)
        assert rank["graph_break_param_error"] < 1e-5
        assert rank["graph_break_programs"] == 2
        assert rank["graph_break_sharded"] == ["down1.weight", "down2.weight", "up1.bias", "up1.weight",
                                               "up2.bias", "up2.weight"]

"""Two models with the same class, config and input shapes in one process: Dynamo serves the second one the
first one's compiled frame, so dynshard's program meets tensors it has not placed. Each model still gets
its own placement and trains like its own one-process reference (the second used to crash under tp and
ZeRO, and under a pipeline to be served the first one's stage tensors and train nothing of its own)."""

from __future__ import annotations

import pytest

from distributed import run_ranks
from parity import assert_trains_like_one_process
from workers_eager_guard import two_models_under
from workers_pipeline import two_models


@pytest.mark.parametrize("options", [{"policy": "tp", "plan_ngpus": 2}, {"use_zero": 3}], ids=["tp", "zero3"])
def test_a_second_model_of_the_same_class_is_placed_and_trains_like_one_process(options):
    for rank, result in enumerate(run_ranks(two_models_under, 2, options)):
        for seed, model in result.items():
            assert_trains_like_one_process(model, f"rank {rank}, model {seed}")


def test_a_second_pipelined_model_trains_its_own_stage_tensors_like_one_process():
    for rank, result in enumerate(run_ranks(two_models, 2)):
        for seed, model in result.items():
            assert_trains_like_one_process(model, f"rank {rank}, model {seed}")

"""Buffers a program writes (BatchNorm's running statistics) stay equal over the data-parallel replicas,
as DDP's broadcast_buffers keeps them: evaluation and checkpoints do not depend on the rank."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from parity import assert_tensors_close, assert_tensors_equal
from workers_unit_inputs import buffers_like_ddp

WRITTEN = 2 * 32 * 4 + 8    # BatchNorm1d(32): running_mean and running_var (float32), num_batches_tracked


@pytest.mark.parametrize("world,case", [
    (2, {}), (2, {"use_zero": 3}),
    pytest.param(4, {"policy": "tp", "plan_ngpus": 2}, marks=pytest.mark.slow),    # tp units of 2, 2 units
], ids=["dp", "zero3", "tp-units"])
def test_running_statistics_are_the_first_replicas_on_every_rank_as_with_ddp(world, case):
    results = run_ranks(buffers_like_ddp, world, case)
    for rank, result in enumerate(results):
        # rtol 1e-5: tighter than parity's standard (1e-4)
        assert_tensors_close(result["buffers"], result["ddp_rank0_buffers"], f"rank {rank} buffers", rtol=1e-5)
        assert result["eval_loss"] == results[0]["eval_loss"]
        assert result["broadcasts"] == 3 and result["bytes"] == 3 * WRITTEN   # once per training call, not in eval


def test_broadcast_buffers_false_keeps_each_replicas_own_statistics():
    results = run_ranks(buffers_like_ddp, 2, {"broadcast_buffers": False})
    assert results[0]["broadcasts"] is None
    assert not torch.allclose(results[0]["buffers"]["norm.running_mean"], results[1]["buffers"]["norm.running_mean"])


@pytest.mark.slow
def test_a_pipeline_stages_running_statistics_are_equal_over_data_parallel_units():
    from workers_unit_inputs import pipeline_buffers

    results = run_ranks(pipeline_buffers, 4)
    # dynshard.data_parallel_rank read torchrun's RANK before the group existed: the units read other batches
    assert [r["unit"] for r in results] == [0, 0, 1, 1]
    torch.testing.assert_close(results[1]["held"], results[3]["held"], rtol=0, atol=0)   # stage 1 of each unit
    for rank, result in enumerate(results):
        assert_tensors_equal(result["buffers"], results[0]["buffers"], f"rank {rank} buffers")
    # the stage holding the norm broadcasts its written statistics once per step; the other sends none
    assert sorted(r["sent"] for r in results) == [0, 0, 2 * WRITTEN, 2 * WRITTEN]

"""Random ops (dropout) under a plan unit: each rank holds the values one process draws, and ranks that would
draw apart fail before the first step.

A random op on split values is drawn whole on every rank and sliced (:mod:`dynshard.passes.random_draws`);
DTensor alone draws each shard from the same generator state, so both halves of a head-split attention
dropout would drop the same positions. The ranks of a unit compare their generator's state with their inputs
(:mod:`dynshard.runtime.unit_inputs`): ranks seeded apart would drop different positions of a replicated
value, and its replicas would drift apart.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

from distributed import run_ranks
from parity import assert_trains_like_one_process
from plans import plan_for
from workers_random_ops import all_device_dropout, dropout_parity, hybrid_seeded, seeded_per_rank


@pytest.mark.parametrize("policy,options", [("tp", {}), ("data", {}),
                                            ("tp", {"pas_config": {"sequence_parallel": True}}),
                                            ("tp", {"recompute_modules": "ROOT"})],
                         ids=["tp", "data", "tp+sp", "tp+recompute"])
def test_attention_dropout_on_split_heads_or_rows_draws_what_one_process_draws(policy, options):
    for result in run_ranks(dropout_parity, 2, "attention", policy, "aot_eager", options):
        assert result["same_draws"] == [True] * 3
        assert ("forward", "all_gather") not in result["collectives"]      # the draw communicates nothing
        assert_trains_like_one_process(result, policy)


@pytest.mark.parametrize("policy", ["tp", "data"])
def test_each_kind_of_dropout_on_split_values_draws_what_one_process_draws(policy):
    """Element-wise (in place), channel (``dropout1d``), alpha and feature-alpha dropout and a ``rand_like``
    noise, on a hidden activation split by its columns (tp) or rows (data)."""
    for result in run_ranks(dropout_parity, 2, "dropout kinds", policy, "aot_eager"):
        assert result["same_draws"] == [True] * 3
        assert_trains_like_one_process(result, policy)


def test_under_inductor_the_unit_draws_what_one_process_compiled_draws():
    """Inductor generates most random numbers itself, from its element's index: a shard drawn whole and sliced
    holds what one process compiled by Inductor draws there."""
    for result in run_ranks(dropout_parity, 2, "dropout kinds", "data", "inductor", None, 3, True):
        assert result["same_draws"] == [True] * 3
        assert_trains_like_one_process(result, "inductor")


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_gpt2_with_its_dropouts_trains_like_one_process_under_tp(compiler):
    """transformers' GPT-2 at its default dropouts (0.1): embeddings and residuals dropped on whole values,
    attention on its heads, split over the two ranks."""
    for result in run_ranks(dropout_parity, 2, "gpt2", "tp", compiler):
        assert result["placements"]["transformer.h.0.attn.c_attn.weight"] == "1"   # heads split (Conv1D: [in, out])
        assert result["same_draws"] == [True] * 3
        assert_trains_like_one_process(result, compiler)


def test_ranks_of_a_unit_seeded_apart_fail_on_every_rank_at_the_first_call():
    for result in run_ranks(seeded_per_rank, 2, 2, "rank"):
        assert result["call"] == 0, result
        assert "ranks 0 and 1 of plan unit 0" in result["error"]
        assert "random generator's state differs" in result["error"]
        assert "torch.manual_seed(seed + dp_rank)" in result["error"]


def test_ranks_seeded_alike_or_not_drawing_or_in_other_units_run():
    alike = run_ranks(seeded_per_rank, 2, 2, "alike")
    assert [r["error"] for r in alike] == [None, None]
    assert alike[0]["losses"][0] == alike[0]["losses"][1]       # the unit's ranks hold one loss
    evaluating = run_ranks(seeded_per_rank, 2, 2, "rank", False)     # eval mode: no random op, nothing to compare
    assert [r["error"] for r in evaluating] == [None, None]
    units = run_ranks(seeded_per_rank, 2, 1, "rank")             # two units of one rank: seeded apart at will
    assert [r["error"] for r in units] == [None, None]


class Sampled(nn.Module):
    """Random ops on values tp splits: a draw that reads only its operand's shape, and one that reads its values
    (``torch.bernoulli(probabilities)``)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = self.up(x)
        noise = torch.rand_like(h)
        return self.down(torch.bernoulli(torch.sigmoid(h)) * noise).sum()


def test_a_draw_by_shape_is_sliced_and_a_draw_by_value_gathers(fake_world):
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"aten.bernoulli.default runs replicated \(inputs gathered\).*random op"):
        plan = plan_for(Sampled(), (torch.randn(4, 8),), policy="tp", plan_ngpus=2,
                        partition_constraints={"up": "S0", "down.weight": "S1"})      # h split on its columns
    propagation = plan.propagation
    rand = next(n for n in propagation.placements if n.startswith("rand_like"))
    assert propagation.drawn_whole == {rand} and propagation.placements[rand] == (Shard(1),)
    (bernoulli, reason), = propagation.fallbacks.items()
    assert bernoulli.startswith("bernoulli") and "random op on split values runs whole" in reason
    assert [(c.node, c.kind) for c in propagation.collectives if c.kind != "all_reduce"] == [(bernoulli, "all_gather")]


def test_a_pipelines_tensor_parallel_ranks_seeded_apart_fail_and_its_stages_may_differ():
    """Hybrid, 2 stages of 2 tp ranks: the ranks of a stage draw alike or fail at the first call, on every rank
    (the stage programs are lowered only at their first call: the graph is lowered at planning to know); the
    stages themselves draw different numbers by design."""
    for result in run_ranks(hybrid_seeded, 4, "rank"):
        assert result["call"] == 0 and "random generator's state differs" in result["error"], result
    stages = run_ranks(hybrid_seeded, 4, "stage")
    assert [r["error"] for r in stages] == [None] * 4
    assert all(r["losses"] == stages[0]["losses"] for r in stages)


def test_planning_holds_dtensors_rng_tracker_off_and_gives_it_back():
    """On a CUDA mesh DTensor starts an RNG tracker that reads the generator's offset, which fails on the
    FakeTensors planning runs on (every tp plan with a dropout failed to plan on an H200): while dynshard
    plans, a tracker there is switched off, or a stand-in that does nothing is there."""
    import torch.distributed.tensor._random as dtensor_random

    from dynshard.compat.tracing import local_random_ops

    before = dtensor_random._rng_tracker
    try:
        dtensor_random._rng_tracker = None
        with local_random_ops():
            stand_in = dtensor_random._rng_tracker
            assert stand_in is not None and not stand_in.distribute_region_enabled
            with stand_in._distribute_region(None):
                pass
        assert dtensor_random._rng_tracker is None

        class Tracker:
            distribute_region_enabled = True
        dtensor_random._rng_tracker = tracker = Tracker()
        with local_random_ops():
            assert dtensor_random._rng_tracker is tracker and not tracker.distribute_region_enabled
        assert tracker.distribute_region_enabled
    finally:
        dtensor_random._rng_tracker = before


def test_1f1b_plus_all_device_stage_draws_alike_on_every_rank_however_they_are_seeded():
    """The embeddings' dropout runs on every rank (the all-device stage), between each rank's own pipeline
    stages: it draws from one generator the unit shares, so ranks seeded apart train exactly as ranks seeded
    alike (rank 0 seeded the same; the layers draw nothing). Before, each rank dropped its own positions of
    the one value and the embedding's shards took gradients through masks the pipeline never ran."""
    alike = run_ranks(all_device_dropout, 2, "alike")
    apart = run_ranks(all_device_dropout, 2, "apart")
    for a, b in zip(alike, apart):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["params"][name], b["params"][name]) for name in a["params"])

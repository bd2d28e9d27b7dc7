"""A parallel run trains like one process: losses per step and parameters after 5 AdamW steps."""

from __future__ import annotations

import pytest

from distributed import run_ranks
from models import GPTConfig
from parity import assert_parity_job_trains_like_one_process
from workers import train_parity

CASES = [  # model, policy, plan_ngpus, world size
    ("mlp", "dp", 1, 2), ("mlp", "data", 2, 2), ("mlp", "tp", 2, 2),
    ("gpt", "dp", 1, 2), ("gpt", "data", 2, 2), ("gpt", "tp", 2, 2),
    ("gpt", "tp", 2, 4), ("mlp", "tp", 2, 4), ("gpt", "data", 2, 4), ("gpt_fused", "tp", 2, 2),
    ("mlp_bn", "tp", 2, 2), ("mlp_bn", "data", 2, 2),
]
# covered at 2 ranks (mlp tp) and by the gpt on 4 ranks (tp units over dp): run with -m slow
SLOW = {("mlp", "tp", 2, 4)}


@pytest.mark.parametrize("model,policy,plan_ngpus,world", [
    pytest.param(*case, id="{}-{}-plan{}-world{}".format(*case), marks=[pytest.mark.slow] if case in SLOW else [])
    for case in CASES])
def test_parallel_training_matches_single_process(model, policy, plan_ngpus, world):
    results = run_ranks(train_parity, world, model, policy, plan_ngpus, "aot_eager")
    assert_parity_job_trains_like_one_process(results)
    kinds = {kind for _, kind, _ in results[0]["collectives"]}
    if policy == "dp":
        assert {(p, k, g) for p, k, g in results[0]["collectives"]} == {("backward", "all_reduce", "dp")}
    if policy == "tp":
        assert kinds <= {"all_reduce"}, results[0]["explain"]
        sharded = [n for n, d in results[0]["parallel_dims"].items() if d is not None]
        # a feature-split BatchNorm would gather its running statistics: the policy keeps that MLP whole
        assert bool(sharded) == (model != "mlp_bn"), results[0]["explain"]
    if model == "gpt_fused":      # q, k and v of the fused projection are split by heads
        assert results[0]["parallel_dims"]["blocks.0.attn.c_attn.weight"] == 0, results[0]["explain"]
        forward = [c for c in results[0]["collectives"] if c[0] == "forward"]
        backward = [c for c in results[0]["collectives"] if c[0] == "backward"]
        # Megatron's: 2 per layer, the vocab-parallel embedding's, and 3 of one value per row in the
        # vocab-parallel cross-entropy; backward: 2 per layer and the LM head's input gradient
        assert len(forward) == 2 * GPTConfig().layers + 1 + 3, results[0]["explain"]
        # (aot_eager's partitioner may recompute the loss's max all-reduce of one value per row)
        assert len(backward) - 2 * GPTConfig().layers - 1 in (0, 1), results[0]["explain"]


@pytest.mark.parametrize("scope", ["program", "blocks"])
def test_tensor_parallel_gpt_with_inductor_matches_single_process(scope):
    results = run_ranks(train_parity, 2, "gpt", "tp", 2, "inductor", 5, 4, {"compile_scope": scope})
    assert_parity_job_trains_like_one_process(results)


def test_tensor_parallel_halves_every_transformer_layer_parameter_but_norms_and_row_biases():
    results = run_ranks(train_parity, 2, "gpt", "tp", 2, "aot_eager", 1)
    local, full = results[0]["local_numel"], {k: v.numel() for k, v in results[0]["params"].items()}
    layer = [name for name in local if name.startswith("blocks.")]
    whole = {name for name in layer if local[name] == full[name]}
    assert all(".ln" in n or n.endswith(("proj.bias", "fc2.bias")) for n in whole), results[0]["explain"]
    assert all(local[n] * 2 == full[n] for n in layer if n not in whole), results[0]["explain"]

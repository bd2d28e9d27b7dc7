"""Mixture of experts under the ``tp`` policy (issue 25 item 5): transformers' Mixtral and Qwen3-MoE with
their experts as 3-D parameters, run by ``experts_implementation="batched_mm"`` or ``"grouped_mm"``
(one static-shape graph), train like one process on 2 gloo ranks (the loss includes the router's
auxiliary loss) with every expert split along its intermediate dimension (Megatron's expert tensor
parallelism: ``gate_up_proj`` column-split block by block, ``down_proj`` row-split), one all-reduce per
MoE layer forward and one backward. transformers' eager loop over the experts is refused, naming the fix.

Each (model, implementation) is one 2-rank job whose result all of its tests read.
"""

from __future__ import annotations

import functools

import pytest

from distributed import run_ranks
from parity import assert_losses_close, assert_trains_like_one_process
from workers_moe import HIDDEN, LAYERS, ROWS, SEQ, TOP_K, refused_moe, train_moe

pytest.importorskip("transformers")


JOBS = [("mixtral", "batched_mm"), ("mixtral", "grouped_mm"),
        pytest.param("qwen3_moe", "batched_mm", marks=pytest.mark.slow)]    # (Qwen3-MoE: about 20 s more)
JOB_IDS = ["mixtral-batched_mm", "mixtral-grouped_mm", "qwen3_moe-batched_mm"]
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
ROUTED = ROWS * SEQ * TOP_K           # (token, expert) pairs of one batch


@functools.cache
def job(name: str, implementation: str, world: int = 2, use_zero: int = 0, dtype: str = "float32") -> tuple[dict, ...]:
    return tuple(run_ranks(train_moe, world, name, implementation, 2, 3, use_zero, dtype, timeout=900))


def assert_all_train_like_one_process(results) -> None:
    for rank, result in enumerate(results):     # the router's auxiliary loss too
        assert_trains_like_one_process(result, f"rank {rank}", loss_keys=("losses", "aux"))


@pytest.mark.parametrize("name,implementation", JOBS, ids=JOB_IDS)
def test_moe_trains_like_one_process_under_tp(name, implementation):
    results = job(name, implementation)
    for result in results:
        # transformers' output capturing (output_router_logits=True) breaks Dynamo's graph once, before
        # the loss: the model's program and the loss's (vocab-parallel cross-entropy + aux loss)
        assert result["dynamo_graphs"] == 2 and result["programs"] == 2, result["explain"]
    assert_all_train_like_one_process(results)


@pytest.mark.parametrize("name,implementation", JOBS, ids=JOB_IDS)
def test_experts_split_along_their_intermediate_dimension(name, implementation):
    for rank, result in enumerate(job(name, implementation)):
        local, full = result["local_numel"], result["full_numel"]
        experts = [n for n in full if n.endswith(EXPERTS)]
        assert len(experts) == 2 * LAYERS, sorted(full)
        for n in experts:
            assert local[n] * 2 == full[n], f"rank {rank} {n}: {local[n]} of {full[n]}\n{result['explain']}"
        fraction = sum(local.values()) / sum(full.values())
        print(f"{name} {implementation} rank {rank}: local/full parameters = {fraction:.4f}")
        assert fraction < 0.51, result["explain"]
        for line in result["explain"].splitlines():
            if line.strip().startswith("model.layers.") and "gate_up_proj" in line:
                assert line.rstrip().endswith("tp=_S(1, 2)"), line     # [gate_r, up_r] of every expert
            if line.strip().startswith("model.layers.") and "down_proj" in line:
                assert line.rstrip().endswith("tp=S(2)"), line


@pytest.mark.parametrize("name,implementation", JOBS, ids=JOB_IDS)
def test_one_all_reduce_per_moe_layer_each_way(name, implementation):
    """Forward: the embedding's and each layer's attention all-reduce as before, plus one per MoE layer
    (the experts' outputs, [tokens x top_k, H], before the weighted sum over top-k), plus the 3 of one
    value per row of the vocab-parallel cross-entropy. Backward: per layer one for attention's input
    gradient and one for the experts' (as Megatron's MLP), plus the loss program's two."""
    moe_shape = (ROUTED, HIDDEN, 1) if implementation == "batched_mm" else (ROUTED, HIDDEN)
    activation, per_row = (ROWS, SEQ, HIDDEN), (ROWS * SEQ, 1)
    for result in job(name, implementation):
        tp = [c for c in result["collectives"] if c[2] == "tp"]
        forward = [c[4] for c in tp if c[:2] == ("forward", "all_reduce")]
        backward = [c[4] for c in tp if c[:2] == ("backward", "all_reduce")]
        assert sorted(forward) == sorted([activation] * (LAYERS + 1) + [moe_shape] * LAYERS + [per_row] * 3), \
            result["explain"]
        extra = 2 * LAYERS if name == "qwen3_moe" else 0    # q_norm/k_norm weights read on split heads
        assert len(backward) == 2 * LAYERS + 2 + extra, result["explain"]
        # no gather or all-to-all but the returned logits' gather
        others = [c for c in tp if c[1] != "all_reduce"]
        assert [c[:2] for c in others] == [("forward", "all_gather")], result["explain"]


def test_bf16_grouped_mm_splits_torch_grouped_mm():
    """A bf16 model compiles transformers' grouped_mm to ``torch._grouped_mm`` (DTensor's own strategies;
    in fp32 it is transformers' opaque op, whose strategies dynshard registers): the same split, and
    the losses of one bf16 process up to bf16 rounding (partial sums are added in another order)."""
    results = job("mixtral", "grouped_mm", dtype="bfloat16")
    for rank, result in enumerate(results):
        # bf16 on both sides, partial sums added in another order: one bf16 rounding is up to 2**-8 ~ 4e-3
        # relative, so the losses are held to 2e-3, not parity's fp32 1e-5
        assert_losses_close(result["losses"], result["ref_losses"], f"rank {rank} losses", rtol=2e-3)
        assert_losses_close(result["aux"], result["ref_aux"], f"rank {rank} router aux losses", rtol=2e-3)
        for n, full in result["full_numel"].items():
            if n.endswith(EXPERTS):
                assert result["local_numel"][n] * 2 == full, (n, result["explain"])
        forward = [c[4] for c in result["collectives"] if c[:3] == ("forward", "all_reduce", "tp")]
        assert forward.count((ROUTED, HIDDEN)) == LAYERS, result["explain"]


def test_eager_experts_are_refused_with_the_fix():
    messages = run_ranks(refused_moe, 2, "mixtral", "eager", timeout=600)
    for message in messages:
        assert "experts_implementation=\"batched_mm\"" in message and "eager loop" in message, message


@pytest.mark.slow
def test_moe_tp_times_zero_trains_like_one_process():
    """tp x dp on 4 ranks with ZeRO-1: the experts' tp shards are stored as rows over the dp ranks."""
    results = job("mixtral", "batched_mm", 4, 1)
    assert_all_train_like_one_process(results)
    for result in results:
        for n, full in result["full_numel"].items():
            if n.endswith(EXPERTS):
                assert result["local_numel"][n] * 4 == full, (n, result["explain"])

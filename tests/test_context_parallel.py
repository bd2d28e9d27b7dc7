"""Context parallelism (``pas_config={"context_parallel": C}``): the sequence split over a unit's ranks trains
like one process."""

from __future__ import annotations

import pytest

import workers_context_parallel as workers
from distributed import run_ranks
from parity import assert_ranks_train_like_one_process

import dynshard
from dynshard.config import ConfigError
from dynshard.passes.context_parallel_attention import BalancedChunks
from dynshard.policies.megatron import TensorParallelOptions


def test_split_attention_matches_one_process_in_float64():
    for rank_result in run_ranks(workers.attention_exact, 2):
        assert rank_result[True] < 1e-12 and rank_result[False] < 1e-12, rank_result


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_causal_chunks_balance_the_work_over_the_ranks(ranks):
    work = {}
    for rank in range(ranks):
        chunks = BalancedChunks(ranks, rank)
        assert sorted(chunks.computed) == sorted((rank, 2 * ranks - 1 - rank))
        assert sum(chunks.sent) == sum(chunks.received) == 2
        work[rank] = sum(j + 1 for j in chunks.computed)      # query chunk j attends to j + 1 key chunks
    assert set(work.values()) == {2 * ranks + 1}
    # what rank r sends to rank d is what rank d receives from rank r
    for r in range(ranks):
        for d in range(ranks):
            assert BalancedChunks(ranks, r).sent[d] == BalancedChunks(ranks, d).received[r]


def test_gpt_with_the_sequence_split_over_two_ranks_trains_like_one_process():
    results = run_ranks(workers.sgd_parity, 2, "gpt", 2)
    assert_ranks_train_like_one_process(results)
    kinds = {(phase, kind) for phase, kind, _ in results[0]["collectives"]}
    # keys and values gathered, the causal chunks exchanged, the parameters' gradients all-reduced
    assert {("forward", "all_gather"), ("forward", "all_to_all"), ("backward", "reduce_scatter"),
            ("backward", "all_to_all"), ("backward", "all_reduce")} <= kinds


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_the_sequence_split_trains_like_one_process_under_inductor(name):
    """The compiler users run: the split attention's collectives and flash kernels inside Inductor's program."""
    assert_ranks_train_like_one_process(run_ranks(workers.sgd_parity, 2, name, 2, 3, 2, {"compiler": "inductor"}))


def test_transformers_llama_with_the_sequence_split_trains_like_one_process():
    """Rotary positions, grouped-query heads, and transformers' sdpa attention with the causal mask it builds
    while traced (a mask: each rank attends its rows of it)."""
    assert_ranks_train_like_one_process(run_ranks(workers.sgd_parity, 2, "llama", 2))


def test_the_sequence_split_composes_with_zero3_across_two_units():
    """Two units of two ranks: each unit splits its own batch's sequence, ZeRO-3 shards the parameters over the
    units (gathered before use, gradients reduce-scattered): the units' mean loss of one process."""
    results = run_ranks(workers.sgd_parity, 4, "gpt", 2, 3, 2, {"use_zero": 3})
    assert_ranks_train_like_one_process(results)
    groups = {(kind, group) for _, kind, group in results[0]["collectives"]}
    assert {("all_gather", "dp"), ("reduce_scatter", "dp"), ("all_gather", "tp")} <= groups, groups


def test_autodist_chooses_the_sequence_split_where_it_is_the_fastest_plan_that_fits_and_it_trains_like_one_process():
    """A long sequence, one row per unit: autodist prices context parallelism beside tp's plans; given a memory
    limit under which a context-parallel plan is the fastest that fits, it chooses that plan, which trains
    like one process."""
    seq = 1024
    (candidates,) = run_ranks(workers.autodist_candidates, 1, seq)
    by_peak = sorted(candidates, key=lambda c: c[2])
    assert any(name.startswith("context parallel") for name, _, _ in candidates), candidates
    for i, (name, _, peak) in enumerate(by_peak[:-1]):
        fastest = min(by_peak[:i + 1], key=lambda c: c[1])[0]
        if fastest.startswith("context parallel") and by_peak[i + 1][2] > peak:
            limit_gb = (peak + by_peak[i + 1][2]) / 2 / 1024 ** 3
            break
    else:
        raise AssertionError(f"no memory limit makes a context-parallel plan the fastest that fits: {by_peak}")
    results = run_ranks(workers.sgd_parity, 2, "gpt", 2, 3, 1,
                        {"policy": "autodist", "pas_config": {"mem_constraint": limit_gb}}, seq)
    assert results[0]["chosen"] == [fastest], (results[0]["chosen"], fastest)
    assert_ranks_train_like_one_process(results)


def test_a_sequence_that_does_not_split_is_refused_on_every_rank():
    for message in run_ranks(workers.refuses_uneven_sequence, 2):
        assert "context_parallel=2 splits the sequence into 4 chunks" in message, message
        assert "15 tokens" in message and "pad_to_multiple_of=4" in message, message


def test_context_parallel_options_are_checked():
    with pytest.raises(ConfigError, match="positive integer"):
        TensorParallelOptions.from_pas_config({"context_parallel": 0})
    with pytest.raises(ConfigError, match="leave sequence_parallel"):
        TensorParallelOptions.from_pas_config({"context_parallel": 2, "sequence_parallel": True})
    with pytest.raises(ConfigError, match="set plan_ngpus=2"):
        TensorParallelOptions.from_pas_config({"context_parallel": 2}).check_unit(4)
    assert dynshard.Config(policy="tp", plan_ngpus=2, pas_config={"context_parallel": 2}).pas_config == {
        "context_parallel": 2}

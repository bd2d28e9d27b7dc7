"""Context parallelism (``pas_config={"context_parallel": C}``): the sequence split over a unit's ranks trains
like one process."""

from __future__ import annotations

import pytest

import workers_context_parallel as workers
from distributed import run_ranks
from parity import assert_losses_close, assert_ranks_train_like_one_process, assert_tensors_close

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


@pytest.mark.parametrize("name", ["llama-eager", "qwen3", "gpt2"])
def test_transformers_models_with_the_sequence_split_train_like_one_process(name):
    """Attention as transformers writes it: Llama's eager attention (matmuls, folded into the attention op),
    Qwen3 (grouped-query heads, q/k norms), GPT-2 (learned positions, fused c_attn); labels padded."""
    results = run_ranks(workers.transformers_sgd_parity, 2, name)
    assert_ranks_train_like_one_process(results)
    assert ("forward", "all_gather") in results[0]["collectives"], results[0]["collectives"]


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


def test_trainer_with_a_padding_collator_trains_like_one_process_with_the_sequence_split():
    """transformers' Trainer, ``DataCollatorForLanguageModeling(pad_to_multiple_of=4)``: each rank's rows padded
    to its own longest (a new length nearly every step), labels -100 and the collator's ``attention_mask`` at
    the padding, the sequence split over two ranks."""
    from workers_symbolic_shapes import trainer_padding

    options = {"policy": "tp", "compiler": "aot_eager", "pas_config": {"context_parallel": 2}}
    results = run_ranks(trainer_padding, 2, options, 3, 2, True, 4, timeout=600)
    assert_ranks_train_like_one_process(results)
    assert len(set(results[0]["lengths"])) > 1, results[0]["lengths"]


def test_a_model_trained_with_the_sequence_split_evaluates_generates_and_saves_like_one_process():
    """Evaluation at a length that splits and at one that does not (a graph without gradients then runs whole),
    greedy ``generate``, ``save_pretrained`` read back by ``from_pretrained``."""
    for found in run_ranks(workers.after_training, 2):
        for length in (12, 7):
            got, expected = found[f"eval{length}"]
            assert_losses_close([got], [expected], f"eval at {length} tokens")
        assert found["generated"][0] == found["generated"][1], found["generated"]
        assert_tensors_close(found["pretrained"], found["ref_params"], "from_pretrained")


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

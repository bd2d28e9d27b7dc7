"""transformers' ``repeat_kv`` before attention without a mask folds into ``enable_gqa=True``
(``passes/grouped_query_attention.py``): attention keeps and gathers the grouped heads, not their copies."""

from __future__ import annotations

import pytest
import torch

from models import GPTConfig, LlamaLM, gpt_batch
from plans import logged_pass_graphs


def attention_after_folding(model, inputs, **options) -> list[str]:
    graph = next(r for r in logged_pass_graphs(model, inputs, **options)
                 if r.startswith("graph after fold_repeated_kv:"))
    return [line.strip() for line in graph.splitlines()
            if "scaled_dot_product_attention(" in line and not line.strip().startswith("#")]


def llama(kv_heads: int) -> LlamaLM:
    """tests/models.LlamaLM with ``kv_heads`` key/value heads (its 4 query heads)."""
    import transformers

    torch.manual_seed(0)
    model = LlamaLM(GPTConfig(seq=32))
    config = model.model.config
    config.num_key_value_heads = kv_heads
    model.model = transformers.LlamaForCausalLM(config)
    return model


@pytest.mark.parametrize("options", [dict(policy="tp", plan_ngpus=2), dict(policy="dp", plan_ngpus=1),
                                     dict(policy="tp", plan_ngpus=2, pas_config={"context_parallel": 2})],
                         ids=["tp", "dp", "cp"])
def test_llamas_repeated_keys_and_values_fold_into_grouped_query_attention(fake_world, options):
    """4 query heads, 2 key/value heads: every layer's attention reads the grouped heads."""
    cfg = GPTConfig(seq=32)
    calls = attention_after_folding(llama(2), gpt_batch(cfg, 2, 0), **options)
    assert len(calls) == cfg.layers and all("enable_gqa = True" in c and "is_causal = True" in c for c in calls), calls
    assert all("reshape" not in c for c in calls), calls


def test_one_key_value_head_keeps_its_repeat_where_tensor_parallelism_splits_the_heads(fake_world):
    """Multi-query attention (one key/value head) under tp 2: the grouped heads would not split over the unit,
    so the repeat stays (the queries split, their repeated keys and values with them); under context
    parallelism, which splits no heads, it folds."""
    cfg = GPTConfig(seq=32)
    kept = attention_after_folding(llama(1), gpt_batch(cfg, 2, 0), policy="tp", plan_ngpus=2)
    assert kept and all("enable_gqa" not in c for c in kept), kept
    folded = attention_after_folding(llama(1), gpt_batch(cfg, 2, 0), policy="tp", plan_ngpus=2,
                                     pas_config={"context_parallel": 2})
    assert folded and all("enable_gqa = True" in c for c in folded), folded

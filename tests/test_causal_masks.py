"""Attention masks computed from sizes alone that are the causal mask run as ``is_causal=True``
(``passes/causal_masks.py``); every other mask is left as it is."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import GPTConfig, LlamaLM, gpt_batch
from plans import logged_pass_graphs


def graph_after_recognition(model, inputs, **options) -> str:
    """The graph that ``recognize_causal_masks`` leaves for ``model(*inputs)`` (a tp plan of two ranks)."""
    records = logged_pass_graphs(model, inputs, **{"policy": "tp", "plan_ngpus": 2, **options})
    return next(r for r in records if r.startswith("graph after recognize_causal_masks:"))


def attention_calls(graph: str) -> list[str]:
    return [line.strip() for line in graph.splitlines()
            if "scaled_dot_product_attention(" in line and not line.strip().startswith("#")]


class MaskedAttention(nn.Module):
    """One attention layer whose mask is built in ``forward`` by ``make_mask(T)`` (or taken from the caller)."""

    def __init__(self, make_mask=None, dim: int = 16, heads: int = 2):
        super().__init__()
        self.qkv, self.out, self.heads, self.make_mask = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads, make_mask

    def forward(self, x, mask=None):
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in self.qkv(x).split(d, -1))
        if mask is None:
            mask = self.make_mask(t, x)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, t, d)).pow(2).mean()


def _boolean_causal(t, x):
    positions = torch.arange(t, device=x.device)
    return (positions[None, :] <= positions[:, None])[None, None].expand(x.shape[0], 1, t, t)


def _float_causal(t, x):
    return torch.full((t, t), float("-inf"), device=x.device).triu(1)


def _float_lowest_causal(t, x):
    return torch.zeros(t, t, device=x.device).masked_fill(
        torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), torch.finfo(x.dtype).min)


def _sliding_window(t, x):
    positions = torch.arange(t, device=x.device)
    distance = positions[:, None] - positions[None, :]
    return (distance >= 0) & (distance < 3)


def _bidirectional(t, x):
    return torch.ones(t, t, dtype=torch.bool, device=x.device)


def test_transformers_llamas_traced_mask_becomes_is_causal(fake_world):
    """transformers' Llama with ``use_cache=False`` builds a (B, 1, T, T) mask while traced (its packed-document
    mask from the position ids); computed from sizes alone, it is the causal mask, and goes."""
    cfg = GPTConfig(seq=32)
    torch.manual_seed(0)
    graph = graph_after_recognition(LlamaLM(cfg), gpt_batch(cfg, 2, 0))
    calls = attention_calls(graph)
    assert len(calls) == cfg.layers, graph
    assert all("attn_mask = None" in c and "is_causal = True" in c for c in calls), calls
    assert "packed_sequence_mask" not in graph and "torch.arange(2" not in graph, graph


@pytest.mark.parametrize("make_mask", [_boolean_causal, _float_causal, _float_lowest_causal],
                         ids=["boolean", "float-inf", "float-lowest"])
def test_a_causal_mask_made_from_sizes_becomes_is_causal(fake_world, make_mask):
    torch.manual_seed(0)
    calls = attention_calls(graph_after_recognition(MaskedAttention(make_mask), (torch.randn(2, 8, 16),)))
    assert len(calls) == 1 and "attn_mask = None" in calls[0] and "is_causal = True" in calls[0], calls


@pytest.mark.parametrize("make_mask", [_sliding_window, _bidirectional], ids=["sliding-window", "all-ones"])
def test_a_mask_made_from_sizes_that_is_not_causal_is_kept(fake_world, make_mask):
    torch.manual_seed(0)
    calls = attention_calls(graph_after_recognition(MaskedAttention(make_mask), (torch.randn(2, 8, 16),)))
    assert len(calls) == 1 and "attn_mask = None" not in calls[0] and "is_causal" not in calls[0], calls


def test_a_mask_read_from_an_input_is_kept_even_when_it_is_causal(fake_world):
    """A mask the caller passes may change from batch to batch: only one computed from sizes is the same on
    every step."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    calls = attention_calls(graph_after_recognition(MaskedAttention(), (x, _boolean_causal(8, x).clone())))
    assert len(calls) == 1 and "attn_mask = None" not in calls[0], calls


def test_llamas_padding_mask_from_the_collator_is_kept(fake_world):
    """transformers' mask with the collator's ``attention_mask`` reads an input: the padding it masks may differ
    per batch, so it stays."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, use_cache=False))
    ids = torch.randint(0, 64, (2, 8))
    calls = attention_calls(graph_after_recognition(
        model, (ids, torch.ones_like(ids)), policy="dp", plan_ngpus=1))
    assert len(calls) == 1 and "attn_mask = None" not in calls[0], calls

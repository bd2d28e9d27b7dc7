"""Attention written out as matmuls (transformers' ``attn_implementation="eager"``) becomes the attention op
(``passes/eager_attention.py``), unless something else reads its weights or its dropout draws."""

from __future__ import annotations

import torch

from models import causal_lm
from plans import logged_pass_graphs


def graphs_after(model, inputs, *names: str, **options) -> list[str]:
    """The graphs the passes ``names`` leave while ``model(*inputs)`` is planned (tp over two ranks)."""
    records = logged_pass_graphs(model, inputs, **{"policy": "tp", "plan_ngpus": 2, **options})
    return [next(r for r in records if r.startswith(f"graph after {name}:")) for name in names]


def code_lines(graph: str, text: str) -> list[str]:
    return [line.strip() for line in graph.splitlines() if text in line and not line.strip().startswith("#")]


class Causal(torch.nn.Module):
    """``model(ids, labels) -> loss`` of a transformers causal LM."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels).loss


class ReturnsWeights(torch.nn.Module):
    """One attention written as transformers' eager formula, its weights returned beside the output (what
    ``output_attentions=True`` does)."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.qkv, self.heads = torch.nn.Linear(dim, 3 * dim), heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in self.qkv(x).split(d, -1))
        weights = torch.nn.functional.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.5, dim=-1,
                                              dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, v).sum(), weights


def batch():
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    return ids, ids.clone()


def test_llamas_eager_attention_becomes_one_causal_grouped_query_attention_op(fake_world):
    folded, final = graphs_after(Causal(causal_lm("llama-eager")), batch(), "fold_eager_attention", "fold_repeated_kv")
    assert len(code_lines(folded, "scaled_dot_product_attention(")) == 2 and not code_lines(folded, "softmax("), folded
    calls = code_lines(final, "scaled_dot_product_attention(")
    assert len(calls) == 2 and all("is_causal = True" in c and "enable_gqa = True" in c for c in calls), calls


def test_eager_attention_whose_weights_are_returned_stays_written_out(fake_world):
    """As ``output_attentions=True`` returns them: the weights are an output, so the formula stays."""
    torch.manual_seed(0)
    (folded,) = graphs_after(ReturnsWeights(), (torch.randn(2, 8, 16),), "fold_eager_attention", policy="dp",
                             plan_ngpus=1)
    assert not code_lines(folded, "scaled_dot_product_attention(") and len(code_lines(folded, "softmax(")) == 1, folded


def test_eager_attention_with_dropout_while_training_stays_written_out(fake_world):
    """The fused op would draw other dropout masks than the eager formula does."""
    (folded,) = graphs_after(Causal(causal_lm("llama-eager", attention_dropout=0.1)), batch(), "fold_eager_attention")
    assert not code_lines(folded, "scaled_dot_product_attention("), folded

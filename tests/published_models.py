"""The models of published training runs, written out (a few dozen lines each) so that those runs can be
planned offline with the model they ran (``docs/device-profiles.md``):

- ``TitanLlama``: torchtitan's Llama 3 (``torchtitan/models/llama/model.py`` at the commit its published runs
  name): RMSNorm in fp32 cast back with ``type_as``, rotary embeddings on complex numbers, grouped-query
  attention by repeating K/V, ``F.scaled_dot_product_attention(is_causal=True)``, SwiGLU, an untied output
  head, the loss in fp32.
- ``MPT``: MosaicML's MPT (llm-foundry's ``mpt-7b.yaml``): LayerNorm without biases, one fused QKV projection,
  causal flash attention (its ALiBi bias costs no FLOPs of its own: left out), a GELU MLP of 4x, the head
  tied to the embedding, the loss in fp32."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class TitanLlamaConfig:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    ffn_dim: int = 14336          # ffn_dim_multiplier 1.3, multiple_of 1024
    rope_theta: float = 500000.0
    seq_len: int = 8192


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        return normed.type_as(x) * self.weight


def rotary(freqs, x):
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs[None, :, None, :]).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: TitanLlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, freqs):
        b, s, _ = x.shape
        q = rotary(freqs, self.wq(x).view(b, s, self.heads, self.head_dim))
        k = rotary(freqs, self.wk(x).view(b, s, self.kv_heads, self.head_dim))
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        repeats = self.heads // self.kv_heads
        k = k[:, :, :, None, :].expand(b, s, self.kv_heads, repeats, self.head_dim).reshape(b, s, self.heads, -1)
        v = v[:, :, :, None, :].expand(b, s, self.kv_heads, repeats, self.head_dim).reshape(b, s, self.heads, -1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: TitanLlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: TitanLlamaConfig):
        super().__init__()
        self.attention, self.feed_forward = Attention(cfg), FeedForward(cfg)
        self.attention_norm, self.ffn_norm = RMSNorm(cfg.dim), RMSNorm(cfg.dim)

    def forward(self, x, freqs):
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    """The model and its loss: ``forward(tokens, labels)`` returns the mean cross entropy."""

    def __init__(self, cfg: TitanLlamaConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        head_dim = cfg.dim // cfg.n_heads
        inverse = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(cfg.seq_len).float(), inverse)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, tokens, labels):
        h = self.tok_embeddings(tokens)
        freqs = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, freqs)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


@dataclasses.dataclass(frozen=True)
class MPTConfig:
    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    vocab_size: int = 50368
    expansion_ratio: int = 4


class MPTBlock(nn.Module):
    def __init__(self, cfg: MPTConfig):
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.n_heads
        self.norm_1 = nn.LayerNorm(d, bias=False)
        self.Wqkv = nn.Linear(d, 3 * d, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)
        self.norm_2 = nn.LayerNorm(d, bias=False)
        self.up_proj = nn.Linear(d, cfg.expansion_ratio * d, bias=False)
        self.down_proj = nn.Linear(cfg.expansion_ratio * d, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.Wqkv(self.norm_1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        h = x + self.out_proj(attended)
        return h + self.down_proj(F.gelu(self.up_proj(self.norm_2(h))))


class MPT(nn.Module):
    """The model and its loss: ``forward(tokens, labels)`` returns the mean cross entropy."""

    def __init__(self, cfg: MPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(MPTBlock(cfg) for _ in range(cfg.n_layers))
        self.norm_f = nn.LayerNorm(cfg.d_model, bias=False)

    def forward(self, tokens, labels):
        h = self.wte(tokens)
        for block in self.blocks:
            h = block(h)
        logits = F.linear(self.norm_f(h), self.wte.weight)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

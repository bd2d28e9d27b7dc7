"""Small models the tests train: an MLP and a GPT (tied LM head)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32, layers: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(layers))
        self.head = nn.Linear(dim, 1)

    def forward(self, x, y):
        for block in self.blocks:
            x = x + block(x)
        return F.mse_loss(self.head(x).squeeze(-1), y)


@dataclasses.dataclass
class GPTConfig:
    vocab: int = 64
    seq: int = 16
    d_model: int = 32
    heads: int = 4
    layers: int = 2
    fused_qkv: bool = False     # one c_attn projection split into q, k, v (nanoGPT, GPT-2)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.fused = cfg.fused_qkv
        if self.fused:
            self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
            self.proj = nn.Linear(cfg.d_model, cfg.d_model)
            return
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        # no key bias: its gradient is exactly zero (softmax ignores a shift shared by all keys), so
        # Adam would turn rounding noise into updates and no two runs could agree on it
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):
        B, T, C = x.shape
        projections = self.c_attn(x).split(C, dim=2) if self.fused else (self.q(x), self.k(x), self.v(x))
        # -1 rather than C // heads: the same code also runs head-split by hand (the DTensor peer)
        q, k, v = (p.view(B, T, self.heads, -1).transpose(1, 2) for p in projections)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, param in self.named_parameters():   # GPT-2's initialisation keeps logits sane
            if name.endswith("weight") and param.dim() == 2:
                nn.init.normal_(param, std=0.02)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class LayerStack(nn.Module):
    """L transformer layers on an activation input: for counting tensor-parallel communication."""

    def __init__(self, cfg: GPTConfig, block: type[nn.Module] | None = None):
        super().__init__()
        self.blocks = nn.ModuleList((block or Block)(cfg) for _ in range(cfg.layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


class LlamaLM(nn.Module):
    """transformers' LlamaForCausalLM (rotary attention with grouped-query heads, SwiGLU, RMSNorm) called as
    GPT is, ``(idx, tgt) -> loss``, at GPTConfig's sizes: half as many key/value heads as query heads, an
    intermediate size of 8/3 d rounded to 64. Its repeated block is ``LlamaDecoderLayer``."""

    BLOCK = "LlamaDecoderLayer"

    def __init__(self, cfg: GPTConfig):
        import transformers

        super().__init__()
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=cfg.vocab, hidden_size=cfg.d_model, intermediate_size=64 * round(8 * cfg.d_model / 3 / 64),
            num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=max(cfg.heads // 2, 1),
            max_position_embeddings=cfg.seq, use_cache=False))

    def forward(self, idx, tgt):
        logits = self.model(input_ids=idx).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))


def causal_lm(name: str, vocab: int = 128, **config) -> nn.Module:
    """A small transformers causal LM, ``model(input_ids=, labels=)``: "gpt2" (learned positions, fused
    ``c_attn``), "qwen3" (grouped-query heads, q/k norms), "llama" and "llama-eager" (its attention written out
    as matmuls: ``attn_implementation="eager"``); 2 layers, 4 heads of 8, no dropout, ``use_cache=False``."""
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=4, use_cache=False, attn_pdrop=0.0,
            resid_pdrop=0.0, embd_pdrop=0.0, **config))
    if name == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, use_cache=False, **config))
    attention = {"llama": "sdpa", "llama-eager": "eager"}[name]
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False, attn_implementation=attention, **config))


def gpt_batch(cfg: GPTConfig, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g)
    targets = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g)
    return idx, targets


def mlp_batch(batch: int, seed: int, dim: int = 16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, dim, generator=g), torch.randn(batch, generator=g)




class Conv1D(nn.Module):
    """Hugging Face GPT-2's linear layer: weight stored [in, out], applied with addmm."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.out_features = out_features
        self.weight = nn.Parameter(torch.randn(in_features, out_features) * 0.02)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.out_features,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class GPT2StyleBlock(nn.Module):
    """A transformer layer written as GPT-2 is: fused c_attn, Conv1D everywhere, head split by view."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads, C = cfg.heads, cfg.d_model
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.c_proj = Conv1D(3 * C, C), Conv1D(C, C)
        self.c_fc, self.mlp_proj = Conv1D(4 * C, C), Conv1D(C, 4 * C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class BatchNormMLP(nn.Module):
    """Buffers updated in place during the forward (BatchNorm's running statistics)."""

    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        # no bias before the norm: BatchNorm removes it, so its gradient is zero and Adam moves it on noise
        self.up, self.norm = nn.Linear(dim, hidden, bias=False), nn.BatchNorm1d(hidden)
        self.down = nn.Linear(hidden, 1)

    def forward(self, x, y):
        return F.mse_loss(self.down(torch.relu(self.norm(self.up(x)))).squeeze(-1), y)

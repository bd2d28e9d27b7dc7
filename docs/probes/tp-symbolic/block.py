"""A tiny Megatron-style block written on DTensors, as dynshard's per-rank program runs it: local tensors in,
DTensor.from_local inside, whole (local) loss out."""
import contextlib
import torch, torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

D, H, V = 16, 4, 32     # dim, heads, vocab

PLACE = dict(emb=Replicate(), wq=Shard(0), bq=Shard(0), wk=Shard(0), bk=Shard(0), wv=Shard(0), bv=Shard(0),
             wo=Shard(1), bo=Replicate(), ln_w=Replicate(), ln_b=Replicate(), ln2_w=Replicate(), ln2_b=Replicate(),
             w1=Shard(0), b1=Shard(0), w2=Shard(1), b2=Replicate(), head=Shard(0))
SHAPES = dict(emb=(V, D), wq=(D, D), bq=(D,), wk=(D, D), bk=(D,), wv=(D, D), bv=(D,), wo=(D, D), bo=(D,),
              ln_w=(D,), ln_b=(D,), ln2_w=(D,), ln2_b=(D,), w1=(4 * D, D), b1=(4 * D,), w2=(D, 4 * D), b2=(D,),
              head=(V, D))
NAMES = list(PLACE)


def full_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*SHAPES[k], generator=g) * 0.2 for k in NAMES}


def local_params(full, rank, world):
    return {k: (v.chunk(world, PLACE[k].dim)[rank].contiguous() if isinstance(PLACE[k], Shard) else v.clone())
            for k, v in full.items()}


def attention(q, k, v, math_path):
    if not math_path:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    from torch.nn.attention import sdpa_kernel, SDPBackend
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def forward(mesh, tokens, labels, *plist, math_path=True, vocab_loss=True, explicit_softmax=True):
    """tokens, labels: [B, S] int64, replicated; plist: this rank's shards in NAMES order."""
    P = {k: DTensor.from_local(v, mesh, [PLACE[k]], run_check=False) for k, v in zip(NAMES, plist)}
    tok = DTensor.from_local(tokens, mesh, [Replicate()], run_check=False)
    B, S = tokens.shape
    x = F.embedding(tok, P["emb"])                                         # [B, S, D] R
    h = F.layer_norm(x, (D,), P["ln_w"], P["ln_b"])
    q = F.linear(h, P["wq"], P["bq"]).view(B, S, H, D // H).transpose(1, 2)   # [B, H, S, hd] Shard(1)
    k = F.linear(h, P["wk"], P["bk"]).view(B, S, H, D // H).transpose(1, 2)
    v = F.linear(h, P["wv"], P["bv"]).view(B, S, H, D // H).transpose(1, 2)
    a = attention(q, k, v, math_path)
    if explicit_softmax:                                                   # an explicit score softmax too
        s = torch.softmax(q @ k.transpose(-2, -1) * (D // H) ** -0.5, dim=-1)
        a = a + s @ v
    a = a.transpose(1, 2).reshape(B, S, D)                                 # Shard(2)
    o = F.linear(a, P["wo"])                                               # Partial
    o = o.redistribute(mesh, [Replicate()]) + P["bo"]                      # all-reduce, then bias
    x = x + o
    h = F.layer_norm(x, (D,), P["ln2_w"], P["ln2_b"])
    m = F.linear(F.gelu(F.linear(h, P["w1"], P["b1"])), P["w2"])           # Partial
    x = x + m.redistribute(mesh, [Replicate()]) + P["b2"]
    logits = F.linear(x, P["head"])                                        # [B, S, V] Shard(2): vocab split
    lab = DTensor.from_local(labels, mesh, [Replicate()], run_check=False)
    if vocab_loss:
        from torch.distributed.tensor.parallel import loss_parallel
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), lab.flatten())
    else:
        loss = F.cross_entropy(logits.redistribute(mesh, [Replicate()]).flatten(0, 1), lab.flatten())
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def reference(tokens, labels, full, math_path=True, explicit_softmax=True):
    """The same on whole tensors, one process."""
    P = full
    B, S = tokens.shape
    x = F.embedding(tokens, P["emb"])
    h = F.layer_norm(x, (D,), P["ln_w"], P["ln_b"])
    q = F.linear(h, P["wq"], P["bq"]).view(B, S, H, D // H).transpose(1, 2)
    k = F.linear(h, P["wk"], P["bk"]).view(B, S, H, D // H).transpose(1, 2)
    v = F.linear(h, P["wv"], P["bv"]).view(B, S, H, D // H).transpose(1, 2)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if explicit_softmax:
        s = torch.softmax(q @ k.transpose(-2, -1) * (D // H) ** -0.5, dim=-1)
        a = a + s @ v
    a = a.transpose(1, 2).reshape(B, S, D)
    x = x + F.linear(a, P["wo"]) + P["bo"]
    h = F.layer_norm(x, (D,), P["ln2_w"], P["ln2_b"])
    x = x + F.linear(F.gelu(F.linear(h, P["w1"], P["b1"])), P["w2"]) + P["b2"]
    return F.cross_entropy(F.linear(x, P["head"]).flatten(0, 1), labels.flatten())

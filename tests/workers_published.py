"""Published training runs planned offline (``docs/device-profiles.md``): each run's job as dynshard expresses
it, the figures the run published, and what dynshard predicts."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

import dynshard
from published_models import MPT, MPTConfig, TitanLlama, TitanLlamaConfig

MIXED = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
EVERY_OTHER_LAYER = ",".join(f"layers.{i}" for i in range(0, 32, 2))


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    model: str              # "llama3-8b" (torchtitan's) or "mpt-7b"
    world: int
    batch: int              # rows per rank per micro-batch
    seq: int
    profile: str
    recompute: str          # what dynshard recomputes: the closest it expresses to the run's
    tokens_per_s: float     # published, per GPU
    peak_gib: float | None  # published
    memory_gib: int         # the GPU's
    notes: str


RUNS = {
    "torchtitan-8b-8xh100": PublishedRun(
        "Llama 3.1 8B, 8 H100, FSDP, batch 2, seq 8192, torch.compile",
        "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (commit 9dec370)",
        "llama3-8b", 8, 2, 8192, "h100-sxm", "TransformerBlock", 6667, 77.0, 96,
        "the run's H100s: 96 GB HBM2e, 2.4 TB/s, 500 W; its recompute: op-level selective AC (every other "
        "matmul and the elementwise ops), here every block (dynshard recomputes whole modules)"),
    "torchtitan-8b-64xa100": PublishedRun(
        "Llama 3 8B, 64 A100 80 GB, FSDP2, batch 1, seq 8192, AC every 2nd layer",
        "torchtitan docs/performance.md (2024-12 table, selective layer)",
        "llama3-8b", 64, 1, 8192, "a100-80gb", EVERY_OTHER_LAYER, 2904, None, 80,
        "the same recompute; FSDP2 prefetches the next block's gather, dynshard's program does not yet"),
    "mpt-7b-8xa100": PublishedRun(
        "MPT-7B, 8 A100 80 GB, FSDP, micro-batch 8, seq 8192, full AC",
        "llm-foundry scripts/train/benchmarking/README.md (commit 8c8dd48)",
        "mpt-7b", 8, 8, 8192, "a100-80gb", "MPTBlock", 3206, None, 80,
        "SUSTAINED was fitted on this run and the next"),
    "mpt-7b-8xh100": PublishedRun(
        "MPT-7B, 8 H100 80 GB, FSDP, micro-batch 8, seq 8192, full AC",
        "llm-foundry scripts/train/benchmarking/README.md (commit 8c8dd48)",
        "mpt-7b", 8, 8, 8192, "h100-sxm", "MPTBlock", 6935, None, 80,
        "SUSTAINED was fitted on this run and the previous"),
}


def _job(run: PublishedRun):
    with torch.device("meta"):
        model = TitanLlama(TitanLlamaConfig()) if run.model == "llama3-8b" else MPT(MPTConfig())
    tokens = torch.zeros(run.batch, run.seq, dtype=torch.long, device="meta")
    return model, (tokens, tokens.clone())


def predicted_run(rank: int, world: int, key: str, autodist: bool = False) -> dict:
    """What dynshard predicts for the published run ``key`` as it ran (ZeRO-3 and its recompute), or, with
    ``autodist``, for autodist's choice given the run's GPU memory: tokens/s per GPU, the step's parts, the peak."""
    run = RUNS[key]
    model, args = _job(run)
    if autodist:
        config = dynshard.Config(policy="autodist", mixed_precision=MIXED,
                                 pas_config={"mem_constraint": run.memory_gib, "device_profile": run.profile})
        plan, = dynshard.plan(model, args, config, world_size=run.world)
    else:
        config = dynshard.Config(policy="dp", use_zero=3, mixed_precision=MIXED, recompute_modules=run.recompute)
        plan, = dynshard.plan(model, args, config, world_size=run.world, device_profile=run.profile)
    cost = plan.predicted.cost
    tokens = run.batch * run.seq
    return {"tokens_per_s": tokens / cost.step_seconds, "compute_tokens_per_s": tokens / cost.compute_seconds,
            "step": cost.step_seconds, "compute": cost.compute_seconds, "communication": cost.communication_seconds,
            "peak_gib": cost.bytes_per_rank.peak / 2 ** 30, "zero": plan.zero.level, "recomputed": len(plan.recompute)}


class Attention(torch.nn.Module):
    """One attention layer whose SDPA takes a mask: traced on a CPU, the math path (scores saved)."""

    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x, mask):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, d)).sum()


def attention_cost(rank: int, world: int, profile, seq: int):
    """The predicted cost of ``Attention`` over 2 ranks (dp) at sequence ``seq`` with ``profile``."""
    x, mask = torch.randn(2, seq, 64), torch.ones(seq, seq, dtype=torch.bool).tril()
    plan, = dynshard.plan(Attention(), (x, mask), dynshard.Config(policy="dp"), world_size=2, device_profile=profile)
    return plan.predicted.cost


def mixed_precision_zero3_plan(rank: int, world: int) -> str:
    from models import GPT, GPTConfig

    cfg = GPTConfig()
    x = torch.randint(0, cfg.vocab, (4, cfg.seq))
    plan, = dynshard.plan(GPT(cfg), (x, x.clone()), dynshard.Config(use_zero=3, mixed_precision=MIXED), world_size=2)
    return plan.to_json()

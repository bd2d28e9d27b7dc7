"""What each rank runs in the regional compilation tests (module level, so spawned processes can import it)."""

from __future__ import annotations

import collections
import copy

import torch

import dynshard
from models import GPT, GPTConfig, gpt_batch

BATCH = 4


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().clone()


def one_step(model: GPT, cfg: GPTConfig, rank: int, world: int, split_batch: bool, batch: int = BATCH,
             **options) -> dict:
    """Forward and backward of one batch; the gradients this rank holds and what explain reports."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(**options))
    idx, targets = gpt_batch(cfg, batch, seed=1)
    if split_batch:
        idx, targets = idx.chunk(world)[rank], targets.chunk(world)[rank]
    loss = compiled(idx, targets)
    loss.backward()
    report = dynshard.explain(compiled)
    (program,) = report.programs
    return {
        "loss": loss.item(),
        "grads": {name: _local(p.grad) for name, p in model.named_parameters()},
        "collectives": collections.Counter((c.phase, c.kind, c.group, c.bytes) for c in program.collectives),
        "in_blocks": collections.Counter((c.phase, c.kind, c.group) for c in program.collectives if c.region),
        "in_program": collections.Counter((c.phase, c.kind, c.group) for c in program.collectives if not c.region),
        "block_parameters": sum(1 for name, _ in model.named_parameters() if name.startswith("blocks.")),
        "block_weights": sum(1 for name, _ in model.named_parameters()       # (read by a backward formula)
                             if name.startswith("blocks.") and not name.endswith(".bias")),
        "compiled_once": program.compiled_once,
        "saved": (program.saved_bytes, program.saved_count),
        "explain": str(report),
    }


def regional_against_unrolled(rank: int, world: int, options: dict) -> dict:
    """The same step compiled with repeated blocks outlined and unrolled, from the same weights."""
    torch.manual_seed(0)
    cfg = GPTConfig(layers=3)
    model = GPT(cfg)
    split = options.get("policy", "dp") == "dp"
    return {regional: one_step(copy.deepcopy(model), cfg, rank, world, split, regional_compile=regional, **options)
            for regional in (True, False)}


def inductor_against_eager(rank: int, world: int) -> dict:
    """Data parallel, Inductor, blocks outlined: the gradients against one process in eager mode (the
    torch 2.13 bugs around outlined blocks show up only under Inductor, as wrong gradients; at these
    shapes, 4 samples per rank, the tied embedding's gradient was off by 13% before the workarounds)."""
    torch.manual_seed(0)
    cfg = GPTConfig(layers=2)
    model = GPT(cfg)
    reference = copy.deepcopy(model)
    result = one_step(model, cfg, rank, world, True, batch=2 * BATCH, compiler="inductor")
    reference(*gpt_batch(cfg, 2 * BATCH, seed=1)).backward()
    result["ref_grads"] = {name: p.grad for name, p in reference.named_parameters()}
    return result

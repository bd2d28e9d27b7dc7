"""What each rank runs in the recompute tests (module level, so spawned processes can import it)."""

from __future__ import annotations

import collections
import copy
import re

import torch
from torch.utils.checkpoint import checkpoint

import dynshard
from dynshard.backend import job_plans
from models import GPT, Block, GPTConfig, gpt_batch

LR = 1e-3
STEPS = 2
BATCH = 4
_MATMUL = re.compile(r"torch\.ops\.aten\.(mm|addmm|bmm)\.default\(")


class CheckpointedBlock(Block):
    """The test GPT's layer, checkpointed by the user (torch.utils.checkpoint, non-reentrant)."""

    def forward(self, x):
        return checkpoint(self._body, x, use_reentrant=False)

    def _body(self, x):
        return Block.forward(self, x)


def build(user_checkpoint: bool = False) -> tuple[GPT, GPTConfig]:
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    if user_checkpoint:
        for block in model.blocks:
            block.__class__ = CheckpointedBlock
    return model, cfg


def train(recompute: str = "", user_checkpoint: bool = False, **options) -> dict:
    """A few AdamW steps with dynshard and, on the same batches, single-process eager."""
    torch._dynamo.reset()
    model, cfg = build(user_checkpoint)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        recompute_modules=recompute, compiler="aot_eager", **options))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    losses, ref_losses = [], []
    for step in range(STEPS):
        batch = gpt_batch(cfg, BATCH, step)
        loss = compiled(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        ref_loss = reference(*batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    report = dynshard.explain(compiled)
    backward = job_plans().get(report.programs[0].key).program.graphs["backward"]
    return {
        "losses": losses, "ref_losses": ref_losses,
        "saved_bytes": report.saved_bytes(), "programs": len(report.programs),
        "backward_matmuls": matmuls_run(backward),
        "collectives": collections.Counter((c.phase, c.kind, c.group) for c in report.collectives()),
        "in_blocks": collections.Counter((c.phase, c.kind, c.group) for c in report.collectives() if c.region),
        "explain": str(report),
    }


def matmuls_run(code: str) -> int:
    """Matmuls a program's code runs: an outlined block's code (after ``# <block>, called N times``,
    see backend/compile.py's program_code) counts once per call."""
    sections = re.split(r"\n# \S+, called (\d+) times", code)
    total = len(_MATMUL.findall(sections[0]))
    for calls, body in zip(sections[1::2], sections[2::2]):
        total += int(calls) * len(_MATMUL.findall(body))
    return total


def unknown_name_error() -> str:
    torch._dynamo.reset()
    model, cfg = build()
    compiled = torch.compile(model, backend="dynshard",
                             options=dynshard.Config(recompute_modules="Block,Blok", compiler="aot_eager"))
    try:
        compiled(*gpt_batch(cfg, BATCH, 0))
    except Exception as error:      # Dynamo wraps backend errors; the message is what the user reads
        return f"{type(error).__name__}: {error}"
    return "no error"


def single_process_scenarios(rank: int, world: int) -> dict:
    return {
        "plain": train(""),
        "block": train("Block"),
        "unknown": unknown_name_error(),
    }


def tensor_parallel_scenarios(rank: int, world: int) -> dict:
    return {
        # outlined as the recomputed program is: aot_eager partitions an outlined block with the min-cut
        # partitioner (aot_autograd's choice for invoke_subgraph), which alone saves 44% less than unrolled
        "plain": train("", policy="tp", plan_ngpus=2),
        "block": train("Block", policy="tp", plan_ngpus=2),
        "user": train("", user_checkpoint=True, policy="tp", plan_ngpus=2),
    }

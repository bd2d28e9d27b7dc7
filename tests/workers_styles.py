"""What each rank runs in the declarative tensor-parallel test, and the plans it uses (module level, so
spawned processes can import them)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

import dynshard
from models import GPT, GPTConfig, gpt_batch


def megatron_plan() -> dict:
    """torchtitan's plan for the test GPT: q, k, v and fc1 column-split, proj and fc2 row-split, the
    token embedding split along the vocabulary (the LM head is tied to it)."""
    return {
        "wte": RowwiseParallel(),
        "blocks.*.attn.q": ColwiseParallel(),
        "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(),
        "blocks.*.fc1": ColwiseParallel(),
        "blocks.*.fc2": RowwiseParallel(),
        "lm_head": ColwiseParallel(),
    }


def sequence_parallel_plan() -> dict:
    """The Megatron plan with sequence parallelism, as torchtitan writes it: norms on sequence shards,
    row-split outputs reduce-scattered, column-split inputs gathered."""
    return {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "blocks.*.ln1": SequenceParallel(),
        "blocks.*.attn.q": ColwiseParallel(input_layouts=Shard(1)),
        "blocks.*.attn.k": ColwiseParallel(input_layouts=Shard(1)),
        "blocks.*.attn.v": ColwiseParallel(input_layouts=Shard(1)),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "blocks.*.ln2": SequenceParallel(),
        "blocks.*.fc1": ColwiseParallel(input_layouts=Shard(1)),
        "blocks.*.fc2": RowwiseParallel(output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    }


def train_with_styles(rank: int, world: int, steps: int = 5, batch: int = 4, lr: float = 0.1) -> dict:
    """Train the GPT under the declarative sequence-parallel plan and, on the same batches, one eager
    process; SGD with momentum on both."""
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    reference = copy.deepcopy(model)
    initial = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    policy = dynshard.tensor_parallel(sequence_parallel_plan())
    compiled = torch.compile(model, backend="dynshard",
                             options=dynshard.Config(policy=policy, plan_ngpus=world, compiler="aot_eager"))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr, momentum=0.9)
    losses, ref_losses = [], []
    for step in range(steps):
        idx, targets = gpt_batch(cfg, batch, step)
        loss = compiled(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)           # every rank of the unit holds the same loss
        losses.append(mean.item() / world)
        ref_loss = reference(idx, targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    report = dynshard.explain(compiled)
    return {
        "losses": losses, "ref_losses": ref_losses,
        "params": dynshard.collect_state_dict(compiled),
        "ref_params": {k: v.detach() for k, v in reference.state_dict().items()},
        "moved": max((v - initial[k]).abs().max().item() for k, v in reference.state_dict().items()),
        "parallel_dims": {name: dynshard.get_parallel_dim(p) for name, p in model.named_parameters()},
        "collectives": [(c.phase, c.kind, c.group) for c in report.collectives()],
        "explain": str(report),
    }

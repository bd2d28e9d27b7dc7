"""What each rank runs in the multi-rank tests (module level, so spawned processes can import it)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import dynshard
from models import GPT, MLP, GPTConfig, gpt_batch, mlp_batch

LR = 1e-3


def build(name: str) -> tuple[torch.nn.Module, callable]:
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(), lambda batch, seed: mlp_batch(batch, seed)
    cfg = GPTConfig()
    return GPT(cfg), lambda batch, seed: gpt_batch(cfg, batch, seed)


def _unit_rows(tensors, dp_rank: int, batch: int):
    return tuple(t[dp_rank * batch:(dp_rank + 1) * batch] for t in tensors)


def train_parity(rank: int, world: int, model_name: str, policy: str, plan_ngpus: int, compiler: str,
                 steps: int = 5, batch: int = 4) -> dict:
    """Train with dynshard and, on the same global batch, single-process eager; report both."""
    model, make_batch = build(model_name)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard",
                             options=dynshard.Config(policy=policy, plan_ngpus=plan_ngpus, compiler=compiler))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    dp_rank, dp_size = dynshard.data_parallel_rank(plan_ngpus)
    losses, ref_losses = [], []
    for step in range(steps):
        global_batch = make_batch(batch * dp_size, step)
        loss = compiled(*_unit_rows(global_batch, dp_rank, batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)           # ranks of a unit hold the same loss; units hold their batch's
        losses.append(mean.item() / world)
        ref_loss = reference(*global_batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    report = dynshard.explain(compiled)
    return {
        "losses": losses, "ref_losses": ref_losses,
        "params": dynshard.collect_state_dict(compiled),
        "ref_params": {k: v.detach() for k, v in reference.state_dict().items()},
        "local_numel": {name: p.numel() for name, p in model.named_parameters()},
        "parallel_dims": {name: dynshard.get_parallel_dim(p) for name, p in model.named_parameters()},
        "collectives": [(c.phase, c.kind, c.group) for c in report.collectives()],
        "programs": len(report.programs),
        "explain": str(report),
    }

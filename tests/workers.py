"""What each rank runs in the multi-rank tests (module level, so spawned processes can import it)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import dynshard
from models import GPT, MLP, BatchNormMLP, GPTConfig, gpt_batch, mlp_batch

LR = 1e-3


def build(name: str) -> tuple[torch.nn.Module, callable]:
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(), lambda batch, seed: mlp_batch(batch, seed)
    if name == "mlp_bn":
        return BatchNormMLP(), lambda batch, seed: mlp_batch(batch, seed)
    cfg = GPTConfig(fused_qkv=name == "gpt_fused")
    return GPT(cfg), lambda batch, seed: gpt_batch(cfg, batch, seed)


def _unit_rows(tensors, dp_rank: int, batch: int):
    return tuple(t[dp_rank * batch:(dp_rank + 1) * batch] for t in tensors)


def train_parity(rank: int, world: int, model_name: str, policy: str, plan_ngpus: int, compiler: str,
                 steps: int = 5, batch: int = 4, options: dict | None = None) -> dict:
    """Train with dynshard and, on the same global batch, single-process eager; report both."""
    model, make_batch = build(model_name)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy=policy, plan_ngpus=plan_ngpus, compiler=compiler, **(options or {})))
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
    full = dynshard.collect_state_dict(compiled)
    relocated = dynshard.relocate_state_dict(compiled, full)
    return {
        "losses": losses, "ref_losses": ref_losses,
        "params": full,
        "relocated_equals_local": all(torch.equal(relocated[k], v) for k, v in model.state_dict().items()),
        "ref_params": {k: v.detach() for k, v in reference.state_dict().items()},
        "local_numel": {name: p.numel() for name, p in model.named_parameters()},
        "parallel_dims": {name: dynshard.get_parallel_dim(p) for name, p in model.named_parameters()},
        "collectives": [(c.phase, c.kind, c.group) for c in report.collectives()],
        "programs": len(report.programs),
        "explain": str(report),
        "plans": [plan.to_json() for plan in report.plans],
    }


def train_beside(compiled, reference, opts, batches) -> dict:
    """Train ``compiled`` and its one-process ``reference`` on the same ``batches`` (each a tuple of call
    arguments) with ``opts`` (theirs, in that order): the parity report of :mod:`parity`."""
    losses, ref_losses = [], []
    for batch in batches:
        loss, ref_loss = compiled(*batch), reference(*batch)
        loss.backward()
        ref_loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    return {"losses": losses, "ref_losses": ref_losses, "params": dynshard.collect_state_dict(compiled),
            "ref_params": {k: v.detach().clone() for k, v in reference.state_dict().items()}}


class BrokenMLP(torch.nn.Module):
    """Two halves with a graph break between them: two compiled programs share one training step."""

    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.up1, self.down1 = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)
        self.up2, self.down2 = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)

    def forward(self, x, y):
        x = x + self.down1(torch.relu(self.up1(x)))
        torch._dynamo.graph_break()
        x = x + self.down2(torch.relu(self.up2(x)))
        return torch.nn.functional.mse_loss(x.sum(-1), y)


def runtime_scenarios(rank: int, world: int) -> dict:
    """The runtime behaviours of one tp job (plan 2): recompiles, inference, batch sizes, state helpers."""
    from torch._dynamo.utils import counters

    out: dict = {}
    model, make_batch = build("gpt")
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard",
                             options=dynshard.Config(policy="tp", plan_ngpus=2, compiler="aot_eager"))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    for step in range(3):
        for net, optimizer in ((compiled, opt), (reference, ref_opt)):
            net(*make_batch(4, step)).backward()
            optimizer.step()
            optimizer.zero_grad()
    report = dynshard.explain(compiled)
    out["training_programs"] = len(report.programs)
    out["cache_hits"] = [p.cache_hits for p in report.programs]
    out["dynamo_graphs"] = counters["stats"]["unique_graphs"]
    out["tied"] = model.lm_head.weight is model.wte.weight
    out["parallel_dims"] = {name: dynshard.get_parallel_dim(p) for name, p in model.named_parameters()}

    idx, targets = make_batch(3, 10)      # a new batch size: a new (static) plan, same placements
    out["new_batch_loss"] = (compiled(idx, targets).item(), reference(idx, targets).item())

    model.eval()
    reference.eval()
    with torch.no_grad():
        out["inference_error"] = (compiled(idx) - reference(idx)).abs().max().item()
        out["inference_requires_grad"] = compiled(idx).requires_grad

    full = dynshard.collect_state_dict(compiled)
    local = dynshard.relocate_state_dict(compiled, full)
    out["relocated_shapes_match"] = all(local[k].shape == v.shape for k, v in model.state_dict().items())
    model.load_state_dict(local)
    again = dynshard.collect_state_dict(model)
    out["round_trip_error"] = max((again[k] - v).abs().max().item() for k, v in full.items())
    out["collected_error"] = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    out["keys_match"] = list(full) == list(reference.state_dict())

    torch.manual_seed(0)
    broken = BrokenMLP()
    broken_ref = copy.deepcopy(broken)
    broken_compiled = torch.compile(broken, backend="dynshard",
                                    options=dynshard.Config(policy="tp", plan_ngpus=2, compiler="aot_eager"))
    opt = torch.optim.AdamW(broken.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(broken_ref.parameters(), lr=LR)
    losses = []
    for step in range(3):
        x, y = mlp_batch(4, step)
        pair = []
        for net, optimizer in ((broken_compiled, opt), (broken_ref, ref_opt)):
            loss = net(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            pair.append(loss.item())
        losses.append(pair)
    out["graph_break_losses"] = losses
    full = dynshard.collect_state_dict(broken_compiled)
    out["graph_break_param_error"] = max((full[k] - v).abs().max().item() for k, v in broken_ref.state_dict().items())
    out["graph_break_programs"] = len(dynshard.explain(broken_compiled).programs)
    out["graph_break_sharded"] = sorted(n for n, p in broken.named_parameters()
                                        if dynshard.get_parallel_dim(p) is not None)
    return out


def fail_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise RuntimeError("rank 1 could not start")
    return rank

"""What each rank runs in tests/test_parallel_attributes.py (module level, so spawned processes can import it)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import dynshard
from dynshard.runtime import sharding
from dynshard.runtime.parallel_attributes import get_order_type

LR, MOMENTUM = 0.05, 0.9


class Block(torch.nn.Module):
    """A residual MLP with a buffer: the part of the model dynshard compiles."""

    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x))) * self.scale


class Outer(torch.nn.Module):
    """Eager layers around a Block: DDP's part of the model."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed = torch.nn.Linear(8, dim)
        self.body = Block(dim)
        self.head = torch.nn.Linear(dim, 4)
        self.gain = torch.nn.Parameter(torch.ones(4))   # a parameter of the root module

    def forward(self, x, y):
        out = self.head(self.body(torch.relu(self.embed(x)))) * self.gain
        return torch.nn.functional.mse_loss(out, y)


def _batch(rows: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 8, generator=generator), torch.randn(rows, 4, generator=generator)


def _strip(name: str) -> str:
    return name.replace("_orig_mod.", "")


def _ddp_with_dynshard_submodule(rank: int, world: int, steps: int, batch: int) -> dict:
    torch.manual_seed(0)
    model = Outer()
    reference = copy.deepcopy(model)
    model.body = torch.compile(model.body, backend="dynshard",
                               options=dynshard.Config(policy="dp", compiler="aot_eager"))
    ignored = dynshard.register_ddp_parameters_to_ignore(model)
    ddp = DistributedDataParallel(model)
    names = {id(p): name for name, p in model.named_parameters()}
    reduced_by_ddp: set[str] = set()

    def record(state, bucket):
        reduced_by_ddp.update(names[id(p)] for p in bucket.parameters())
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, record)
    try:
        dynshard.register_ddp_parameters_to_ignore(ddp)
        refused_ddp_module = False
    except TypeError:
        refused_ddp_module = True

    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    losses, ref_losses = [], []
    for step in range(steps):
        x, y = _batch(batch * world, step)
        rows = slice(rank * batch, (rank + 1) * batch)
        loss = ddp(x[rows], y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        ref_loss = reference(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    report = dynshard.explain(model.body)
    return {
        "ignored": ignored,
        "ddp_ignores": sorted(ddp.parameters_to_ignore),
        "reduced_by_ddp": sorted(reduced_by_ddp),
        "all_params": sorted(names.values()),
        "dynshard_params": sorted(n for n, p in model.named_parameters() if sharding.get_tag(p) is not None),
        "dynshard_collectives": sorted({(c.phase, c.kind, c.group) for c in report.collectives()}),
        "refused_ddp_module": refused_ddp_module,
        "losses": losses, "ref_losses": ref_losses,
        "params": {_strip(n): p.detach().clone() for n, p in model.named_parameters()},
        "ref_params": {n: p.detach().clone() for n, p in reference.named_parameters()},
    }


def _registered_dims_under_tensor_parallelism() -> dict:
    """Register (deliberately wrong) dims on parameters dynshard then shards: its tags must win, and
    sharding must be what it would have been."""
    torch.manual_seed(0)
    block = Block()
    dynshard.register_parallel_dim(block.fc1.weight, 1)
    dynshard.register_parallel_attribute(block.fc2.weight, 0, 1)
    dynshard.register_parallel_dim(block.fc2.bias, 0)
    activation = torch.zeros(4, 6)
    dynshard.register_parallel_dim(activation, -1)
    compiled = torch.compile(block, backend="dynshard",
                             options=dynshard.Config(policy="tp", plan_ngpus=2, compiler="aot_eager"))
    compiled(torch.randn(4, 16)).sum().backward()
    return {
        "tag_dims": {n: sharding.get_parallel_dim(p) for n, p in block.named_parameters()},
        "dims": {n: dynshard.get_parallel_dim(p) for n, p in block.named_parameters()},
        "local_shapes": {n: tuple(p.shape) for n, p in block.named_parameters()},
        "order_type": get_order_type(block.fc2.weight),
        "activation_dim": dynshard.get_parallel_dim(activation),
    }


def ddp_and_tensor_parallel(rank: int, world: int, steps: int = 5, batch: int = 4) -> dict:
    dist.init_process_group("gloo")      # DDP is built before dynshard's first compile would start it
    out = _ddp_with_dynshard_submodule(rank, world, steps, batch)
    out["tp"] = _registered_dims_under_tensor_parallelism()
    return out

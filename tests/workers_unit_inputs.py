"""What each rank runs in tests/test_unit_inputs.py and tests/test_buffers.py."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import dynshard
from models import BatchNormMLP, MLP, mlp_batch
from workers_pipeline import EndToEndMLP


def fed_per_rank(rank: int, world: int, policy: str, plan_ngpus: int, every: int, differ_from: int,
                 calls: int = 4) -> dict:
    """Calls the compiled model ``calls`` times; from call ``differ_from`` on each rank reads its own rows
    (a sampler over the whole world). Returns the error each rank raised, or None, and the call it came at."""
    torch.manual_seed(0)
    pipeline = policy in ("pp", "hybrid")
    model = EndToEndMLP() if pipeline else MLP()
    options = {"pas_config": {"pipeline_nmicros": 2}, "use_end2end": True} if pipeline else {}
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy=policy, plan_ngpus=plan_ngpus, compiler="aot_eager", verify_inputs_every=every, **options))
    for call in range(calls):
        x, y = mlp_batch(4, seed=100 * call + (rank if call >= differ_from else 0))
        try:
            loss = compiled({"x": x, "y": y}) if pipeline else compiled(x, y)
            loss.backward()
        except dynshard.UnitInputMismatchError as error:
            return {"error": str(error), "call": call}
    return {"error": None, "call": None}


def buffers_like_ddp(rank: int, world: int, case: dict, steps: int = 3) -> dict:
    """BatchNorm's running statistics under dynshard next to DDP(broadcast_buffers=True) on the same
    batches; each plan unit reads its own batch (its ranks the same one, DDP's ranks too)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = BatchNormMLP()
    reference = DistributedDataParallel(copy.deepcopy(model))
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(compiler="aot_eager", **case))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    unit, _ = dynshard.data_parallel_rank(case.get("plan_ngpus", 1))
    for step in range(steps):
        x, y = mlp_batch(8, seed=10 * step + unit)
        compiled(x, y).backward()
        reference(x, y).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    model.eval()
    with torch.no_grad():
        x, y = mlp_batch(8, seed=999)
        eval_loss = compiled(x, y).item()
    program = next(ref() for p in model.parameters() for ref in dynshard.runtime.sharding.get_tag(p).plans)
    sync = program.buffer_sync
    return {"buffers": {k: v for k, v in dynshard.collect_state_dict(compiled).items() if "running" in k},
            "ddp_rank0_buffers": _from_rank0({k: v.clone() for k, v in reference.module.state_dict().items()
                                              if "running" in k}),
            "eval_loss": eval_loss,
            "broadcasts": None if sync is None else sync.broadcasts, "bytes": None if sync is None else sync.bytes}


def _from_rank0(tensors: dict) -> dict:
    for value in tensors.values():
        dist.broadcast(value, src=0)
    return tensors


class EndToEndBatchNorm(torch.nn.Module):
    """Two pipeline stages (pipe_split), a BatchNorm in the second: its statistics are written there."""

    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.up, self.norm, self.down = torch.nn.Linear(dim, hidden), torch.nn.BatchNorm1d(hidden), \
            torch.nn.Linear(hidden, 1)

    def forward(self, batch):
        from torch.distributed.pipelining import pipe_split

        h = torch.relu(self.up(batch["x"]))
        pipe_split()
        return torch.nn.functional.mse_loss(self.down(self.norm(h)).squeeze(-1), batch["y"])


def pipeline_buffers(rank: int, world: int, steps: int = 2) -> dict:
    """pp over 2 ranks x 2 data-parallel units, train_step: the BatchNorm's statistics after training,
    collected whole, and what the buffer broadcast sent (its data-parallel rank read before the process
    group exists, as a sampler is set up)."""
    torch.manual_seed(0)
    model = EndToEndBatchNorm()
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy="pp", plan_ngpus=2, use_end2end=True, compiler="aot_eager",
        pas_config={"pipeline_nmicros": 2, "pipeline_scheduler": "1f1b"}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    unit, _ = dynshard.data_parallel_rank(2)
    for step in range(steps):
        samples = [dict(zip(("x", "y"), mlp_batch(4, seed=100 * step + 10 * unit + mb))) for mb in range(2)]
        dynshard.train_step(compiled, samples)
        opt.step()
        opt.zero_grad()
    plan = next(ref() for p in model.parameters() for ref in dynshard.runtime.sharding.get_tag(p).plans)
    return {"buffers": {k: v for k, v in dynshard.collect_state_dict(compiled).items() if "running" in k},
            "held": model.norm.running_mean.clone(), "unit": unit,
            "sent": plan.buffer_sync.bytes if plan.buffer_sync is not None else None}

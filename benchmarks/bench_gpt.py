"""dynshard against its peers on the GPT model, in one run: torchrun --nproc-per-node 2 benchmarks/bench_gpt.py

tensor parallel: dynshard policy "tp" (plan 2)  vs  DTensor parallelize_module (Colwise/Rowwise) + torch.compile
data parallel:   dynshard policy "dp"           vs  DDP + torch.compile
All with Inductor. Reports first-step time (compile included), median steady step time, their ratio to
the peer, bytes communicated per step (and the analytic minimum), and parameter bytes per rank.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import dynshard  # noqa: E402
from models import GPT, GPTConfig, gpt_batch  # noqa: E402


def param_bytes(model: torch.nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def layer_param_fraction(model: torch.nn.Module, full: dict[str, int]) -> float:
    """Transformer-layer parameters held per rank over their total (LayerNorms and biases included)."""
    local = {n: (p.to_local() if hasattr(p, "to_local") else p).numel() for n, p in model.named_parameters()}
    names = [n for n in full if n.startswith("blocks.")]
    return sum(local[n] for n in names) / sum(full[n] for n in names)


def time_steps(step, steps: int, warmup: int) -> tuple[float, float]:
    dist.barrier()
    start = time.perf_counter()
    step(0)
    first = time.perf_counter() - start
    for i in range(1, warmup):
        step(i)
    times = []
    for i in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step(warmup + i)
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def trainer(model, batch_for):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i):
        loss = model(*batch_for(i))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--cases", default="tp,dp", help="comma-separated subset of tp,dp")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpt_cpu.json"))
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, heads=args.heads, layers=args.layers)
    base = GPT(cfg)
    full_numel = {n: p.numel() for n, p in base.named_parameters()}
    act_bytes = args.batch * args.seq * args.d_model * 4
    rows = []

    def whole_batch(i):
        return gpt_batch(cfg, args.batch, i)

    def own_rows(i):
        idx, tgt = gpt_batch(cfg, args.batch, i)
        per = args.batch // world
        return idx[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per]

    cases = args.cases.split(",")
    if "tp" in cases:
        tensor_parallel(args, cfg, base, full_numel, act_bytes, rows, whole_batch, rank, world)
    if "dp" in cases:
        data_parallel(args, base, rows, own_rows)
    report_rows(args, rows, rank, world)
    dist.destroy_process_group()


def tensor_parallel(args, cfg, base, full_numel, act_bytes, rows, whole_batch, rank, world) -> None:
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(policy="tp", plan_ngpus=world))
    first, median = time_steps(trainer(compiled, whole_batch), args.steps, args.warmup)
    report = dynshard.explain(compiled)
    fraction = layer_param_fraction(model, full_numel)
    rows.append(dict(case="tp", system="dynshard", first_step_s=first, step_s=median,
                     comm_bytes=report.bytes(), comm_count=len(report.collectives()),
                     comm_min_bytes=4 * args.layers * act_bytes, param_bytes=param_bytes(model),
                     layer_param_fraction=fraction))
    if rank == 0:
        print(report)

    torch._dynamo.reset()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = copy.deepcopy(base)
    plan = {}
    for i in range(args.layers):
        plan.update({f"blocks.{i}.attn.{n}": ColwiseParallel() for n in ("q", "k", "v")})
        plan.update({f"blocks.{i}.attn.proj": RowwiseParallel(), f"blocks.{i}.fc1": ColwiseParallel(),
                     f"blocks.{i}.fc2": RowwiseParallel()})
        model.blocks[i].attn.heads //= world       # the rewrite DTensor TP needs: local head count
    parallelize_module(model, mesh, plan)
    with CommDebugMode() as comm:                 # eager step: the collectives DTensor issues
        model(*whole_batch(0)).backward()
    model.zero_grad(set_to_none=True)
    peer_count = comm.get_total_counts()
    compiled = torch.compile(model)
    first, median = time_steps(trainer(compiled, whole_batch), args.steps, args.warmup)
    rows.append(dict(case="tp", system="DTensor TP + compile", first_step_s=first, step_s=median,
                     comm_bytes=peer_count * act_bytes, comm_count=peer_count,
                     comm_min_bytes=4 * args.layers * act_bytes, param_bytes=param_bytes(model),
                     layer_param_fraction=layer_param_fraction(model, full_numel)))



def data_parallel(args, base, rows, own_rows) -> None:
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(policy="dp"))
    first, median = time_steps(trainer(compiled, own_rows), args.steps, args.warmup)
    report = dynshard.explain(compiled)
    grads = param_bytes(model)
    rows.append(dict(case="dp", system="dynshard", first_step_s=first, step_s=median,
                     comm_bytes=report.bytes(), comm_count=len(report.collectives()),
                     comm_min_bytes=grads, param_bytes=grads, layer_param_fraction=1.0))

    torch._dynamo.reset()
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = copy.deepcopy(base)
    ddp = DDP(model)
    compiled = torch.compile(ddp)
    first, median = time_steps(trainer(compiled, own_rows), args.steps, args.warmup)
    rows.append(dict(case="dp", system="DDP + compile", first_step_s=first, step_s=median,
                     comm_bytes=grads, comm_count=len(ddp.reducer._get_zeros_like_grad_buckets())
                     if hasattr(ddp.reducer, "_get_zeros_like_grad_buckets") else -1,
                     comm_min_bytes=grads, param_bytes=param_bytes(model), layer_param_fraction=1.0))


def report_rows(args, rows, rank, world) -> None:
    for case in sorted({r["case"] for r in rows}):
        ours, peer = [r for r in rows if r["case"] == case]
        ours["ratio_to_peer"] = ours["step_s"] / peer["step_s"]
        peer["ratio_to_peer"] = 1.0
    if rank == 0:
        header = ("case", "system", "first step s", "step s", "ratio", "comm MB/step", "collectives (traced|buckets)",
                  "min MB", "param MB/rank", "layer params/rank (of total)")
        table = [header] + [(r["case"], r["system"], f"{r['first_step_s']:.2f}", f"{r['step_s']:.3f}",
                             f"{r['ratio_to_peer']:.2f}", f"{r['comm_bytes'] / 1e6:.2f}", str(r["comm_count"]),
                             f"{r['comm_min_bytes'] / 1e6:.2f}", f"{r['param_bytes'] / 1e6:.2f}",
                             f"{r['layer_param_fraction']:.3f}") for r in rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        print()
        for row in table:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "world": world, "torch": torch.__version__, "rows": rows}, f, indent=2)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

"""Long sequences on two ranks: what each way of splitting a unit saves and costs, side by side. One job (own
torchrun, own process group) per system, then one table:

    python benchmarks/bench_context_parallel.py                          # GPT, sequence 8192, 2 ranks
    python benchmarks/bench_context_parallel.py --seq 1024 --steps 2     # a quick look

system      what runs
one         one process, the whole batch, torch.compile
dp          dynshard policy "dp": each rank one row of the batch, the whole sequence
tp          dynshard policy "tp", plan_ngpus 2: heads and MLP split, every rank the whole batch and sequence
cp          dynshard policy "tp", plan_ngpus 2, pas_config {"context_parallel": 2}: the sequence split
torch_cp    torch's own context_parallel (torch.distributed.tensor.experimental) around DDP + torch.compile:
            on a GPU only (in torch 2.13 its ring attention is registered for the CUDA flash, efficient and
            cuDNN kernels; on a CPU the job stops at the CPU flash kernel, which has no sharding strategy, and
            its row says so)

Columns: the median steady step, the first step, the bytes autograd keeps for the backward per rank (storages
saved by the forward, parameters excluded: what activations cost), the process's peak RSS, and the loss
(every system trains the same global batch from the same weights: the losses agree). Every system runs
torch.optim.SGD and the same compiler (``--compiler``, aot_eager by default: Inductor's CPU compile of a
sequence-8192 graph takes minutes of the run and changes no row's memory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from models import GPT, GPTConfig, LlamaLM, gpt_batch  # noqa: E402

SYSTEMS = {"one": 1, "dp": 2, "tp": 2, "cp": 2, "torch_cp": 2}      # system -> ranks


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2, help="global batch")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--compiler", default="aot_eager")
    parser.add_argument("--system", help="(one job: what a torchrun worker runs)")
    parser.add_argument("--out", help="(one job: where rank 0 writes its result)")
    parser.add_argument("--json", help="write every job's result here")
    return parser.parse_args()


class SavedBytes:
    """The storages autograd saves for the backward while active, parameters' excluded (bytes, per rank)."""

    def __init__(self, model: torch.nn.Module):
        self.parameters = {self._storage(p) for p in model.parameters()}
        self.saved: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)

    @staticmethod
    def _storage(t: torch.Tensor) -> int:
        local = getattr(t, "_local_tensor", t)
        return local.untyped_storage().data_ptr()

    def _pack(self, t: torch.Tensor):
        local = getattr(t, "_local_tensor", t)
        if local.device.type != "meta" and self._storage(t) not in self.parameters:
            self.saved[self._storage(t)] = local.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self.saved.clear()
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.saved.values())


def build(system: str, model: torch.nn.Module, args):
    """(the callable a step runs, the rows of the global batch this rank reads)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if system == "one":
        return torch.compile(model, backend=args.compiler), slice(None)
    if system == "torch_cp":
        return _torch_context_parallel(model, args)
    import dynshard

    options = {"dp": dict(policy="dp"), "tp": dict(policy="tp", plan_ngpus=2),
               "cp": dict(policy="tp", plan_ngpus=2, pas_config={"context_parallel": 2})}[system]
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(compiler=args.compiler, **options))
    if system == "dp" and args.batch % world:
        raise ValueError(f"dp splits the batch's rows over the ranks: a global batch of {args.batch} rows does not "
                         f"split over {world} ranks (the case context parallelism is for)")
    rows = args.batch // world if system == "dp" else args.batch
    return compiled, slice(rank * rows, (rank + 1) * rows) if system == "dp" else slice(None)


def _torch_context_parallel(model: torch.nn.Module, args):
    """torch's experimental context_parallel: the buffers named (token ids, targets) sharded along the
    sequence inside its context, SDPA dispatched to its ring attention (rotating the keys and values),
    load-balanced by its head-tail sharding; the gradients all-reduced by DDP over the two ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    ddp = DistributedDataParallel(model)
    compiled = torch.compile(ddp, backend=args.compiler)

    def run(idx, targets):
        with context_parallel(mesh, buffers=[idx, targets], buffer_seq_dims=[1, 1]):
            return compiled(idx, targets)
    return run, slice(None)


def job(args) -> None:
    system = args.system
    if SYSTEMS[system] > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, heads=args.heads, layers=args.layers)
    model = (LlamaLM if args.model == "llama" else GPT)(cfg)
    fn, rows = build(system, model, args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    saved = SavedBytes(model)

    def step(i: int, measure: bool = False) -> float:
        idx, targets = gpt_batch(cfg, args.batch, i)
        idx, targets = idx[rows].contiguous(), targets[rows].contiguous()
        with saved if measure else contextlib.nullcontext():
            loss = fn(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach()
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        if system == "dp":       # (each rank's loss is its row's: the global batch's is their mean)
            dist.all_reduce(value)
            value /= dist.get_world_size()
        return float(value)

    def barrier():
        if dist.is_initialized():
            dist.barrier()

    barrier()
    start = time.perf_counter()
    step(0)
    first = time.perf_counter() - start
    for i in range(1, args.warmup):
        step(i)
    times, loss = [], 0.0
    for i in range(args.steps):
        barrier()
        start = time.perf_counter()
        loss = step(args.warmup + i, measure=i == args.steps - 1)
        times.append(time.perf_counter() - start)
    mine = dict(step_s=statistics.median(times), first_step_s=first, saved_bytes=saved.bytes, loss=loss,
                peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(system=system, ranks=everyone, step_s=max(r["step_s"] for r in everyone),
                           first_step_s=max(r["first_step_s"] for r in everyone),
                           saved_bytes=max(r["saved_bytes"] for r in everyone),
                           peak_rss=max(r["peak_rss"] for r in everyone), loss=everyone[0]["loss"]), f)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_job(system: str, args, out: str) -> dict | str:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
             if v is not None and k not in ("systems", "system", "out", "json")]
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={SYSTEMS[system]}",
               "--standalone", __file__, f"--system={system}", f"--out={out}", *flags]
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode != 0:
        raised = [line.removeprefix("[rank0]: ") for line in done.stderr.splitlines()
                  if line.startswith("[rank0]: ") and "Error: " in line]      # (the worker's, not torchrun's)
        return (raised[-1] if raised else done.stderr.strip().splitlines()[-1])[:200]
    with open(out) as f:
        return json.load(f)


def table(results: dict[str, dict | str], args) -> str:
    one = results.get("one") if isinstance(results.get("one"), dict) else None
    lines = [f"{args.model}, d{args.d_model}, {args.heads} heads, {args.layers} layers, sequence {args.seq}, "
             f"global batch {args.batch}, {args.compiler}, SGD",
             f"{'system':<9} {'ranks':>5} {'step s':>8} {'first s':>8} {'saved/rank':>12} {'vs one':>7} "
             f"{'peak RSS':>10} {'loss':>10}"]
    for system, r in results.items():
        if isinstance(r, str):
            lines.append(f"{system:<9} {SYSTEMS[system]:>5}  did not run: {r}")
            continue
        ratio = f"{r['saved_bytes'] / one['saved_bytes']:.3f}" if one else "-"
        lines.append(f"{system:<9} {SYSTEMS[system]:>5} {r['step_s']:>8.3f} {r['first_step_s']:>8.2f} "
                     f"{r['saved_bytes']:>12,} {ratio:>7} {r['peak_rss'] / 2**20:>8.0f}MB {r['loss']:>10.6f}")
    return "\n".join(lines)


def main() -> None:
    args = arguments()
    if args.system:
        job(args)
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for system in args.systems.split(","):
            results[system] = run_job(system, args, os.path.join(tmp, f"{system}.json"))
            print(f"  {system}: {'done' if isinstance(results[system], dict) else results[system]}", flush=True)
    print(table(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

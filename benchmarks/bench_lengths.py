"""Shapes that change: a sweep of sequence lengths on 2 CPU ranks (gloo, Inductor), each rank its own length
every step (as padding to each rank's longest row gives), on bench_gpt.py's GPT:

    python benchmarks/bench_lengths.py                                  # 50 lengths; static dynshard on 8
    python benchmarks/bench_lengths.py --lengths 12 --layers 2 --d-model 64 --static-lengths 4   # a quick look

system               what runs
ddp                  DistributedDataParallel + torch.compile (Dynamo's automatic dynamic shapes)
dynshard-dynamic     torch.compile(model, backend="dynshard", dynamic=True): one symbolic program
dynshard-automatic   torch.compile(model, backend="dynshard"): automatic dynamic shapes, each rank's first
                     length static (its own plan), then one symbolic program
dynshard-static      torch.compile(..., dynamic=False): a plan and a program per length (the recompile
                     limit raised so that it runs them all); every rank at rank 0's lengths, which static plans
                     need (different lengths on the ranks are refused: PlanMismatchError)
dynshard-dynamic-0   dynshard-dynamic at dynshard-static's lengths, for the ratio of their steps
tp-static            policy="tp" over both ranks (one unit): a plan and a program per length, rank 0's lengths
tp-dynamic           the same with dynamic=True: one plan and one Dynamo graph, one program compiled on its
                     symbols (the plan made at the first length)
tp-automatic         the same with torch.compile's automatic dynamic shapes: the first length static, then one
                     symbolic program
pp-static            policy="pp" over both ranks (2 stages, 2 micro-batches), rank 0's lengths
pp-dynamic           the same with dynamic=True: one plan and one Dynamo graph, each rank's stage compiled per
                     micro-batch shape from the plan

Each system trains with AdamW over the lengths twice: the first pass compiles what it needs, the second runs
every length again, compiled. graphs: Dynamo graphs compiled (rank 0); compile s: first pass minus second
pass (max over ranks); step ms: the second pass's median step (each step's slower rank); / ddp and / static: the
median over steps of the ratio to that system's step at the same lengths. Each system runs in its own processes with an empty Inductor cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


TP = {"policy": "tp", "plan_ngpus": 2}
PP = {"policy": "pp", "plan_ngpus": 2, "use_end2end": True, "pas_config": {"pipeline_nmicros": 2}}
SYSTEMS = {     # dynshard's: (options, torch.compile's dynamic=)
    "dynshard-dynamic": ({}, True), "dynshard-automatic": ({}, None), "dynshard-static": ({}, False),
    "dynshard-dynamic-0": ({}, True),
    "tp-static": (TP, False), "tp-dynamic": (TP, True), "tp-automatic": (TP, None), "pp-static": (PP, False), "pp-dynamic": (PP, True)}
STATIC_OF = {"dynshard-dynamic-0": "dynshard-static", "tp-dynamic": "tp-static", "tp-automatic": "tp-static",
             "pp-dynamic": "pp-static"}


def lengths_of(rank: int, count: int, low: int, high: int) -> list[int]:
    """``count`` distinct lengths in [low, high) for this rank, in an order of its own."""
    generator = torch.Generator().manual_seed(17 + rank)
    return (torch.randperm(high - low, generator=generator)[:count] + low).tolist()


def _rank(rank: int, world: int, port: int, system: str, args, outdir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                       "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": os.path.join(outdir, "inductor")})
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import dynshard
    from models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, heads=args.heads, layers=args.layers))
    # rank 0's lengths on every rank (the ranks of a tp or pp unit read one batch)
    shared = system not in ("ddp", "dynshard-dynamic", "dynshard-automatic")
    lengths = lengths_of(0 if shared else rank, args.lengths, args.min_length, args.seq)
    lengths = lengths[:args.static_lengths] if shared else lengths
    if system == "ddp":
        dist.init_process_group("gloo")
        compiled = torch.compile(torch.nn.parallel.DistributedDataParallel(model))
    else:
        options, dynamic = SYSTEMS[system]
        if dynamic is False:
            torch._dynamo.config.recompile_limit = len(lengths) + 8
        compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(**options), dynamic=dynamic)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(length: int, seed: int) -> float:
        generator = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, args.vocab, (args.batch, length), generator=generator)
        start = time.perf_counter()
        loss = compiled(idx, torch.roll(idx, -1, dims=1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    first = [step(length, i) for i, length in enumerate(lengths)]
    second = [step(length, i) for i, length in enumerate(lengths)]
    result = {"graphs": counters["stats"]["unique_graphs"], "compile_s": sum(first) - sum(second),
              "lengths": lengths, "steps": second}
    torch.save(result, os.path.join(outdir, f"{system}-{rank}.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()


def run(system: str, args) -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as outdir:
        print(f"[{time.strftime('%H:%M:%S')}] {system} ...", flush=True)
        mp.start_processes(_rank, args=(2, port, system, args, outdir), nprocs=2, start_method="spawn")
        return [torch.load(os.path.join(outdir, f"{system}-{r}.pt")) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, default=50)
    parser.add_argument("--static-lengths", type=int, default=8)
    parser.add_argument("--min-length", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128, help="the longest length (GPT's positions)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4, help="rows per rank")
    parser.add_argument("--systems", default="ddp,dynshard-dynamic,dynshard-automatic,dynshard-static,dynshard-dynamic-0")
    args = parser.parse_args()
    results = {system: run(system, args) for system in args.systems.split(",")}

    print(f"\n2 ranks (gloo, Inductor, CPU), GPT {args.layers} layers d{args.d_model}, {args.batch} rows per rank, "
          f"lengths {args.min_length}-{args.seq - 1}\n")
    header = ("system", "lengths", "graphs", "compile s", "step ms", "/ ddp", "/ static")
    per_step = {system: [max(times) for times in zip(*(r["steps"] for r in ranks))]     # step i: the slower rank
                for system, ranks in results.items()}

    def ratio(system: str, peer: str, pairs: tuple[str, ...]) -> str:
        if system not in pairs or peer not in per_step or system == peer:
            return "-"
        return f"{statistics.median(m / t for m, t in zip(per_step[system], per_step[peer])):.3f}"

    rows = [header]
    for system, ranks in results.items():
        rows.append((system, str(len(per_step[system])), str(ranks[0]["graphs"]),
                     f"{max(r['compile_s'] for r in ranks):.1f}", f"{1000 * statistics.median(per_step[system]):.1f}",
                     ratio(system, "ddp", ("dynshard-dynamic", "dynshard-automatic")),
                     ratio(system, STATIC_OF.get(system, ""), tuple(STATIC_OF))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))


if __name__ == "__main__":
    main()

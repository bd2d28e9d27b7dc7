"""What dynshard's per-step safety checks cost against a training step (issue 25 items 1 and 2):

    python benchmarks/bench_unit_checks.py            # 2 ranks, the benchmark GPT (bench_gpt.py's shape)

- the unit-input check (``Config.verify_inputs_every``): the digest of every user input and one
  all-gather of the digests, timed on its own, as a fraction of a steady tp step; at the default (every
  100th call) and if it ran on every call;
- the buffer broadcast (``Config.broadcast_buffers``): the bytes and time of the broadcast of a BatchNorm
  model's written statistics, against that model's step under dp.

Each rank runs with one thread; the figures are rank 0's medians.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def _median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(rank: int, world: int, steps: int, repeat: int) -> dict:
    import torch
    import torch.distributed as dist

    import dynshard
    from models import GPT, GPTConfig, gpt_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=4096, seq=128, d_model=256, heads=4, layers=4)
    model = GPT(cfg)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(policy="tp", plan_ngpus=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx, tgt = gpt_batch(cfg, 8, 0)

    def step():
        compiled(idx, tgt).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    dist.barrier()
    step_s = _median_seconds(step, steps)
    plan = next(ref() for p in model.parameters() for ref in dynshard.runtime.sharding.get_tag(p).plans)
    check = plan.input_check
    dist.barrier()
    args = [None] * (max(check.indices) + 1)
    for index, value in zip(check.indices, (idx, tgt)):
        args[index] = value
    check_s = _median_seconds(lambda: check.check(args), repeat)

    from models import BatchNormMLP, mlp_batch
    bn = BatchNormMLP(dim=256, hidden=1024)
    bn_compiled = torch.compile(bn, backend="dynshard", options=dynshard.Config(policy="dp"))
    bn_opt = torch.optim.SGD(bn.parameters(), lr=0.01)
    x, y = mlp_batch(64, seed=rank, dim=256)

    def bn_step():
        bn_compiled(x, y).backward()
        bn_opt.step()
        bn_opt.zero_grad()

    for _ in range(3):
        bn_step()
    dist.barrier()
    bn_step_s = _median_seconds(bn_step, steps)
    sync = next(ref() for p in bn.parameters() for ref in dynshard.runtime.sharding.get_tag(p).plans).buffer_sync
    sent_before = sync.bytes
    bn_step()
    bytes_per_step = sync.bytes - sent_before
    versions = sync.versions(_buffer_args(bn, sync))     # every later call finds them written
    broadcast_s = _median_seconds(lambda: _rewrite_and_sync(bn, sync, versions), repeat)
    return {"tp_step_s": step_s, "input_check_s": check_s, "every": check.every,
            "input_check_fraction_every_call": check_s / step_s,
            "input_check_fraction_default": check_s / check.every / step_s,
            "bn_step_s": bn_step_s, "buffer_broadcast_s": broadcast_s, "buffer_bytes_per_step": bytes_per_step,
            "buffer_fraction": broadcast_s / bn_step_s}


def _buffer_args(module, sync) -> list:
    args = [None] * (max(sync.indices) + 1)
    buffers = list(module.buffers())
    for position, index in enumerate(sync.indices):
        args[index] = buffers[position]
    return args


def _rewrite_and_sync(module, sync, versions) -> None:
    args = _buffer_args(module, sync)
    for buf in module.buffers():
        buf.add_(0)
    sync.after_call(args, versions)


def main() -> None:
    from distributed import run_ranks

    results = run_ranks(measure, 2, 20, 50, timeout=1200)
    print(json.dumps(results[0], indent=2))
    r = results[0]
    print(f"\n| check | seconds | step seconds | fraction of a step |\n|---|---|---|---|\n"
          f"| unit-input digest + all-gather, one check | {r['input_check_s']:.5f} | {r['tp_step_s']:.4f} | "
          f"{r['input_check_fraction_every_call']:.2%} |\n"
          f"| the same at the default, every {r['every']}th call | | | {r['input_check_fraction_default']:.4%} |\n"
          f"| buffer broadcast, {r['buffer_bytes_per_step']} bytes per step | {r['buffer_broadcast_s']:.5f} | "
          f"{r['bn_step_s']:.4f} | {r['buffer_fraction']:.2%} |")


if __name__ == "__main__":
    main()

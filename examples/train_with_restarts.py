"""Train a small GPT with dynshard, checkpoint every k steps, and survive a rank dying: torchrun restarts
the group and training resumes from the newest complete checkpoint, bit for bit.

    torchrun --nproc-per-node 2 --max-restarts 1 examples/train_with_restarts.py \\
        --ckpt-dir /tmp/ckpt --out /tmp/final.pt --kill-at 1:5      # rank 1 dies at step 5, once

Each attempt loads ``dynshard.checkpoint.latest(ckpt_dir)`` if there is one, saves every ``--save-every``
steps with ``extra={"step": steps done}``, and at the end rank 0 writes the full parameters
(``dynshard.collect_state_dict``) with the losses of the steps this attempt ran to ``--out``.

The batch of a step is a function of the step number (and the data-parallel rank) only, so a resumed run
reads exactly what an uninterrupted one reads; the optimizer state and each rank's RNG come back from the
checkpoint. ``--kill-at RANK:STEP`` (or ``DYNSHARD_EXAMPLE_KILL_AT``) makes that rank call ``os._exit(1)``
before running that step, on the first attempt only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dynshard  # noqa: E402
from dynshard.runtime.mesh import ensure_process_group  # noqa: E402
from models import GPT, GPTConfig  # noqa: E402
from train_gpt import counting_batch  # noqa: E402  (a function of its seed only: no loader position to restore)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt-dir", required=True, help="where checkpoints go (step<N> directories)")
    parser.add_argument("--out", required=True, help="file rank 0 writes the final full parameters to")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--policy", default="tp", choices=["dp", "data", "tp"])
    parser.add_argument("--plan", type=int, default=None, help="plan_ngpus (default: all ranks, 1 for dp)")
    parser.add_argument("--zero", type=int, default=0, help="use_zero level")
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=8, help="batch per plan unit")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr-noise", type=float, default=0.0,
                        help="scale each step's learning rate by 1 + U(-x, x) drawn from torch's global RNG "
                             "(something that depends on the RNG state the checkpoint restores)")
    parser.add_argument("--kill-at", default=os.environ.get("DYNSHARD_EXAMPLE_KILL_AT"),
                        help="RANK:STEP: that rank calls os._exit(1) before that step, on the first attempt only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # the process group before the first compiled step (a load before it restores each rank's own RNG);
    # dynshard's scopes a restarted attempt's keys in torchrun's store
    ensure_process_group("cpu")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    kill_rank, kill_step = (int(x) for x in args.kill_at.split(":")) if args.kill_at else (-1, -1)

    def log(message: str) -> None:
        if rank == 0:
            print(f"[attempt {attempt}] {message}", flush=True)

    torch.manual_seed(0)                                  # every rank builds the same model
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, heads=args.heads, layers=args.layers)
    model = GPT(cfg)
    plan = args.plan or (1 if args.policy == "dp" else world)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy=args.policy, plan_ngpus=plan, compiler=args.compiler, use_zero=args.zero))
    if args.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    start = 0
    path = dynshard.checkpoint.latest(args.ckpt_dir)
    if path is not None:                                  # before the first step: whole tensors, cut later
        t0 = time.perf_counter()
        start = dynshard.checkpoint.load(path, compiled, opt)["step"]
        log(f"resumed from {path} (step {start}) in {time.perf_counter() - t0:.3f}s")

    dp_rank, _ = dynshard.data_parallel_rank(plan)       # ranks of one plan unit read the same batch
    losses = {}
    for step in range(start, args.steps):
        if step == kill_step and rank == kill_rank and attempt == 0:
            print(f"[attempt {attempt}] rank {rank} dies before step {step}", flush=True)
            os._exit(1)
        if args.lr_noise:
            scale = 1 + args.lr_noise * (2 * torch.rand(()).item() - 1)
            for group in opt.param_groups:
                group["lr"] = args.lr * scale
        idx, targets = counting_batch(cfg, args.batch, seed=1000 * dp_rank + step)
        loss = compiled(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses[step] = loss.item()
        log(f"step {step:3d}  loss {losses[step]:.6f}")
        done = step + 1
        if done % args.save_every == 0 and done < args.steps:
            t0 = time.perf_counter()
            dynshard.checkpoint.save(os.path.join(args.ckpt_dir, f"step{done}"), compiled, opt, extra={"step": done})
            log(f"saved step{done} in {time.perf_counter() - t0:.3f}s")

    full = dynshard.collect_state_dict(compiled)
    if rank == 0:
        torch.save({"params": {k: v.detach().clone() for k, v in full.items()}, "losses": losses,
                    "resumed_from": start, "attempt": attempt}, args.out)
        log(f"wrote {args.out}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

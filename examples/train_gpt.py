"""Train a small GPT with dynshard on CPU processes.

    torchrun --nproc-per-node 2 examples/train_gpt.py            # 2-way tensor parallel
    torchrun --nproc-per-node 4 examples/train_gpt.py --plan 2   # 2-way TP x 2-way DP
    torchrun --nproc-per-node 2 examples/train_gpt.py --save-plan gpt.plan.json   # keep the plan it ran
    torchrun --nproc-per-node 2 examples/train_gpt.py --load-plan gpt.plan.json   # run that plan (edited?)

The model is an ordinary nn.Module (tests/models.py); nothing in it knows about parallelism.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import dynshard  # noqa: E402
from models import GPT, GPTConfig  # noqa: E402


def counting_batch(cfg: GPTConfig, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count up from a random start: a task the model can learn in a few steps."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=g)
    idx = (start + torch.arange(cfg.seq)) % cfg.vocab
    return idx, (idx + 1) % cfg.vocab


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", default="tp", choices=["dp", "data", "tp"])
    parser.add_argument("--plan", type=int, default=None, help="plan_ngpus (default: all ranks, 1 for dp)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="batch per plan unit")
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--save-plan", default=None, help="write the job's plan to this file")
    parser.add_argument("--load-plan", default=None, help="run the plan in this file (no policy runs)")
    args = parser.parse_args()

    torch.manual_seed(0)                                  # every rank builds the same model
    cfg = GPTConfig(vocab=512, seq=64, d_model=128, heads=4, layers=2)
    model = GPT(cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan = args.plan or (1 if args.policy == "dp" else world)
    model = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy=args.policy, plan_ngpus=plan, compiler=args.compiler, save_plan_path=args.save_plan,
        load_plan_path=args.load_plan))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    dp_rank, _ = dynshard.data_parallel_rank(plan)       # ranks of one plan unit read the same batch
    for step in range(args.steps):
        idx, targets = counting_batch(cfg, args.batch, seed=1000 * dp_rank + step)
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"step {step:2d}  loss {loss.item():.4f}", flush=True)

    report = dynshard.explain(model)
    full = dynshard.collect_state_dict(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print()
        print(report)
        shape = tuple(full["blocks.0.fc1.weight"].shape)
        print(f"\ncollected {len(full)} full tensors, e.g. blocks.0.fc1.weight {shape}")


if __name__ == "__main__":
    main()

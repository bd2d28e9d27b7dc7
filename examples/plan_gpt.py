"""Plan the example GPT for a job you do not have, in this one process (no torchrun), and read the plan.

    python examples/plan_gpt.py                                   # tp over 2 ranks, as examples/train_gpt.py
    python examples/plan_gpt.py --world 64 --policy hybrid --plan 16 --zero 1 --out gpt64.plan.json
    python examples/plan_gpt.py --world 8 --policy hybrid --plan 4 --layers 8 --html gpt.html   # the page

The model is built on the meta device: nothing is allocated, whatever its size. Run the file it writes with
``dynshard.Config(load_plan_path=...)`` (examples/train_gpt.py --load-plan).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import dynshard  # noqa: E402
from models import GPT, GPTConfig  # noqa: E402


class EndToEndGPT(GPT):
    """nnScaler's end-to-end module (a sample in, the loss out), which pipelines need."""

    def forward(self, sample):
        return super().forward(*sample)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2, help="ranks of the job to plan for")
    parser.add_argument("--policy", default="tp", choices=["dp", "data", "tp", "pp", "hybrid"])
    parser.add_argument("--plan", type=int, default=None, help="plan_ngpus (default: the world; 1 for dp)")
    parser.add_argument("--zero", type=int, default=0, help="use_zero")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--stages", type=int, default=4, help="pp / hybrid: pipeline stages")
    parser.add_argument("--micros", type=int, default=4, help="pp / hybrid: micro-batches per step")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default=None, help="write the plan(s) here")
    parser.add_argument("--html", default=None, help="write the plans' page here (open it in any browser)")
    args = parser.parse_args()

    cfg = GPTConfig(vocab=512, seq=64, d_model=128, heads=4, layers=args.layers)
    pipeline = args.policy in ("pp", "hybrid")
    with torch.device("meta"):
        model = EndToEndGPT(cfg) if pipeline else GPT(cfg)
    idx = torch.zeros(args.batch // (args.micros if pipeline else 1), cfg.seq, dtype=torch.long)
    sample = (idx, idx)
    plan_ngpus = args.plan or (1 if args.policy == "dp" else args.world)
    options = dict(policy=args.policy, plan_ngpus=plan_ngpus, use_zero=args.zero)
    if pipeline:
        options.update(use_end2end=True, pas_config={"pipeline_nmicros": args.micros, "pipeline_nstages": args.stages})
    plans = dynshard.plan(model, (sample,) if pipeline else sample, dynshard.Config(**options), world_size=args.world)
    print(dynshard.explain(plans))
    if args.html:
        print(f"\nwrote the page to {dynshard.explain(plans).save_html(args.html)}")
    if args.out:
        from dynshard.planning.files import write_plan_file

        write_plan_file(args.out, plans)
        print(f"\nwrote {len(plans)} plan(s) to {args.out}")


if __name__ == "__main__":
    main()

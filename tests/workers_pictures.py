"""What each process runs in the plan-page tests (module level, so spawned processes can import it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import dynshard
from models import GPT, GPTConfig, gpt_batch
from workers_pipeline import build

OFFLINE = {     # name: (Config options, world size)
    "tp": ({"policy": "tp", "plan_ngpus": 2, "use_zero": 1}, 4),
    "zero3": ({"policy": "data", "plan_ngpus": 1, "use_zero": 3}, 4),
    "hybrid": ({"policy": "hybrid", "plan_ngpus": 4, "use_zero": 1, "use_end2end": True,
                "pas_config": {"pipeline_nstages": 2, "pipeline_nmicros": 4}}, 8),
    "autodist": ({"policy": "autodist", "plan_ngpus": 2, "pas_config": {"mem_constraint": 0.0006}}, 8),
}


def offline_plans(rank: int, world: int) -> dict[str, list[str]]:
    """Each OFFLINE case's plans, made by ``dynshard.plan`` in this one process, as JSON."""
    found = {}
    for name, (options, world_size) in OFFLINE.items():
        torch.manual_seed(0)
        torch._dynamo.reset()
        cfg = GPTConfig()
        batch = gpt_batch(cfg, 4, 0)
        profile = None if options["policy"] == "autodist" else "cpu"       # hand plans predicted too
        plans = dynshard.plan(GPT(cfg), batch, dynshard.Config(compiler="aot_eager", **options), world_size=world_size,
                              device_profile=profile)
        found[name] = [p.to_json() for p in plans]
    return found


def pages_of_a_job(rank: int, world: int, trace_dir: str) -> dict:
    """A tp model after two steps and a pipeline after two train_steps (writing traces): each one's page
    from ``explain(model)``, and what the page should show of this rank."""
    import datetime

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(policy="tp", plan_ngpus=2,
                                                                               compiler="aot_eager"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        idx, targets = gpt_batch(cfg, 4, step)
        compiled(idx, targets).backward()
        opt.step()
        opt.zero_grad()
    report = dynshard.explain(compiled)
    tp_page = report.to_html()
    held = sum(p.numel() * p.element_size() for p in model.parameters())

    torch._dynamo.reset()
    pipe, make = build("gpt")
    staged = torch.compile(pipe, backend="dynshard", options=dynshard.Config(
        policy="pp", plan_ngpus=2, use_end2end=True, compiler="aot_eager", trace_dir=trace_dir,
        pas_config={"pipeline_nmicros": 4}))
    for step in range(2):
        dynshard.train_step(staged, [make(2, 4 * step + i) for i in range(4)])
    dist.barrier()      # every rank's trace file holds its steps (rewritten after each of the first steps)
    pipe_report = dynshard.explain(staged)
    pipe_page = pipe_report.to_html()
    return {"tp_page": tp_page, "saved_bytes": report.saved_bytes(), "held_bytes": held,
            "tp_plan": report.plans[0].to_json(), "pipe_page": pipe_page, "pipe_plan": pipe_report.plans[0].to_json(),
            "p2p_bytes": pipe_report.pipelines[0].p2p_bytes, "sent_bytes": pipe_report.pipelines[0].sent_bytes}

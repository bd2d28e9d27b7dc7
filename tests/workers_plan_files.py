"""What each rank runs in the plan-file tests (module level, so spawned processes can import it)."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

import dynshard
from dynshard.runtime.job import new_job
from models import GPT, MLP, GPTConfig, gpt_batch, mlp_batch
from workers import train_parity
from workers_pipeline import build, pipeline_parity
from workers_plan_once import _innermost

GPT_PIPELINE = {"pipeline_nmicros": 4}


def must_not_plan(plan, config) -> None:
    raise AssertionError("a job that loads its plan runs no policy")


def _train(case: dict, options: dict, load: bool) -> dict:
    """One training run of ``case`` (a policy, its world and model) with ``options`` (plan files)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])    # (the group comes with the first call)
    if case["kind"] == "pipeline":
        pas_config = {**GPT_PIPELINE, **case.get("pas_config", {})}
        return pipeline_parity(rank, world, "gpt", case["plan_ngpus"], pas_config,
                               "train_step", 2, policy=case["policy"], options={**case.get("options", {}), **options}
                               if not load else options)
    policy = must_not_plan if load else case["policy"]
    return train_parity(rank, world, case.get("model", "mlp"), policy, case["plan_ngpus"],
                        "aot_eager", 2, options={**case.get("options", {}), **options} if not load else options)


def _fresh() -> None:
    """As in new processes on the same group: Dynamo's programs and the job's state gone."""
    torch._dynamo.reset()
    new_job()


def save_then_load(rank: int, world: int, case: dict, folder: str) -> dict:
    """A job that plans and saves its plan, then (in the same processes, everything forgotten) a job that
    loads it and saves what it ran: both train like one process, and the two files are the same bytes."""
    saved, again = os.path.join(folder, "saved.plan.json"), os.path.join(folder, "again.plan.json")
    first = _train(case, {"save_plan_path": saved}, load=False)
    dist.barrier()
    _fresh()
    second = _train(case, {"load_plan_path": saved, "save_plan_path": again}, load=True)
    dist.barrier()
    with open(saved) as f, open(again) as g:
        return {"first": first, "second": second, "saved": f.read(), "again": g.read()}


def load_edited(rank: int, world: int, case: dict, path: str, options: dict | None = None) -> dict:
    """Train on a plan file edited by hand (``options``: what else the job's config says)."""
    return _train(case, {"load_plan_path": path, **(options or {})}, load=True)


def load_expecting_error(rank: int, world: int, path: str, batch: int = 4) -> dict:
    """Compile an MLP job from ``path``: the error this rank raises, and how long it took."""
    torch.manual_seed(0)
    model = torch.compile(MLP(), backend="dynshard", options=dynshard.Config(compiler="aot_eager", load_plan_path=path))
    start = time.monotonic()
    try:
        model(*mlp_batch(batch, 0))
    except Exception as error:
        return {"error": _innermost(error), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def offline(rank: int, world: int, case: dict, world_size: int, meta: bool = False) -> list[str]:
    """``dynshard.plan`` in a plain process (no process group): the plans' JSON text (``meta``: the model
    built on the meta device)."""
    assert not dist.is_initialized()
    torch.manual_seed(0)
    if case["kind"] == "pipeline":
        model, make = build("gpt")
        args = (make(8 // GPT_PIPELINE["pipeline_nmicros"], 0),)     # one sample, as train_step captures it
        config = dynshard.Config(policy=case["policy"], plan_ngpus=case["plan_ngpus"], use_end2end=True,
                                 compiler="aot_eager", pas_config={**GPT_PIPELINE, **case.get("pas_config", {})},
                                 **case.get("options", {}))
    else:
        with torch.device("meta" if meta else "cpu"):
            model = MLP() if case.get("model", "mlp") == "mlp" else GPT(GPTConfig())
        args = mlp_batch(4, 0) if case.get("model", "mlp") == "mlp" else gpt_batch(GPTConfig(), 4, 0)
        config = dynshard.Config(policy=case["policy"], plan_ngpus=case["plan_ngpus"], compiler="aot_eager",
                                 **case.get("options", {}))
    plans = dynshard.plan(model, args, config, world_size=world_size)
    assert not dist.is_initialized()
    return [p.to_json() for p in plans]


def edit(text: str, change) -> str:
    data = json.loads(text)
    change(data)
    return json.dumps(data)


def plan_64_ranks(rank: int, world: int) -> list[tuple[str, str]]:
    """The hybrid plan (4 stages x tp 4 x dp 4, ZeRO-1) of a 32-layer GPT on the meta device, for 64 ranks."""
    cfg = GPTConfig(vocab=512, seq=64, d_model=256, heads=8, layers=32)
    with torch.device("meta"):
        model = GPT(cfg)
    plans = dynshard.plan(model, gpt_batch(cfg, 16, 0), dynshard.Config(
        policy="hybrid", plan_ngpus=16, use_zero=1, use_end2end=True,
        pas_config={"pipeline_nstages": 4, "pipeline_nmicros": 16}), world_size=64)
    return [(p.to_json(), str(dynshard.explain(plans))) for p in plans]

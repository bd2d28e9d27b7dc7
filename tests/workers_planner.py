"""What each rank runs in the planner tests (module level, so spawned processes can import it)."""

from __future__ import annotations

import dataclasses
import os
import time

import torch

import dynshard
from models import MLP, mlp_batch
from workers import train_parity
from workers_pipeline import pipeline_parity
from workers_plan_once import _innermost

EDITED = "blocks.0.0.weight"


def _made_whole(plan: dynshard.Plan, name: str) -> dynshard.Plan:
    return dataclasses.replace(plan, tensors={**plan.tensors, name: dataclasses.replace(plan.tensors[name], tp="R")})


@dynshard.planner
def tp_with_first_layer_whole(planning):
    """The tp plan over 2 ranks, its first layer's weight made whole by hand."""
    return _made_whole(planning.plan(policy="tp", plan_ngpus=2), EDITED)


@dynshard.planner
def pipeline_cut_earlier(planning):
    """The pp plan over 2 ranks, its second stage starting one layer earlier than the policy's cut."""
    plan = planning.plan(policy="pp", plan_ngpus=2, pas_config={"pipeline_nmicros": 4})
    return dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, starts=("blocks.1",)))


@dynshard.planner
def made_for_another_world(planning):
    plan = planning.plan(policy="tp", plan_ngpus=2)
    return dataclasses.replace(plan, made_for=dataclasses.replace(plan.made_for, world_size=4))


@dynshard.planner
def failing(planning):
    raise RuntimeError("no plan of mine fits this model")


@dynshard.planner
def not_a_plan(planning):
    return planning.plan(policy="tp", plan_ngpus=2).to_json()


PLANNERS = {f.fn.__name__: f for f in (tp_with_first_layer_whole, pipeline_cut_earlier, made_for_another_world,
                                       failing, not_a_plan)}


def train_with(rank: int, world: int, name: str) -> dict:
    """Train like train_parity / pipeline_parity with the planner ``name`` as the policy."""
    if name == "pipeline_cut_earlier":
        return pipeline_parity(rank, world, "gpt", 2, {"pipeline_nmicros": 4}, "train_step", 2, policy=PLANNERS[name])
    return train_parity(rank, world, "mlp", PLANNERS[name], 2, "aot_eager", 2)


def compile_expecting_error(rank: int, world: int, name: str) -> dict:
    """Compile an MLP job with the planner ``name``: the error this rank raises, and how long it took."""
    torch.manual_seed(0)
    model = torch.compile(MLP(), backend="dynshard", options=dynshard.Config(
        policy=PLANNERS[name], compiler="aot_eager"))
    start = time.monotonic()
    try:
        model(*mlp_batch(4, 0))
    except Exception as error:
        return {"error": _innermost(error), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def offline_choice(rank: int, world: int) -> dict:
    """In a plain process: a planner that prices four policies for 8 ranks and returns the one it likes, beside
    the plans those policies make themselves."""
    from workers_pipeline import build

    assert int(os.environ.get("WORLD_SIZE", 1)) >= 1
    model, make = build("gpt")
    options = {"tp": dict(policy="tp", plan_ngpus=2), "data": dict(policy="data", plan_ngpus=2),
               "hybrid": dict(policy="hybrid", plan_ngpus=4, pas_config={"pipeline_nstages": 2, "pipeline_nmicros": 4}),
               "pp": dict(policy="pp", plan_ngpus=2, pas_config={"pipeline_nmicros": 4})}
    seen = {}

    @dynshard.planner
    def hybrid_unless_cheaper(planning):
        for name, o in options.items():
            seen[name] = planning.plan(**o)
        priced = {name: planning.plan(device_profile="cpu", **options[name]) for name in ("tp", "data")}
        seen["priced"] = {name: p.predicted.cost.step_seconds for name, p in priced.items()}
        return seen["hybrid"]

    chosen, = dynshard.plan(model, (make(2, 0),), dynshard.Config(policy=hybrid_unless_cheaper, use_end2end=True),
                            world_size=8)
    made = {name: dynshard.plan(model, (make(2, 0),), dynshard.Config(use_end2end=True, **o), world_size=8)[0].to_json()
            for name, o in options.items()}
    return {"chosen": chosen.to_json(), "seen": {n: p.to_json() for n, p in seen.items() if n != "priced"},
            "made": made, "priced": seen["priced"]}

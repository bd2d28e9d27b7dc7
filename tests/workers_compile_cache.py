"""What each rank runs in the compile-cache tests (module level, so spawned processes can import it)."""

from __future__ import annotations

import re

import torch
from torch._dynamo.utils import counters

import dynshard
from models import GPT, GPTConfig, gpt_batch


def train_with_inductor(rank: int, world: int, options: dict, accumulate: bool = False) -> dict:
    """Two SGD steps of the test GPT compiled by Inductor (``accumulate``: each of two micro-batches, the
    first under ``no_sync``): losses, this rank's parameters, what aot_autograd's and Inductor's caches
    did, the process-group names the compiled code's collectives use and what explain reports."""
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(compiler="inductor", **options))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    unit, units = dynshard.data_parallel_rank(options.get("plan_ngpus", 1))   # a unit's ranks read one batch
    for step in range(2):
        if accumulate:
            with dynshard.no_sync(compiled):
                compiled(*gpt_batch(cfg, 2, 100 + step * units + unit)).backward()
        loss = compiled(*gpt_batch(cfg, 2, step * units + unit))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    cache = {kind: counters["inductor"][f"fxgraph_cache_{kind}"] for kind in ("hit", "miss", "bypass")}
    aot = {kind: counters["aot_autograd"][f"autograd_cache_{kind}"] for kind in ("hit", "miss", "bypass")}
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "cache": cache, "aot_cache": aot, "group_names": sorted(_group_names_in_generated_code()),
            "explained": _explained(compiled)}


def _explained(compiled) -> dict:
    """What explain says of the programs, but how long they took to compile."""
    explanation = dynshard.explain(compiled)
    return {"collectives": [(c.phase, c.kind, c.group, c.bytes, c.shape) for c in explanation.collectives()],
            "saved": [(p.saved_bytes, p.saved_count) for p in explanation.programs]}


def _group_names_in_generated_code() -> set[str]:
    """The group names Inductor's generated modules pass to collectives and to the mesh coordinate."""
    from torch._inductor.codecache import PyCodeCache

    names = set()
    for module in list(PyCodeCache.modules) + list(PyCodeCache.modules_no_attr.values()):
        with open(module.__file__) as source:
            for line in source:
                if "_c10d_functional." in line or "mesh_coordinate" in line:
                    # (torch's group names are numbers)
                    names.update(n for n in re.findall(r"'([^']*)'", line) if re.fullmatch(r"\d+|dynshard:.*", n))
    return names

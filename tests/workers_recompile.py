"""Rank functions for tests/test_recompile.py: recompiles while gradients exist (tp, plan_ngpus=2).

Each scenario trains a dynshard model and a single-process eager copy side by side on the same batches
with SGD with momentum, and reports losses, outputs and full parameters for the test to compare. A
scenario that raises reports its traceback instead, so one job covers every scenario.
"""

from __future__ import annotations

import copy
import time
import traceback

import torch

import dynshard
from models import GPT2StyleBlock, GPTConfig, LayerStack
from workers import build

LR, MOMENTUM = 0.05, 0.9
OPTIONS = dynshard.Config(policy="tp", plan_ngpus=2, compiler="aot_eager")
# ZeRO-3 over 2 units of one rank: every parameter holds rows, so every recompile needs global shapes
# (both units read the same batches here, so the mean gradient is the single-process one)
ZERO3 = dynshard.Config(use_zero=3, compiler="aot_eager")
# autodist under a budget the data plan misses: each new graph (micro-batch size, eval) is searched again,
# with the parameters the first program placed fixed
AUTODIST = dynshard.Config(policy="autodist", plan_ngpus=2, compiler="aot_eager", pas_config={"mem_constraint": 0.0002})


def _build(name: str):
    if name != "gpt2_layers":
        return build(name)
    # GPT-2's own code: heads split by view(B, T, H, C // H), so tracing with local shapes would fail
    torch.manual_seed(0)
    cfg = GPTConfig(layers=1)

    def make_batch(batch: int, seed: int):
        return (torch.randn(batch, cfg.seq, cfg.d_model, generator=torch.Generator().manual_seed(seed)),)
    return LayerStack(cfg, GPT2StyleBlock), make_batch


def _pair(name: str, options: dynshard.Config = OPTIONS, dynamic: bool | None = False):
    """(compiled model, its optimizer, module, reference, its optimizer, batch maker).

    Static shapes by default (``dynamic=False``): every new size is a recompile, which is what these
    scenarios exercise; ``dynamic=None`` leaves torch.compile's automatic dynamic shapes on.

    ``torch._dynamo.reset()`` first: scenarios do not share compiled frames (and dynshard must
    register its compile hooks again after a reset)."""
    torch._dynamo.reset()
    model, make_batch = _build(name)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", options=options, dynamic=dynamic)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    return compiled, opt, model, reference, ref_opt, make_batch


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _finish(out: dict, compiled, reference) -> dict:
    out["explain"] = str(dynshard.explain(compiled))
    out["params"] = dynshard.collect_state_dict(compiled)
    out["ref_params"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    return out


def training_loop(options: dynshard.Config = OPTIONS, dynamic: bool | None = False) -> dict:
    """Every recompile a training loop meets while gradients exist, on GPT-2-style layers.

    Step 0: micro-batches of 4 then 2 (accumulation: the shorter one compiles while .grad is set),
    step, then eval under no_grad and under inference_mode before zero_grad(set_to_none=False).
    Step 1: a new micro-batch size (3) compiles with zeroed .grad tensors (under automatic dynamic
    shapes it runs on the symbolic program step 0's second size compiled). Step 2 compiles nothing.
    """
    compiled, opt, model, reference, ref_opt, make_batch = _pair("gpt2_layers", options, dynamic)
    out: dict = {"losses": [], "ref_losses": [], "eval_errors": [], "graphs": []}
    for step, sizes in enumerate(((4, 2), (4, 3), (4, 3))):
        for net, optimizer, losses in ((compiled, opt, out["losses"]), (reference, ref_opt, out["ref_losses"])):
            for micro, size in enumerate(sizes):
                loss = net(*make_batch(size, 10 * step + micro))
                loss.backward()
                losses.append(loss.item())
            optimizer.step()
        eval_batch = make_batch(2, 100 + step)
        model.eval()
        reference.eval()
        with torch.no_grad():
            expected = reference(*eval_batch)
            out["eval_errors"].append((compiled(*eval_batch) - expected).abs().max().item())
        with torch.inference_mode():
            out["eval_errors"].append((compiled(*eval_batch) - expected).abs().max().item())
        model.train()
        reference.train()
        opt.zero_grad(set_to_none=False)
        ref_opt.zero_grad(set_to_none=False)
        out["graphs"].append(_graphs())
    return _finish(out, compiled, reference)


def compiled_optimizer_step(backend: str) -> dict:
    """``torch.compile(opt.step)`` (another backend) every step: it sees the local shards, compiles once."""
    compiled, opt, _, reference, ref_opt, make_batch = _pair("mlp")
    opt_step = torch.compile(opt.step, backend=backend)
    out: dict = {"losses": [], "ref_losses": [], "graphs": []}
    for step in range(4):
        x, y = make_batch(4, step)
        for net, step_fn, optimizer, losses in ((compiled, opt_step, opt, out["losses"]),
                                                (reference, ref_opt.step, ref_opt, out["ref_losses"])):
            loss = net(x, y)
            loss.backward()
            step_fn()
            optimizer.zero_grad()
            losses.append(loss.item())
        out["graphs"].append(_graphs())
    return _finish(out, compiled, reference)


SCENARIOS = {
    "training_loop": training_loop,
    "training_loop_zero3": lambda: training_loop(ZERO3),
    "training_loop_autodist": lambda: training_loop(AUTODIST, dynamic=None),
    "compiled_opt_step_aot_eager": lambda: compiled_optimizer_step("aot_eager"),
    "compiled_opt_step_inductor": lambda: compiled_optimizer_step("inductor"),
}


def recompile_scenarios(rank: int, world: int, names: list[str] | None = None) -> dict:
    results = {}
    for name in names or list(SCENARIOS):
        began = time.perf_counter()
        try:
            results[name] = SCENARIOS[name]()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - began
    return results

"""What each rank runs in the pipeline tests (module level, so spawned processes can import it)."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import pipe_split

import dynshard
from models import GPT, MLP, GPTConfig, gpt_batch, mlp_batch
from workers import train_beside

LR = 0.05


class EndToEndMLP(MLP):
    """nnScaler's end-to-end module: a sample (dict) in, the loss out."""

    def __init__(self, layers: int = 4, split: bool = False):
        super().__init__(layers=layers)
        self.split = split

    def forward(self, batch):
        x = batch["x"]
        for i, block in enumerate(self.blocks):
            if self.split and i == len(self.blocks) // 2:
                pipe_split()
            x = x + block(x)
        return F.mse_loss(self.head(x).squeeze(-1), batch["y"])


class EndToEndGPT(GPT):
    """The test GPT (tied embedding and LM head: the first and the last stage share a parameter)."""

    def forward(self, batch):
        return super().forward(batch["idx"], batch["tgt"])


class UntiedEndToEndGPT(EndToEndGPT):
    """The test GPT with its own LM head weight (1f1b_plus: the embedding runs on every rank)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg)
        self.lm_head.weight = nn.Parameter(self.wte.weight.detach().clone())


class SkipMLP(nn.Module):
    """A skip connection from the first layer to the last crosses every stage boundary."""

    def __init__(self, dim: int = 16, layers: int = 4):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.out = nn.Linear(dim, 1)

    def forward(self, batch):
        h = skip = torch.tanh(self.inp(batch["x"]))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return F.mse_loss(self.out(h + skip).squeeze(-1), batch["y"])


def build(name: str):
    torch.manual_seed(0)
    if name in ("mlp", "mlp_split"):
        model = EndToEndMLP(split=name == "mlp_split")
        return model, lambda n, seed: dict(zip(("x", "y"), mlp_batch(n, seed)))
    if name == "skip":
        return SkipMLP(), lambda n, seed: dict(zip(("x", "y"), mlp_batch(n, seed)))
    cfg = GPTConfig(layers=8 if name == "gpt8" else 4)
    if name == "untied_gpt":
        return UntiedEndToEndGPT(cfg), lambda n, seed: dict(zip(("idx", "tgt"), gpt_batch(cfg, n, seed)))
    return EndToEndGPT(cfg), lambda n, seed: dict(zip(("idx", "tgt"), gpt_batch(cfg, n, seed)))


def _rows(batch: dict, start: int, size: int) -> dict:
    return {k: v[start:start + size] for k, v in batch.items()}


def _short_timeouts() -> None:
    """A transfer that never matches fails within a minute instead of hanging the test."""
    import datetime

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))


def pipeline_parity(rank: int, world: int, model_name: str, plan_ngpus: int, pas_config: dict, entry: str,
                    steps: int = 3, batch: int = 8, policy: str = "pp", options: dict | None = None) -> dict:
    """Train with the pipeline and, on the same data, a single-process eager model; report both.

    entry "train_step": nnScaler's semantics, gradient = sum over the micro-batches (averaged over the
    data-parallel units); "plain": ``loss = model(batch); loss.backward()`` (the whole batch's mean);
    "alternate": train_step on even steps, plain calls on odd ones."""
    _short_timeouts()
    model, make = build(model_name)
    reference = copy.deepcopy(model)
    config = dynshard.Config(policy=policy, plan_ngpus=plan_ngpus, use_end2end=True, compiler="aot_eager",
                             pas_config=pas_config, **(options or {}))
    compiled = torch.compile(model, backend="dynshard", options=config)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    dp_rank, dp_size = dynshard.data_parallel_rank(plan_ngpus)
    m = pas_config.get("pipeline_nmicros", pas_config.get("update_freq"))     # (autodist: update_freq)
    losses, ref_losses = [], []
    for step in range(steps):
        whole = make(batch * dp_size, step)
        mine = _rows(whole, dp_rank * batch, batch)
        mode = entry if entry != "alternate" else ("train_step", "plain")[step % 2]
        if mode == "train_step":
            samples = [_rows(mine, i * (batch // m), batch // m) for i in range(m)]
            out = dynshard.train_step(compiled, samples)
            losses.append([float(v) for v in out])
            ref_out = []
            for unit in range(dp_size):
                unit_rows = _rows(whole, unit * batch, batch)
                for i in range(m):
                    loss = reference(_rows(unit_rows, i * (batch // m), batch // m))
                    (loss / dp_size).backward()
                    if unit == dp_rank:
                        ref_out.append(float(loss))
            ref_losses.append(ref_out)
        else:
            loss = compiled(mine)
            loss.backward()
            losses.append(float(loss))
            ref_loss = sum(reference(_rows(whole, u * batch, batch)) for u in range(dp_size)) / dp_size
            ref_loss.backward()
            ref_losses.append(float(reference(mine).detach()) if dp_size > 1 else float(ref_loss))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    held = {n: p.numel() for n, p in model.named_parameters()}
    full = dynshard.collect_state_dict(compiled)
    report = dynshard.explain(compiled)
    return {"losses": losses, "ref_losses": ref_losses, "params": full,
            "ref_params": {k: v.detach() for k, v in reference.state_dict().items()}, "held": held,
            "total": {n: p.numel() for n, p in reference.named_parameters()},
            "sent_bytes": [p.sent_bytes for p in report.pipelines], "p2p_bytes": [p.p2p_bytes for p in report.pipelines],
            "modules": [[s.modules for s in p.stages] for p in report.pipelines],
            "schedules": [p.plan.pipeline.schedule for p in report.pipelines if p.plan is not None],
            "saved": [[s.saved_bytes for s in p.stages] for p in report.pipelines]}


def pipeline_explain(rank: int, world: int, model_name: str, plan_ngpus: int, pas_config: dict) -> dict:
    """One train_step and one infer_step; the explain report and what each rank holds."""
    import os

    _short_timeouts()
    model, make = build(model_name)
    reference = copy.deepcopy(model)
    trace_dir = os.environ.get("TEST_TRACE_DIR")
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy="pp", plan_ngpus=plan_ngpus, use_end2end=True, compiler="aot_eager", pas_config=pas_config,
        trace_dir=trace_dir))
    m = pas_config.get("pipeline_nmicros", pas_config.get("update_freq"))     # (autodist: update_freq)
    samples = [make(2, i) for i in range(m)]
    dummy = [False] * (m - 1) + [True]
    losses = dynshard.train_step(compiled, samples, is_dummy_batch=dummy, scale_fn=lambda loss: 3.0 * loss)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for i, sample in enumerate(samples[:-1]):
        (3.0 * reference(sample)).backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    outputs = dynshard.infer_step(compiled, samples)
    with torch.no_grad():
        ref_outputs = [reference(s) for s in samples]
    report = dynshard.explain(compiled)
    return {"losses": [float(v) for v in losses], "ref_losses": [float(reference(s)) for s in samples],
            "grads": grads, "ref_grads": ref_grads, "outputs": [float(o) for o in outputs],
            "ref_outputs": [float(o) for o in ref_outputs], "report": str(report),
            "pipeline": report.pipelines[0], "held": {n: p.numel() for n, p in model.named_parameters()},
            "total": sum(p.numel() for p in reference.parameters())}


def pipeline_checkpoint(rank: int, world: int, root: str) -> dict:
    """Two pipeline steps, a DCP save (each rank writes its stages), then a data-parallel model and a
    pipeline model of other weights load it: both continue with the pipeline's parameters and momentum."""
    _short_timeouts()
    model, make = build("gpt")
    pas = {"pipeline_nmicros": 2}
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy="pp", plan_ngpus=2, use_end2end=True, compiler="aot_eager", pas_config=pas))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(2):
        dynshard.train_step(compiled, [make(2, 10 * step + i) for i in range(2)])
        opt.step()
        opt.zero_grad()
    saved = dynshard.collect_state_dict(compiled)
    path = os.path.join(root, "step2")
    dynshard.checkpoint.save(path, compiled, opt, extra={"step": 2})
    results = {"saved": saved}
    for policy, options in (("dp", {}), ("pp", dict(plan_ngpus=2, use_end2end=True, pas_config=pas))):
        torch._dynamo.reset()
        torch.manual_seed(1)
        other = EndToEndGPT(GPTConfig(layers=4))
        other_compiled = torch.compile(other, backend="dynshard", options=dynshard.Config(
            policy=policy, compiler="aot_eager", **options))
        other_opt = torch.optim.SGD(other.parameters(), lr=LR, momentum=0.9)
        if policy == "pp":     # after a first step: each rank holds its stages only, and loads only those
            dynshard.train_step(other_compiled, [make(2, 100 + i) for i in range(2)])
            other_opt.step()
        extra = dynshard.checkpoint.load(path, other_compiled, other_opt)
        results[policy] = {"extra": extra, "params": dynshard.collect_state_dict(other_compiled),
                           "held": sum(p.numel() for p in other.parameters())}
    return results


def meta_pipeline(rank: int, world: int, steps: int = 2) -> dict:
    """The tied GPT built on the meta device under pp (2 stages): initialised at the first train_step as one
    process initialises it module by module after the same seed, each rank keeping only its stages' tensors;
    next to that whole model trained on one process."""
    from workers_meta_init import _MEASURED, _held_bytes, init_module, measure_init_module

    _short_timeouts()
    cfg = GPTConfig(layers=4)
    make = lambda n, seed: dict(zip(("idx", "tgt"), gpt_batch(cfg, n, seed)))     # noqa: E731
    with torch.device("meta"):
        model = EndToEndGPT(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    _MEASURED.update(model=model, held=[])
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy="pp", plan_ngpus=2, use_end2end=True, compiler="aot_eager", param_init_fn=measure_init_module,
        pas_config={"pipeline_nmicros": 2}))
    torch.manual_seed(1234)
    losses = []
    for step in range(steps):
        losses.append([float(v) for v in dynshard.train_step(compiled, [make(2, 10 * step + i) for i in range(2)])])
        opt.step()
        opt.zero_grad()
    reference = EndToEndGPT(cfg)
    torch.manual_seed(1234)
    with torch.no_grad():
        for module in reference.modules():
            init_module(module)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    ref_losses = []
    for step in range(steps):
        step_losses = []
        for i in range(2):
            loss = reference(make(2, 10 * step + i))
            loss.backward()
            step_losses.append(float(loss.detach()))
        ref_losses.append(step_losses)
        ref_opt.step()
        ref_opt.zero_grad()
    largest = max(sum(t.numel() * t.element_size() for t in m.parameters(recurse=False)) for m in reference.modules())
    return {"losses": losses, "ref_losses": ref_losses, "params": dynshard.collect_state_dict(compiled),
            "ref_params": {k: v.detach() for k, v in reference.state_dict().items()},
            "held_during_init": _MEASURED["held"], "held_after": _held_bytes(model),
            "whole_bytes": _held_bytes(reference), "largest_module_bytes": largest,
            "tied_bytes": reference.wte.weight.numel() * 4}


def deferred_weight_gradients(rank: int, world: int, *args) -> dict:
    """:func:`pipeline_parity`, counting the weight gradients each W action adds (zero bubble)."""
    from dynshard.runtime.pipeline.deferred import DeferredWeightGradients

    counts, run = [], DeferredWeightGradients.run

    def counted(self, key):
        grads = run(self, key)
        counts.append(len(grads))
        return grads

    DeferredWeightGradients.run = counted
    try:
        result = pipeline_parity(rank, world, *args)
    finally:
        DeferredWeightGradients.run = run
    return {**result, "deferred": counts}


def two_models(rank: int, world: int, steps: int = 2) -> dict:
    """Two models of one graph, config and shapes (another seed), each compiled and trained with plain
    calls under pp in one process: each trains like its own one-process reference."""
    out = {}
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = EndToEndMLP()
        reference = copy.deepcopy(model)
        compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
            policy="pp", plan_ngpus=2, use_end2end=True, compiler="aot_eager", pas_config={"pipeline_nmicros": 2}))
        opts = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(reference.parameters(), lr=LR)
        out[seed] = train_beside(compiled, reference, opts,
                                 [(dict(zip(("x", "y"), mlp_batch(4, 10 * step + seed))),) for step in range(steps)])
    return out


def llama_labels_are_the_inputs(rank: int, world: int, steps: int = 2) -> dict:
    """transformers' Llama under pp, called as ``model(input_ids=ids, labels=ids)``: one tensor given twice is
    one graph input, so the re-trace at the micro-batch shape must give it to both arguments (before, labels
    went missing there and the loss with them). SGD with momentum beside one process."""
    from workers_trainer import LR, MOMENTUM, build_llama, dataset

    model = build_llama()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy="pp", plan_ngpus=2, use_end2end=True, compiler="aot_eager", pas_config={"pipeline_nmicros": 2}))
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in (model, reference)]
    rows = torch.stack([row["input_ids"] for row in dataset(4 * steps)])
    losses = []
    for step in range(steps):
        ids = rows[4 * step:4 * (step + 1)]
        pair = [m(input_ids=ids, labels=ids).loss for m in (compiled, reference)]
        for loss in pair:
            loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append([loss.item() for loss in pair])
    return {"losses": [a for a, _ in losses], "ref_losses": [b for _, b in losses],
            "params": dynshard.collect_state_dict(compiled),
            "ref_params": {k: v.detach().clone() for k, v in reference.state_dict().items()}}

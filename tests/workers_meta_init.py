"""Rank functions for the meta-device tests: a model built on the meta device, materialised by dynshard."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import dynshard
from dynshard.runtime.sharding import get_tag
from models import GPT, MLP, GPTConfig, gpt_batch, mlp_batch

SEED = 1234
LR = 0.05


class MetaGPT(nn.Module):
    """A GPT between modules its forward never uses: parameters (drawn from the RNG before and after the
    GPT's) and buffers that no compiled graph takes, which must still be materialised, in order."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.unused_pre = nn.Linear(8, 8)
        self.gpt = GPT(cfg)
        self.unused_norm = nn.BatchNorm1d(8)

    def forward(self, idx, targets):
        return self.gpt(idx, targets)


def init_module(module: nn.Module) -> None:
    """A param_init_fn: initialises the tensors ``module`` owns directly, drawing from the RNG."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.uniform_(module.bias, -0.1, 0.1)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    elif isinstance(module, nn.LayerNorm):
        nn.init.uniform_(module.weight, 0.9, 1.1)
        # a new object: dynshard moves its values into the original parameter, which optimizers hold
        module.bias = nn.Parameter(torch.empty_like(module.bias).uniform_(-0.1, 0.1))
    elif isinstance(module, nn.BatchNorm1d):
        module.reset_parameters()
        module.running_mean.uniform_(-1, 1)


_MEASURED: dict = {}     # the model measure_init_module watches, and what it saw


def measure_init_module(module: nn.Module) -> None:
    """init_module, recording the bytes the model's tensors hold when each module is initialised."""
    _MEASURED["held"].append(_held_bytes(_MEASURED["model"]))
    init_module(module)


def _held_bytes(model: nn.Module) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    return sum(storages.values())


def reset_parameters(module: nn.Module) -> None:
    """What dynshard does without a param_init_fn, for the reference."""
    if list(module.parameters(recurse=False)) or list(module.buffers(recurse=False)):
        module.reset_parameters()


def _reference(cfg: GPTConfig, init) -> nn.Module:
    """The same model built whole on the CPU and initialised with the same seed, module by module."""
    model = MetaGPT(cfg)
    torch.manual_seed(SEED)
    with torch.no_grad():
        for module in model.modules():
            init(module)
    return model


def _storage(model: nn.Module) -> dict[str, dict]:
    out = {}
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        tag = get_tag(tensor)
        out[name] = {"device": str(tensor.device), "numel": tensor.numel(),
                     "storage_numel": tensor.untyped_storage().nbytes() // tensor.element_size(),
                     "global_numel": tag.global_shape.numel() if tag is not None else tensor.numel(),
                     "split": bool(tag is not None and tag.is_split), "tagged": tag is not None}
    return out


def meta_training(rank: int, world: int, policy: str, plan_ngpus: int, use_zero: int, with_init_fn: bool,
                  measure: bool = False, steps: int = 2, batch: int = 4) -> dict:
    """Seed, build on meta, make the optimizer, compile, train ``steps`` SGD steps; next to the same on a
    whole CPU model initialised module by module after the same seed."""
    from torch._dynamo.utils import counters

    cfg = GPTConfig()
    init = init_module if with_init_fn else reset_parameters
    graphs = counters["stats"]["unique_graphs"]
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = MetaGPT(cfg)
    params_before = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)   # before the first step
    _MEASURED.update(model=model, held=[])
    config = dynshard.Config(policy=policy, plan_ngpus=plan_ngpus, compiler="aot_eager", use_zero=use_zero,
                             param_init_fn=(measure_init_module if measure else init_module) if with_init_fn else None)
    compiled = torch.compile(model, backend="dynshard", options=config)
    dp_rank, dp_size = dynshard.data_parallel_rank(plan_ngpus)
    rows = slice(dp_rank * batch, (dp_rank + 1) * batch)

    losses, initial, storage, held_after = [], None, None, 0
    for step in range(steps):
        idx, targets = gpt_batch(cfg, batch * dp_size, step)
        loss = compiled(idx[rows], targets[rows])          # the first step materialises the model
        if step == 0:
            initial = {k: v.clone() for k, v in dynshard.collect_state_dict(compiled).items()}  # whole ones are live
            storage = _storage(model)
            held_after = _held_bytes(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)          # units hold their rows' loss; ranks of a unit the same one
        losses.append(mean.item() / world)
    trained = dynshard.collect_state_dict(compiled)

    reference = _reference(cfg, init)           # seeds the same, after: the first step drew from SEED
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    ref_initial = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    ref_losses = []
    for step in range(steps):
        ref_loss = reference(*gpt_batch(cfg, batch * dp_size, step))
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_losses.append(ref_loss.item())
    return {
        "initial": initial, "ref_initial": ref_initial,
        "trained": trained, "ref_trained": {k: v.detach().clone() for k, v in reference.state_dict().items()},
        "losses": losses, "ref_losses": ref_losses, "storage": storage,
        "same_objects": all(a is b for a, b in zip(params_before, model.parameters()))
        and all(a is b for a, b in zip(params_before, optimizer.param_groups[0]["params"])),
        "momentum": sum("momentum_buffer" in optimizer.state[p] for p in model.parameters()),
        "trainable_in_graph": sum(not name.startswith("unused") for name, _ in model.named_parameters()),
        "tied": model.gpt.lm_head.weight is model.gpt.wte.weight,
        "dynamo_graphs": counters["stats"]["unique_graphs"] - graphs,
        # memory: what the model's tensors held at each initialiser call, after the first step, whole
        "held_during_init": _MEASURED["held"], "held_after": held_after,
        "whole_bytes": _held_bytes(reference),
        "largest_module_bytes": max(sum(t.numel() * t.element_size() for t in
                                        (*m.parameters(recurse=False), *m.buffers(recurse=False)))
                                    for m in reference.modules()),
        "tied_bytes": reference.gpt.wte.weight.numel() * reference.gpt.wte.weight.element_size(),
    }


def meta_training_cases(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """Several :func:`meta_training` runs in one job (one process start for all)."""
    return [meta_training(rank, world, *case) for case in cases]


def seeds_differ(rank: int, world: int) -> str:
    """Ranks seeded differently: the first step must refuse, on every rank, naming what differs."""
    torch.manual_seed(SEED + rank)
    with torch.device("meta"):
        model = MLP()
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(compiler="aot_eager"))
    try:
        compiled(*mlp_batch(4, 0))
    except Exception as error:      # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    return "no error"


def two_programs(rank: int, world: int, steps: int = 2) -> dict:
    """A graph break: the first program's first run materialises the whole model (and cuts its own
    tensors); the second program cuts its tensors, whole until then, on its own first run."""
    from workers import BrokenMLP

    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = BrokenMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    compiled = torch.compile(model, backend="dynshard",
                             options=dynshard.Config(policy="tp", plan_ngpus=2, compiler="aot_eager"))
    losses = []
    for step in range(steps):
        loss = compiled(*mlp_batch(4, step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    reference = BrokenMLP()
    torch.manual_seed(SEED)
    for module in reference.modules():
        reset_parameters(module)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    ref_losses = []
    for step in range(steps):
        loss = reference(*mlp_batch(4, step))
        loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_losses.append(loss.item())
    return {"losses": losses, "ref_losses": ref_losses, "trained": dynshard.collect_state_dict(compiled),
            "ref_trained": {k: v.detach().clone() for k, v in reference.state_dict().items()},
            "split": {name: get_tag(p) is not None and get_tag(p).is_split for name, p in model.named_parameters()}}

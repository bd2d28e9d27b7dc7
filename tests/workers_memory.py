"""Rank functions for the memory tests: ZeRO levels, accumulation, build_optimizer, gradient norms."""

from __future__ import annotations

import collections
import contextlib
import copy

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import dynshard
from dynshard.runtime.accumulation import job_accumulation
from workers import _unit_rows, build

LR = 0.05


class OpCounter(TorchDispatchMode):
    """Calls of the named ops (``"namespace::name"``) while active, compiled backward programs' included."""

    supports_higher_order_operators = True

    def __init__(self, names):
        super().__init__()
        self.names = set(names)
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = getattr(getattr(func, "_schema", None), "name", None)     # (higher-order ops have none)
        if name in self.names:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list({id(p): p for p in model.parameters()}.values())
    return {
        "params": sum(p.numel() * p.element_size() for p in params),
        "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optimizer": sum(v.numel() * v.element_size() for state in optimizer.state.values()
                         for v in state.values() if isinstance(v, torch.Tensor) and v.dim()),
    }


def train_case(rank: int, world: int, model_name: str, policy: str, plan_ngpus: int, case: dict,
               steps: int = 3, batch: int = 4) -> dict:
    """One training run under ``case`` (use_zero, accumulate, ... Config fields and test knobs) next to
    single-process eager training on the same global batches."""
    case = dict(case)
    accumulate = case.pop("accumulate", 1)
    builder = case.pop("optimizer", "plain")
    clip = case.pop("clip", None)
    # "torch": torch.nn.utils.clip_grad_norm_ (routed); "get_total_norm": accelerate's way since 1.16, the
    # public get_total_norm of the gradients (routed) and clip_grads_with_norm_
    clip_with = case.pop("clip_with", "dynshard")
    hooks = case.pop("hooks", False)
    counter = OpCounter(case.pop("count_ops", ()))
    model, make_batch = build(model_name)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy=policy, plan_ngpus=plan_ngpus, compiler=case.pop("compiler", "aot_eager"), **case))
    opt = dynshard.build_optimizer(compiled, _sgd) if builder == "build" else _sgd(model.parameters())
    ref_opt = _sgd(reference.parameters())
    hook_calls = {"pre": [], "post": []}
    if hooks:
        def record(kind):
            return lambda reducer, grad: hook_calls[kind].append((grad.dim(), grad.is_contiguous()))
        opt.register_reducer_pre_hook(record("pre"))
        opt.register_reducer_post_hook(record("post"))
    dp_rank, dp_size = dynshard.data_parallel_rank(plan_ngpus)
    losses, ref_losses, bytes_at_rest, flushes, norms = [], [], [], [], []
    stale_error = None
    for step in range(steps):
        global_batch = make_batch(batch * dp_size, step)
        unit = _unit_rows(global_batch, dp_rank, batch)
        before = job_accumulation().reducer.buckets_reduced
        total = 0.0
        for micro in range(accumulate):
            rows = tuple(t[micro * batch // accumulate:(micro + 1) * batch // accumulate] for t in unit)
            last = micro == accumulate - 1
            with contextlib.nullcontext() if last or accumulate == 1 else dynshard.no_sync(compiled):
                loss = compiled(*rows) / accumulate
                with counter if counter.names else contextlib.nullcontext():    # (backward only: Dynamo
                    # runs a frame eagerly under a dispatch mode)
                    loss.backward()
            total += loss.detach()
        ref_loss = _reference_backward(reference, global_batch, case.get("mixed_precision"))
        if clip is not None and clip_with == "torch":
            stale = torch.nn.utils.clip_grad_norm_.__wrapped__     # torch's own function, as imported early
            try:
                stale(model.parameters(), clip)
            except RuntimeError as error:
                stale_error = str(error)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        elif clip is not None and clip_with == "get_total_norm":
            params = [p for p in model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        elif clip is not None:
            norm = opt.clip_gnorm(clip) if builder == "build" else dynshard.clip_grad_norm_(model.parameters(), clip)
        if clip is not None:
            norms.append((norm.item(), torch.nn.utils.clip_grad_norm_(reference.parameters(), clip).item()))
        opt.step()
        flushes.append(job_accumulation().reducer.buckets_reduced - before)
        bytes_at_rest.append(_state_bytes(model, opt))
        opt.zero_grad()
        mean = total.clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    report = dynshard.explain(compiled)
    full = dynshard.collect_state_dict(compiled)
    relocated = dynshard.relocate_state_dict(compiled, full)
    for param in model.parameters():            # nnScaler's gnorm check: gradients = the weights
        param.grad = param.detach().clone()
    whole = [full[name] for name, _ in model.named_parameters()]
    weight_norms = (dynshard.clip_grad_norm_(model.parameters(), float("inf")).item(),
                    torch.linalg.vector_norm(torch.cat([w.flatten() for w in whole])).item())
    plans = [ref() for p in model.parameters() if (tag := dynshard.runtime.sharding.get_tag(p)) for ref in tag.plans]
    no_sync_collectives = sorted({(c.phase, c.kind, c.group) for plan in plans if plan is not None and
                                  plan._no_sync is not None for c in plan._no_sync.collectives})
    return {
        "losses": losses, "ref_losses": ref_losses, "params": full,
        "ref_params": {k: v.detach() for k, v in reference.state_dict().items()},
        "relocated_equals_local": all(torch.equal(relocated[k], v) for k, v in model.state_dict().items()),
        "collectives": [(c.phase, c.kind, c.group, c.bytes) for c in report.collectives()],
        "no_sync_collectives": no_sync_collectives,
        "op_calls": dict(counter.calls),
        "flush_buckets": flushes, "norms": norms, "stale_clip_error": stale_error, "weight_norms": weight_norms, "hook_calls": hook_calls,
        "bytes": bytes_at_rest[-1],
        "full_bytes": sum(v.numel() * v.element_size() for k, v in full.items()),
        "explain": str(report),
    }


def _reference_backward(reference: torch.nn.Module, batch, mixed_precision: dict | None) -> torch.Tensor:
    """Single-process eager loss and gradients; with mixed precision as FSDP2 computes it: a copy in
    param_dtype runs forward and backward, and its gradients update the fp32 parameters."""
    if not mixed_precision:
        loss = reference(*batch)
        loss.backward()
        return loss
    dtype = getattr(torch, mixed_precision["param_dtype"])
    low = copy.deepcopy(reference).to(dtype)
    loss = low(*(t.to(dtype) if t.is_floating_point() else t for t in batch))
    loss.backward()
    for param, low_param in zip(reference.parameters(), low.parameters()):
        param.grad = low_param.grad.to(param.dtype)
    return loss.float()


def train_cases(rank: int, world: int, model_name: str, policy: str, plan_ngpus: int, cases: list[dict]) -> list:
    results = []
    for case in cases:
        torch._dynamo.reset()
        results.append(train_case(rank, world, model_name, policy, plan_ngpus, case))
    return results


def optimizer_api(rank: int, world: int) -> dict:
    """build_optimizer's scale_grads, dynshard.GradScaler's agreed skip, and autocast computing as eager."""
    out: dict = {}
    model, make_batch = build("mlp")
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(use_zero=2, compiler="aot_eager"))
    opt = dynshard.build_optimizer(compiled, _sgd)
    x, y = _unit_rows(make_batch(8, 0), rank, 4)

    with torch.autocast("cpu", torch.bfloat16):
        out["autocast_losses"] = (compiled(x, y).item(), reference(x, y).item())

    compiled(x, y).backward()
    before = [p.grad.clone() for p in model.parameters()]
    opt.scale_grads(0.5)
    out["scaled"] = all(torch.equal(p.grad, g * 0.5) for p, g in zip(model.parameters(), before))
    opt.zero_grad()
    with dynshard.no_sync(compiled):
        compiled(x, y).backward()
    try:
        opt.scale_grads(2.0)
        out["scale_pending_error"] = None
    except RuntimeError as error:
        out["scale_pending_error"] = str(error)
    opt.sync_shard_grad()
    opt.zero_grad()

    scaler = dynshard.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(compiled(x, y)).backward()
    if rank == 1:                          # an inf in one rank's rows only
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    params = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    out["skipped"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    out["scale"] = scaler.get_scale()
    opt.zero_grad()
    scaler.scale(compiled(x, y)).backward()
    scaler.step(opt)
    scaler.update()
    out["stepped_after"] = not all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    out["submodule_errors"] = _compiled_submodule(rank)
    return out


def _compiled_submodule(rank: int) -> list[float]:
    """nnScaler's "parallelize submodules": only ``inner`` is compiled (ZeRO-1); build_optimizer also
    averages the head's gradient over the data-parallel ranks."""
    torch.manual_seed(0)
    whole = torch.nn.ModuleDict({"inner": torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                                              torch.nn.Linear(32, 16)),
                                 "head": torch.nn.Linear(16, 1)})
    reference = copy.deepcopy(whole)
    inner = torch.compile(whole["inner"], backend="dynshard", options=dynshard.Config(use_zero=1, compiler="aot_eager"))
    opt = dynshard.build_optimizer(whole, _sgd)
    ref_opt = _sgd(reference.parameters())
    _, make_batch = build("mlp")
    for step in range(2):
        x, y = make_batch(8, 10 + step)
        local_x, local_y = _unit_rows((x, y), rank, 4)
        torch.nn.functional.mse_loss(whole["head"](inner(local_x)).squeeze(-1), local_y).backward()
        opt.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(reference["head"](reference["inner"](x)).squeeze(-1), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = dynshard.collect_state_dict(whole)
    return [(full[k] - v).abs().max().item() for k, v in reference.state_dict().items()]

"""What each rank runs in tests/test_checkpoint.py (module level, so spawned processes can import it)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import dynshard
from dynshard.runtime.sharding import TAG_ATTR, full_tensor, get_tag
from models import GPT, GPTConfig, gpt_batch

CFG = GPTConfig(layers=1, fused_qkv=True, seq=15)   # fused c_attn: _StridedShard under tp; 15 position
                                                  # rows: a padding row under ZeRO over 2 ranks
BATCH = 4                                      # global batch rows per step
LR, MOMENTUM = 0.05, 0.9


def _build(policy: str, plan_ngpus: int, seed: int = 0, **options):
    # a new job in effect: without a reset, a second GPT of the same class runs the first one's program
    # on its whole (not yet sharded) parameters (seen here; to be looked at outside this test)
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = GPT(CFG)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy=policy, plan_ngpus=plan_ngpus, compiler="aot_eager", **options))
    return model, compiled, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def _step(compiled, opt, step: int, plan_ngpus: int) -> float:
    dp_rank, dp_size = dynshard.data_parallel_rank(plan_ngpus)
    idx, targets = gpt_batch(CFG, BATCH, step)
    rows = BATCH // dp_size
    loss = compiled(idx[dp_rank * rows:(dp_rank + 1) * rows], targets[dp_rank * rows:(dp_rank + 1) * rows])
    loss.backward()
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def _local(model, opt) -> dict:
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "momentum": {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}}


def _full_momentum(model, opt) -> dict:
    full = {}
    for name, param in model.named_parameters():
        buf = opt.state[param]["momentum_buffer"].detach().clone()
        if get_tag(param) is not None:
            setattr(buf, TAG_ATTR, get_tag(param))
        full[name] = full_tensor(buf).clone()
    return full


def resume_under_tp(rank: int, world: int, root: str) -> dict:
    """tp (plan 2): 2 steps, save, 2 steps (reference); a new model loads before its first step, another
    after one step of its own, and both train the same 2 steps."""
    model, compiled, opt = _build("tp", 2)
    for step in range(2):
        _step(compiled, opt, step, 2)
    path = os.path.join(root, "step2")
    torch.manual_seed(100 + rank)              # a per-rank RNG state to save
    dynshard.checkpoint.save(path, compiled, opt, extra={"step": 2})
    rng_at_save = torch.rand(3)
    # (collect_state_dict returns whole parameters themselves, not copies)
    saved_full = {k: v.clone() for k, v in dynshard.collect_state_dict(compiled).items()}
    saved_momentum = _full_momentum(model, opt)
    reference_losses = [_step(compiled, opt, step, 2) for step in (2, 3)]
    reference = _local(model, opt)
    strided = str(get_tag(model.blocks[0].attn.c_attn.weight).placements)

    results = {}
    for when in ("before_first_step", "after_first_step"):
        model2, compiled2, opt2 = _build("tp", 2, seed=1)
        if when == "after_first_step":
            _step(compiled2, opt2, 7, 2)
        torch.manual_seed(123 + len(results))      # replaced by the saved state
        extra = dynshard.checkpoint.load(dynshard.checkpoint.latest(root), compiled2, opt2)
        rng_after_load = torch.rand(3)
        losses = [_step(compiled2, opt2, step, 2) for step in (2, 3)]
        results[when] = {"extra": extra, "losses": losses, **_local(model2, opt2), "rng": rng_after_load}
    return {"reference_losses": reference_losses, "reference": reference, "saved_full": saved_full,
            "saved_momentum": saved_momentum, "results": results, "rng_at_save": rng_at_save, "strided": strided,
            "files": sorted(os.listdir(path))}


def reshard_and_train(rank: int, world: int, path: str, torch_save_file: str, policy: str,
                      plan_ngpus: int, zero: int, save_to: str | None = None, load_first: bool = False) -> dict:
    """Load a checkpoint saved under another plan, train 2 steps; one process does the same from the
    plain torch.save conversion of the checkpoint."""
    model, compiled, opt = _build(policy, plan_ngpus, seed=5, use_zero=zero)
    if not load_first:
        _step(compiled, opt, 9, plan_ngpus)         # parameters are this plan's pieces now
    dynshard.checkpoint.load(path, compiled, opt)
    losses = [_step(compiled, opt, step, plan_ngpus) for step in (2, 3)]
    full = {k: v.clone() for k, v in dynshard.collect_state_dict(compiled).items()}
    momentum = _full_momentum(model, opt)
    padded = [n for n, p in model.named_parameters()
              if get_tag(p) is not None and get_tag(p).zero is not None
              and get_tag(p).zero.padded_rows != get_tag(p).zero.rows]
    if save_to is not None:
        dynshard.checkpoint.save(save_to, compiled, opt, extra={"step": 4})

    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    saved = torch.load(torch_save_file, weights_only=False)
    reference = GPT(CFG)
    reference.load_state_dict(saved["model"], strict=True)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    set_optimizer_state_dict(reference, ref_opt, saved["optim"])
    ref_losses = []
    for step in (2, 3):
        loss = reference(*gpt_batch(CFG, BATCH, step))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    ref_momentum = {n: ref_opt.state[p]["momentum_buffer"] for n, p in reference.named_parameters()}
    zero_tagged = sum(1 for p in model.parameters() if get_tag(p) is not None and get_tag(p).zero is not None)
    return {"losses": losses, "ref_losses": ref_losses, "params": full, "momentum": momentum,
            "ref_params": {k: v.detach() for k, v in reference.state_dict().items()},
            "ref_momentum": ref_momentum, "zero_tagged": zero_tagged, "padded": padded}


def reshard_matrix(rank: int, world: int, path: str, torch_save_file: str, zero_path: str) -> dict:
    """tp -> dp, tp -> ZeRO-3 before the first step (saved again), ZeRO-3 -> tp (an exact copy)."""
    results = {"dp": reshard_and_train(rank, world, path, torch_save_file, "dp", 1, 0),
               "zero3": reshard_and_train(rank, world, path, torch_save_file, "dp", 1, 3, save_to=zero_path,
                                          load_first=True)}
    model, compiled, opt = _build("tp", 2, seed=9)
    _step(compiled, opt, 9, 2)
    extra = dynshard.checkpoint.load(zero_path, compiled, opt)
    back = {"extra": extra, "params": {k: v.clone() for k, v in dynshard.collect_state_dict(compiled).items()},
            "momentum": _full_momentum(model, opt)}
    return {"reshard": results, "zero3_to_tp": back}


def reshard_to_tp_x_dp(rank: int, world: int, path: str, torch_save_file: str) -> dict:
    """tp on 2 ranks -> tp 2 x dp 2 with ZeRO-1 rows of the tp shards, on 4 ranks."""
    return reshard_and_train(rank, world, path, torch_save_file, "tp", 2, 1)

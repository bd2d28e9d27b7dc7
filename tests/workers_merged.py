"""What each rank runs in tests/test_merged_state.py (module level, so spawned processes can import it)."""

from __future__ import annotations

import os

import torch

import dynshard
from dynshard.checkpoint.merged import (broadcast_weights, deduped_state_dict, load_deduped_state_dict,
                                        load_merged_state_dicts)
from dynshard.runtime.sharding import get_tag
from workers_checkpoint import _build, _full_momentum, _step

# (policy, plan_ngpus, use_zero): Megatron tp inside one unit (strided c_attn shards), and ZeRO-3 rows over
# two data-parallel units (wpe's 15 rows: a padding row)
CASES = {"tp": ("tp", 2, 0), "zero3": ("dp", 1, 3)}


def _state(compiled, model, opt) -> dict:
    return {"params": {k: v.clone() for k, v in dynshard.collect_state_dict(compiled).items()},
            "momentum": _full_momentum(model, opt)}


def _tensor_keys(state_dict: dict) -> list[str]:
    return sorted(k for k, v in state_dict.items() if isinstance(v, torch.Tensor))


def save_and_dedup(rank: int, world: int, root: str) -> dict:
    """Per case: 2 steps, then this rank's state dicts to files and a deduplicated copy; the rank's own
    files loaded back (strict) and 2 more steps; then the deduplicated copy loaded and the same 2 steps
    again. Then broadcast_weights."""
    results, compiled_models = {}, {}
    for case, (policy, plan_ngpus, zero) in CASES.items():
        folder = os.path.join(root, case)
        os.makedirs(folder, exist_ok=True)
        model, compiled, opt = _build(policy, plan_ngpus, use_zero=zero)
        compiled_models[case] = compiled
        for step in (0, 1):
            _step(compiled, opt, step, plan_ngpus)
        files = {what: os.path.join(folder, f"{what}_rank{rank}.pt") for what in ("model", "optim", "dedup")}
        torch.save(compiled.state_dict(), files["model"])
        torch.save(opt.state_dict(), files["optim"])
        dedup_model, dedup_optim = deduped_state_dict(compiled, opt)
        torch.save({"model": dedup_model, "optim": dedup_optim}, files["dedup"])
        saved = _state(compiled, model, opt)

        # a rank's own state dicts load back on it as they are (strict), and training goes on
        compiled.load_state_dict(torch.load(files["model"]), strict=True)
        opt.load_state_dict(torch.load(files["optim"]))
        continued = {"losses": [_step(compiled, opt, step, plan_ngpus) for step in (2, 3)],
                     **_state(compiled, model, opt)}

        # deduplicated: the model, 2 steps further now, loads it back (rank 1 receives what it dropped)
        dedup = torch.load(files["dedup"])
        load_deduped_state_dict(compiled, dedup["model"], opt, dedup["optim"])
        loaded_dedup = _state(compiled, model, opt)
        deduped = {"losses": [_step(compiled, opt, step, plan_ngpus) for step in (2, 3)],
                   **_state(compiled, model, opt)}
        results[case] = {"saved": saved, "continued": continued, "deduped": deduped, "loaded_dedup": loaded_dedup,
                         "dedup_keys": _tensor_keys(dedup_model), "all_keys": _tensor_keys(compiled.state_dict()),
                         "dedup_optim": sorted(dedup_optim["state"]), "all_optim": sorted(opt.state_dict()["state"])}
    results["broadcast"] = _broadcast_weights(rank, compiled_models["tp"])
    return results


def _broadcast_weights(rank: int, tp_compiled) -> dict:
    # (a) after a dp step (tagged, whole on every rank): rank 1 moves its weights, then gets rank 0's
    model, compiled, opt = _build("dp", 1)
    _step(compiled, opt, 0, 1)
    if rank == 1:
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    broadcast_weights(compiled, 1)
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    tagged = all(get_tag(p) is not None for p in model.parameters())
    # (b) a plain module, initialised differently on each rank
    torch.manual_seed(10 + rank)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    plain[1].running_mean.fill_(float(rank))
    plain_before = {k: v.clone() for k, v in plain.state_dict().items()}
    broadcast_weights(plain, 1)
    # (c) tp shards differ between ranks 1 apart: refused on every rank, before sending anything
    try:
        broadcast_weights(tp_compiled, 1)
        refused = None
    except ValueError as error:
        refused = str(error)
    broadcast_weights(tp_compiled, 2)      # a stride of the unit size: nothing to send on one unit
    return {"before": before, "after": after, "tagged": tagged, "plain_before": plain_before,
            "plain_after": {k: v.clone() for k, v in plain.state_dict().items()}, "refused": refused}


def load_merged(rank: int, world: int, root: str) -> dict:
    """A merged state dict (made offline from another plan's ranks) loaded into a new parallel model and
    optimizer, before its first step (tp) and after one (ZeRO-3); then the same 2 steps."""
    results = {}
    for case, source, before_first_step in (("tp", "zero3", True), ("zero3", "tp", False)):
        policy, plan_ngpus, zero = CASES[case]
        merged = torch.load(os.path.join(root, source, "merged.pt"))
        model, compiled, opt = _build(policy, plan_ngpus, seed=2, use_zero=zero)
        if not before_first_step:
            _step(compiled, opt, 7, plan_ngpus)
        load_merged_state_dicts(compiled, merged["model"], opt, merged["optim"])
        losses = [_step(compiled, opt, step, plan_ngpus) for step in (2, 3)]
        results[case] = {"losses": losses, **_state(compiled, model, opt),
                         "local_shapes": {n: tuple(p.shape) for n, p in model.named_parameters()}}
    return results

"""nnScaler's state-dict helpers: per-rank state dicts merged offline, loaded back under another plan,
deduplicated, and broadcast_weights."""

from __future__ import annotations

import collections
import copy
import os

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from dynshard.checkpoint.merged import merge_state_dicts
from models import GPT, gpt_batch
from parity import assert_losses_close, assert_tensors_close, assert_tensors_equal
from workers_checkpoint import BATCH, CFG, LR, MOMENTUM
from workers_merged import CASES, load_merged, save_and_dedup

TOL = {"rtol": 1e-5, "atol": 1e-6}    # SGD with momentum, held tighter than parity's standard (rtol 1e-4)


def _reference() -> dict:
    """One process, the whole batch: the state after steps 0-1, and steps 2-3 from there."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    names = [n for n, _ in model.named_parameters()]
    out = {}
    losses = []
    for step in range(4):
        loss = model(*gpt_batch(CFG, BATCH, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step in (1, 3):
            out[step] = {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                         "momentum": {n: opt.state[p]["momentum_buffer"].clone()
                                      for n, p in zip(names, model.parameters())}}
    out["losses"] = losses[2:]
    out["names"] = names
    return out


def _close_run(run: dict, ref: dict, what: str) -> None:
    assert_losses_close(run["losses"], ref["losses"], f"{what} losses")
    assert_tensors_close(run["params"], ref[3]["params"], f"{what} param", **TOL)
    assert_tensors_close(run["momentum"], ref[3]["momentum"], f"{what} momentum", **TOL)


def _momentum_by_name(optim_state: dict, names: list[str]) -> dict:
    return {names[i]: s["momentum_buffer"] for i, s in optim_state["state"].items()}


def test_merge_offline_load_merged_deduped_and_broadcast_weights(tmp_path, monkeypatch):
    root = str(tmp_path)
    ref = _reference()
    results = run_ranks(save_and_dedup, 2, root)

    # everything below runs offline, in this process: as one with no process group (the pass-level tests
    # may have left their fake one initialized)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for case in CASES:
        world = range(2)
        models = [torch.load(os.path.join(root, case, f"model_rank{r}.pt")) for r in world]   # weights_only
        optims = [torch.load(os.path.join(root, case, f"optim_rank{r}.pt")) for r in world]
        assert "dynshard_rank_state" in models[1]._metadata["_orig_mod"] and "dynshard_rank_state" in optims[1]
        full_model, full_optim = merge_state_dicts(models, optims)
        saved = results[0][case]["saved"]
        # exactly what the job gathered, and what one process computes
        assert_tensors_equal(full_model, saved["params"], f"{case} merged")
        assert_tensors_equal(_momentum_by_name(full_optim, ref["names"]), saved["momentum"], f"{case} merged momentum")
        assert_tensors_close(full_model, ref[1]["params"], f"{case} merged vs one process", **TOL)
        assert_tensors_close(_momentum_by_name(full_optim, ref["names"]), ref[1]["momentum"],
                             f"{case} merged momentum vs one process", **TOL)

        # the plain model (strict) and a plain SGD load it, and train on as one process does
        plain = GPT(CFG)
        plain.load_state_dict(full_model, strict=True)
        plain_opt = torch.optim.SGD(plain.parameters(), lr=LR, momentum=MOMENTUM)
        plain_opt.load_state_dict(copy.deepcopy(full_optim))   # torch's load keeps the tensors
        losses = []
        for step in (2, 3):
            loss = plain(*gpt_batch(CFG, BATCH, step))
            loss.backward()
            plain_opt.step()
            plain_opt.zero_grad()
            losses.append(loss.item())
        _close_run({"losses": losses, "params": {k: v.detach() for k, v in plain.state_dict().items()},
                    "momentum": {n: plain_opt.state[p]["momentum_buffer"]
                                 for n, p in zip(ref["names"], plain.parameters())}}, ref, f"{case} plain")
        torch.save({"model": full_model, "optim": full_optim}, os.path.join(root, case, "merged.pt"))

        # deduplicated state dicts: each piece on one rank only; together they merge to the same
        dedups = [torch.load(os.path.join(root, case, f"dedup_rank{r}.pt")) for r in world]
        dedup_model, dedup_optim = merge_state_dicts([d["model"] for d in dedups], [d["optim"] for d in dedups])
        assert_tensors_equal(dedup_model, full_model, f"{case} merged from deduped")
        assert_tensors_equal(_momentum_by_name(dedup_optim, ref["names"]), _momentum_by_name(full_optim, ref["names"]),
                             f"{case} merged momentum from deduped")
        for rank, result in enumerate(results):
            r = result[case]
            assert set(r["dedup_keys"]) <= set(r["all_keys"])
            if rank == 0:
                assert r["dedup_keys"] == r["all_keys"] and r["dedup_optim"] == r["all_optim"]
            _close_run(r["continued"], ref, f"{case} rank {rank} own state dicts reloaded")
            assert_tensors_equal(r["loaded_dedup"]["params"], saved["params"], f"{case} rank {rank} loaded deduped")
            assert_tensors_equal(r["loaded_dedup"]["momentum"], saved["momentum"],
                                 f"{case} rank {rank} loaded deduped momentum")
            _close_run(r["deduped"], ref, f"{case} rank {rank} deduped")
    # under tp, rank 1 keeps only its shards: the norms and biases of the row-split layers are rank 0's
    tp1 = results[1]["tp"]
    assert "_orig_mod.ln_f.weight" not in tp1["dedup_keys"] and "_orig_mod.blocks.0.fc1.weight" in tp1["dedup_keys"]
    assert len(tp1["dedup_optim"]) < len(tp1["all_optim"])
    # under ZeRO-3 every trainable tensor is rows of each rank: nothing to drop
    assert results[1]["zero3"]["dedup_keys"] == results[1]["zero3"]["all_keys"]

    # broadcast_weights: rank 1 ends with rank 0's weights
    b0, b1 = results[0]["broadcast"], results[1]["broadcast"]
    assert b1["tagged"]
    assert not torch.equal(b1["before"]["wpe.weight"], b0["before"]["wpe.weight"])
    assert_tensors_equal(b1["after"], b0["before"], "broadcast")
    assert_tensors_equal(b0["after"], b0["before"], "broadcast rank 0")
    assert not torch.equal(b1["plain_before"]["0.weight"], b0["plain_before"]["0.weight"])
    assert_tensors_equal(b1["plain_after"], b0["plain_before"], "broadcast plain")
    for b in (b0, b1):
        assert b["refused"] is not None and "different pieces" in b["refused"], b["refused"]

    # merged state dicts loaded into new parallel models, under the other plan, train on as one process does
    for rank, result in enumerate(run_ranks(load_merged, 2, root)):
        for case, r in result.items():
            _close_run(r, ref, f"rank {rank} {case} loaded merged")
        assert result["zero3"]["local_shapes"]["wpe.weight"] == (8, 32)         # 15 rows: 8 + 7 and a pad row
        assert result["tp"]["local_shapes"]["blocks.0.fc1.weight"] == (64, 32)


class _Layout:
    """What TensorInfo.of, local_shard and shard_rows read of a Layout, for one rank of a (dp, tp) grid."""

    placement_dims = ("tp",)

    def __init__(self, world_size: int, plan_ngpus: int, rank: int):
        self.world_size, self.plan_ngpus, self.rank = world_size, plan_ngpus, rank
        self.dp_rank = rank // plan_ngpus

    def size(self, dim: str) -> int:
        return {"tp": self.plan_ngpus, "dp": self.world_size // self.plan_ngpus}[dim]

    def coordinate(self, dim: str) -> int:
        return {"tp": self.rank % self.plan_ngpus, "dp": self.dp_rank}[dim]


@pytest.mark.parametrize("placement", ["shard0", "shard1", "strided0", "strided1", "replicate"])
@pytest.mark.parametrize("world,zero_group,zero_ngroups", [(2, 1, 1), (4, 1, 1), (6, 3, 1), (8, 2, 2)])
def test_merge_inverts_every_ranks_cut_and_dedup_keeps_one_copy(placement, world, zero_group, zero_ngroups):
    """Pieces cut by the runtime's own functions (tp shards, strided blocks, ZeRO rows with padding, HSDP
    replicas) from hand-made per-rank state dicts: merged back exactly, also when deduplicated."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from dynshard.checkpoint.rank_state import MARK, TensorInfo
    from dynshard.runtime.sharding import ShardTag, local_shard
    from dynshard.runtime.zero import ZeroSpec, shard_rows

    chosen = {"shard0": Shard(0), "shard1": Shard(1), "strided0": _StridedShard(0, split_factor=3),
              "strided1": _StridedShard(1, split_factor=5), "replicate": Replicate()}[placement]
    full = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10)
    step = torch.tensor(3.0)
    plan_ngpus = 2
    per_rank, deduped = [], []
    for rank in range(world):
        layout = _Layout(world, plan_ngpus, rank)
        tp_local = local_shard(full, layout, (chosen,))
        zero = None
        stored = tp_local
        if zero_group > 1:
            zero = ZeroSpec(level=3, group_size=zero_group, ngroups=zero_ngroups, rows=tp_local.shape[0])
            stored = shard_rows(tp_local, zero, layout.dp_rank % zero_group)
        tag = ShardTag(fqn="w", global_shape=full.shape, global_stride=full.stride(), placements=(chosen,),
                       layout=layout, zero=zero)
        info = TensorInfo.of(tag)
        assert info.stored_shape() == tuple(stored.shape)
        model = collections.OrderedDict([("_orig_mod.w", stored), ("_orig_mod.b", torch.ones(3))])
        model._metadata = {"": {"version": 1}, "_orig_mod": {"version": 1, MARK: {
            "format": 1, "rank": rank, "world_size": world, "tensors": {"w": info.to_dict()}}}}
        optim = {"state": {0: {"step": step, "exp_avg": stored * 2}, 1: {"step": step, "exp_avg": torch.ones(3)}},
                 "param_groups": [{"lr": 0.1, "params": [0, 1]}],
                 "dynshard_rank_state": {"format": 1, "rank": rank, "world_size": world,
                                         "params": {0: info.to_dict()}}}
        per_rank.append((model, optim))
        owner = info.owner(info.piece(rank))
        dedup_model = collections.OrderedDict(model)
        dedup_model._metadata = model._metadata
        for key, keeper in (("_orig_mod.w", owner), ("_orig_mod.b", 0)):
            if keeper != rank:
                del dedup_model[key]
        deduped.append((dedup_model, {**optim, "state": {i: s for i, s in optim["state"].items()
                                                         if (owner if i == 0 else 0) == rank}}))
    kept = sum("_orig_mod.w" in m for m, _ in deduped)
    assert kept == len(TensorInfo.of(tag).pieces())   # one copy of each piece
    for dicts in (per_rank, deduped[::-1]):            # any order of the ranks
        model, optim = merge_state_dicts([m for m, _ in dicts], [o for _, o in dicts])
        assert model.keys() == {"w", "b"} and model._metadata == {"": {"version": 1}}
        assert torch.equal(model["w"], full) and torch.equal(model["b"], torch.ones(3))
        assert optim.keys() == {"state", "param_groups"}
        assert torch.equal(optim["state"][0]["exp_avg"], full * 2) and torch.equal(optim["state"][0]["step"], step)
    info = TensorInfo.of(tag)
    without_rank1 = [m for m, _ in per_rank if m._metadata["_orig_mod"][MARK]["rank"] != 1]
    if sum(info.piece(r) == info.piece(1) for r in range(world)) == 1:     # rank 1's piece is its alone
        with pytest.raises(ValueError, match="no state dict holds the piece"):
            merge_state_dicts(without_rank1)
    else:
        assert torch.equal(merge_state_dicts(without_rank1)[0]["w"], full)


def test_rank_entry_lives_in_the_metadata_keys_stay_the_modules():
    """The entry sits in the state dict's _metadata: keys and values are the module's own (extra state
    included), a strict load takes the dict back, and a dict rebuilt without _metadata is refused."""
    from dynshard.checkpoint.rank_state import MARK, hook_module
    from dynshard.runtime.sharding import TAG_ATTR, ShardTag

    class WithExtra(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.extra = {"epoch": 1}

        def get_extra_state(self):
            return dict(self.extra)

        def set_extra_state(self, state):
            self.extra = dict(state)

    outer = torch.nn.Sequential(WithExtra())
    module = outer[0]
    layout = _Layout(1, 1, 0)
    layout.placement_dims = ()
    weight = module.lin.weight
    setattr(weight, TAG_ATTR, ShardTag(fqn="lin.weight", global_shape=weight.shape, global_stride=weight.stride(),
                                       placements=(), layout=layout))
    hook_module(module.lin)
    hook_module(module)
    hook_module(module)                             # idempotent
    state = outer.state_dict()
    assert list(state) == list(torch.nn.Sequential(WithExtra()).state_dict())   # the module's keys, nothing more
    assert state["0._extra_state"] == {"epoch": 1}
    assert state._metadata["0"][MARK]["tensors"].keys() == {"lin.weight"}
    assert MARK not in state._metadata["0.lin"]     # covered by the outer hooked module's entry
    state["0._extra_state"] = {"epoch": 2}
    outer.load_state_dict(state, strict=True)
    assert module.extra == {"epoch": 2}
    merged, _ = merge_state_dicts([state])
    assert merged["0._extra_state"] == {"epoch": 2} and torch.equal(merged["0.lin.weight"], weight.detach())
    assert all(MARK not in meta for meta in merged._metadata.values())
    with pytest.raises(ValueError, match="_metadata"):
        merge_state_dicts([{k: v for k, v in state.items()}])

"""dynshard.checkpoint: sharded DCP saves, bitwise resume, resharding between plans, plain-model export."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import dynshard
from distributed import run_ranks
from models import GPT
from parity import assert_tensors_equal, assert_trains_like_one_process
from workers_checkpoint import CFG, reshard_matrix, reshard_to_tp_x_dp, resume_under_tp


def test_checkpoint_resume_reshard_and_export(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_ranks(resume_under_tp, 2, root)
    assert "_StridedShard" in results[0]["strided"], results[0]["strided"]
    assert results[0]["files"] == [".metadata", "COMPLETE", "__0_0.distcp", "__1_0.distcp"]
    path = os.path.join(root, "step2")
    # each element is written once (replicas deduplicated, no gathering), by both ranks between them
    metadata = dcp.FileSystemReader(path).read_metadata()
    for key, md in metadata.state_dict_metadata.items():
        if hasattr(md, "chunks"):
            assert sum(c.sizes.numel() for c in md.chunks) == md.size.numel(), key
    assert {info.relative_path for info in metadata.storage_data.values()} == {"__0_0.distcp", "__1_0.distcp"}
    chunks = metadata.state_dict_metadata["model.blocks.0.attn.c_attn.weight"].chunks
    assert len(chunks) == 6, chunks          # q, k and v blocks of each rank's strided shard

    # (1) bitwise resume under the same plan, loaded before the first step and after it
    for rank, result in enumerate(results):
        for when, resumed in result["results"].items():
            assert resumed["extra"] == {"step": 2}
            assert resumed["losses"] == result["reference_losses"], f"rank {rank} {when}"
            assert_tensors_equal(resumed["params"], result["reference"]["params"], f"rank {rank} {when} param")
            assert_tensors_equal(resumed["momentum"], result["reference"]["momentum"], f"rank {rank} {when} momentum")
            # this rank's RNG state is the one it saved
            assert torch.equal(resumed["rng"], result["rng_at_save"]), f"rank {rank} {when} rng"
    assert not torch.equal(results[0]["rng_at_save"], results[1]["rng_at_save"])

    # (3) the DCP checkpoint converts to a torch.save file that the plain model loads
    torch_save_file = str(tmp_path / "full.pt")
    dcp_to_torch_save(path, torch_save_file)
    saved = torch.load(torch_save_file, weights_only=False)
    plain = GPT(CFG)
    plain.load_state_dict(saved["model"], strict=True)
    assert_tensors_equal({k: v.detach() for k, v in plain.state_dict().items()}, results[0]["saved_full"], "export")
    assert_tensors_equal({k: v["momentum_buffer"] for k, v in saved["optim"]["state"].items()},
                         {k: v for k, v in results[0]["saved_momentum"].items()}, "export momentum")

    # (2) saved under tp (plan 2), loaded under dp and ZeRO-3 on 2 ranks, trained like one process
    zero_path = str(tmp_path / "zero3" / "step4")
    matrix = run_ranks(reshard_matrix, 2, path, torch_save_file, zero_path)
    for rank, result in enumerate(matrix):
        for case, r in result["reshard"].items():
            if case == "zero3":
                assert r["zero_tagged"] > 0 and "wpe.weight" in r["padded"], r["padded"]
            assert_trains_like_one_process(r, f"rank {rank} {case}", tensor_keys=("params", "momentum"))
    _assert_zero3_checkpoint(matrix, tmp_path, zero_path)

    # tp (2 ranks) -> tp 2 x dp 2 with ZeRO-1 rows of the tp shards (4 ranks)
    for rank, r in enumerate(run_ranks(reshard_to_tp_x_dp, 4, path, torch_save_file)):
        assert r["zero_tagged"] > 0
        assert_trains_like_one_process(r, f"rank {rank} tp x dp zero1", tensor_keys=("params", "momentum"))


def _assert_zero3_checkpoint(matrix, tmp_path, zero_path):
    # saved from ZeRO-3 rows (padding left out): the plain model loads it, equal to the gathered values
    saved_zero = matrix[0]["reshard"]["zero3"]
    dcp_to_torch_save(zero_path, str(tmp_path / "zero3.pt"))
    exported = torch.load(str(tmp_path / "zero3.pt"), weights_only=False)
    plain = GPT(CFG)
    plain.load_state_dict(exported["model"], strict=True)
    assert_tensors_equal({k: v.detach() for k, v in plain.state_dict().items()}, saved_zero["params"], "zero3 export")
    assert_tensors_equal({k: v["momentum_buffer"] for k, v in exported["optim"]["state"].items()},
                         saved_zero["momentum"], "zero3 export momentum")
    # and loaded under tp it is exactly what was saved
    for rank, result in enumerate(matrix):
        back = result["zero3_to_tp"]
        assert back["extra"] == {"step": 4}
        assert_tensors_equal(back["params"], saved_zero["params"], f"rank {rank} zero3 -> tp")
        assert_tensors_equal(back["momentum"], saved_zero["momentum"], f"rank {rank} zero3 -> tp momentum")


def test_latest_skips_partial_saves(tmp_path):
    for name, complete in [("step10", True), ("step20", True), ("step30.tmp-abc", False), ("step40", False)]:
        os.makedirs(tmp_path / name)
        if complete:
            (tmp_path / name / "COMPLETE").write_text("ok\n")
    assert dynshard.checkpoint.latest(str(tmp_path)) == str(tmp_path / "step20")
    assert dynshard.checkpoint.latest(str(tmp_path / "missing")) is None


def test_save_and_load_in_one_process_replace_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(*__import__("models").gpt_batch(CFG, 2, 0)).backward()
    opt.step()
    path = str(tmp_path / "step1")
    dynshard.checkpoint.save(path, model, opt, extra={"step": 0})
    dynshard.checkpoint.save(path, model, opt, extra={"step": 1})     # replaces it atomically
    assert sorted(os.listdir(tmp_path)) == ["step1"]
    other = GPT(CFG)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    assert dynshard.checkpoint.load(path, other, other_opt) == {"step": 1}
    assert_tensors_equal(other.state_dict(), model.state_dict(), "param")
    for p, q in zip(model.parameters(), other.parameters()):
        assert_tensors_equal(opt.state[p], other_opt.state[q], "adamw state")


class _FakeLayout:
    """What chunks_of reads of a Layout, for one rank of a (dp, tp) grid."""

    placement_dims = ("tp",)

    def __init__(self, tp_size: int, tp_rank: int, dp_size: int, dp_rank: int):
        self.sizes, self.coordinates = {"tp": tp_size, "dp": dp_size}, {"tp": tp_rank, "dp": dp_rank}
        self.dp_rank = dp_rank

    def size(self, dim: str) -> int:
        return self.sizes[dim]

    def coordinate(self, dim: str) -> int:
        return self.coordinates[dim]


@pytest.mark.parametrize("placement", ["shard0", "shard1", "strided0", "strided1", "replicate"])
@pytest.mark.parametrize("zero_group", [1, 2, 4, 5])   # 4, 5: padding rows, a rank with none
def test_pieces_of_every_rank_tile_the_global_tensor_without_padding(placement, zero_group):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from dynshard.checkpoint.state import chunks_of
    from dynshard.runtime.sharding import ShardTag, local_shard
    from dynshard.runtime.zero import ZeroSpec, shard_rows

    full = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10)
    chosen = {"shard0": Shard(0), "shard1": Shard(1), "strided0": _StridedShard(0, split_factor=3),
              "strided1": _StridedShard(1, split_factor=5), "replicate": Replicate()}[placement]
    tp = 2
    covered = torch.zeros_like(full, dtype=torch.int64)
    seen = set()
    for dp_rank in range(zero_group):
        for tp_rank in range(tp):
            layout = _FakeLayout(tp, tp_rank, zero_group, dp_rank)
            tp_local = local_shard(full, layout, (chosen,))
            zero = ZeroSpec(level=3, group_size=zero_group, ngroups=1, rows=tp_local.shape[0]) \
                if zero_group > 1 else None
            stored = shard_rows(tp_local, zero, dp_rank) if zero else tp_local
            tag = ShardTag(fqn="w", global_shape=full.shape, global_stride=full.stride(), placements=(chosen,),
                           layout=layout, zero=zero)
            for chunk in chunks_of(stored, tag):
                region = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
                assert torch.equal(chunk.local, full[region]), (dp_rank, tp_rank, chunk.offsets)
                key = (tuple(chunk.offsets), tuple(chunk.sizes))
                if key not in seen:          # replicas describe the same chunk; DCP writes it once
                    seen.add(key)
                    covered[region] += 1
    assert bool((covered == 1).all()), covered


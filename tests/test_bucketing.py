"""Gradient buckets in the graph: which Inductor settings each configuration gives, and that Inductor
knows them (a renamed setting fails here, not silently in a user's job)."""

from __future__ import annotations

import torch

from dynshard import Config
from dynshard.backend.compiler import bucketing_patches, gather_buckets_copied_out
from dynshard.backend.plan_and_compile import _bucket_cap_mb


def _patches(config: Config, zero: bool, cuda: bool) -> dict:
    return bucketing_patches(zero, _bucket_cap_mb(config), config.use_async_reducer and cuda)


def test_all_reduces_always_go_in_buckets_and_zero_adds_gathers_and_reduce_scatters():
    assert _patches(Config(), zero=False, cuda=False) == {"bucket_all_reduces_fx": "all"}
    zero = _patches(Config(use_zero=3), zero=True, cuda=False)
    assert zero == {"bucket_all_reduces_fx": "all", "bucket_all_gathers_fx": "only_fsdp",
                    "bucket_reduce_scatters_fx": "all", "bucket_all_gathers_bucket_mode": "custom_ops",
                    "bucket_reduce_scatters_bucket_mode": "custom_ops"}


def test_async_reducer_uses_25_mb_buckets_and_overlap_scheduling_only_on_gpu():
    cpu = _patches(Config(use_zero=2, use_async_reducer=True), zero=True, cuda=False)
    caps = {k: v(0) for k, v in cpu.items() if k.endswith("determinator")}
    assert caps == {f"bucket_{kind}_fx_bucket_size_determinator": 25
                    for kind in ("all_reduces", "all_gathers", "reduce_scatters")}
    assert not any(k.startswith("aten_distributed_optimizations") for k in cpu)
    gpu = _patches(Config(use_zero=2, use_async_reducer=True), zero=True, cuda=True)
    assert gpu["aten_distributed_optimizations.enable_overlap_scheduling"] is True


def test_an_explicit_bucket_cap_wins():
    patches = _patches(Config(reducer_bucket_cap_mb=4, use_async_reducer=True), zero=False, cuda=False)
    assert patches["bucket_all_reduces_fx_bucket_size_determinator"](3) == 4


def test_inductor_knows_every_setting_dynshard_patches():
    patches = _patches(Config(use_zero=1, use_async_reducer=True), zero=True, cuda=True)
    with torch._inductor.config.patch(patches):
        pass


def test_a_gathered_bucket_is_copied_out_as_each_parameter_gathered_along_rows():
    from dynshard.runtime.gathered_bucket import copy_out

    shapes = [torch.Size([3, 4]), torch.Size([2]), torch.Size([1, 2, 3])]
    group = 2
    shards = [[torch.randn(shape) for shape in shapes] for _ in range(group)]      # per rank
    gathered = torch.cat([torch.cat([s.flatten() for s in rank]) for rank in shards])
    outs = copy_out(gathered, group, shapes)
    for index, out in enumerate(outs):
        assert out.is_contiguous()
        assert torch.equal(out, torch.cat([rank[index] for rank in shards]))
    torch.library.opcheck(torch.ops.dynshard.copy_out_gathered,
                          (gathered, group, [d for s in shapes for d in s], [len(s) for s in shapes]))


def _merged(ag_ins, group_name, group_size, dtype, out_dtypes, rank):
    from torch._inductor.fx_passes import bucketing

    with gather_buckets_copied_out():
        return bucketing.all_gather_merge_fn_to_trace_custom_ops(ag_ins, group_name, group_size, dtype,
                                                                out_dtypes, rank)


def test_a_gathered_bucket_is_the_same_code_on_every_rank_of_the_group():
    """Inductor's FX graph cache does not key the rank: ranks with one program read one entry."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def traced(rank: int, dtypes) -> str:
        ag_ins = [torch.randn(4, 3), torch.randn(6)]
        fn = lambda *shards: _merged(list(shards), "7", 4, torch.float32, dtypes, rank)   # noqa: E731
        return make_fx(fn, tracing_mode="fake")(*ag_ins).code

    for dtypes in ([torch.float32, torch.float32], [torch.float32, torch.bfloat16]):
        codes = {traced(rank, dtypes) for rank in range(4)}
        assert len(codes) == 1, codes


def test_overlapping_compiles_keep_the_rank_free_merge_until_the_last_one_ends():
    from torch._inductor.fx_passes import bucketing

    inductor_merge = bucketing.all_gather_merge_fn_to_trace_custom_ops
    first, second = gather_buckets_copied_out(), gather_buckets_copied_out()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)          # (another thread's compile ends first)
    assert bucketing.all_gather_merge_fn_to_trace_custom_ops is not inductor_merge
    second.__exit__(None, None, None)
    assert bucketing.all_gather_merge_fn_to_trace_custom_ops is inductor_merge

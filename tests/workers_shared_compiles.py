"""What the shared-compile tests run, on one spawned rank (module level, so spawned processes can import
it): the test process may already hold a default process group (the pass tests' fake world)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from dynshard.backend.compiler import inductor_compile, shared_compiles


def _world_of_one() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _all_reduce_graph(group_name: str) -> torch.fx.GraphModule:
    def fn(x):
        return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", group_name))
    return make_fx(fn)(torch.ones(3))


def _group_names(graph: torch.fx.GraphModule) -> list[str]:
    return [node.args[2] for node in graph.graph.nodes if node.target is torch.ops._c10d_functional.all_reduce.default]


def names_groups_by_shape(rank: int, world: int) -> None:
    _world_of_one()
    group = dist.new_group([0])
    graph = shared_compiles.groups_named_by_shape(_all_reduce_graph(group.group_name))
    assert _group_names(graph) == ["dynshard:0"]
    assert torch.equal(graph(torch.ones(3)), torch.ones(3))
    # a second group of the same shape on this rank gets a name of its own
    other = dist.new_group([0])
    assert shared_compiles.group_alias(other.group_name) == "dynshard:0#1"
    assert shared_compiles.group_alias(group.group_name) == "dynshard:0"


def renames_after_a_destroyed_group(rank: int, world: int) -> None:
    _world_of_one()
    group = dist.new_group([0])
    assert shared_compiles.group_alias(group.group_name) == "dynshard:0"
    dist.destroy_process_group(group)
    del group
    again = dist.new_group([0])
    assert shared_compiles.group_alias(again.group_name) == "dynshard:0"
    graph = shared_compiles.groups_named_by_shape(_all_reduce_graph(again.group_name))
    assert torch.equal(graph(torch.ones(3)), torch.ones(3))


def shares_nothing_under_overlap_scheduling(rank: int, world: int) -> None:
    _world_of_one()
    group = dist.new_group([0])
    seen = []
    compile_graph = lambda graph, inputs: seen.append(_group_names(graph))      # noqa: E731
    overlap = {"aten_distributed_optimizations.enable_overlap_scheduling": True}
    with torch._inductor.config.patch(overlap):
        shared_compiles.compile_shared(compile_graph, _all_reduce_graph(group.group_name), [torch.ones(3)])
        assert "rank 0" in inductor_compile._DYNSHARD_COMPILE.uuid()
    shared_compiles.compile_shared(compile_graph, _all_reduce_graph(group.group_name), [torch.ones(3)])
    assert seen == [[group.group_name], ["dynshard:0"]]
    assert "rank 0" not in inductor_compile._DYNSHARD_COMPILE.uuid()


def _lock_path(graph, inputs) -> str:
    directory = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "dynshard_compiles")
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, f"{shared_compiles.graph_digest(graph, inputs)}.lock")


def compiles_when_the_lock_is_held_too_long(rank: int, world: int) -> str:
    import logging

    from filelock import FileLock

    _world_of_one()
    shared_compiles.LOCK_TIMEOUT_S = 0.2
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("dynshard").addHandler(handler)
    group = dist.new_group([0])
    graph, inputs = _all_reduce_graph(group.group_name), [torch.ones(3)]
    shared_compiles.groups_named_by_shape(graph)
    with FileLock(_lock_path(graph, inputs)):
        compiled = shared_compiles.compile_shared(lambda g, i: "compiled", graph, inputs)
    assert compiled == "compiled"
    assert any("compiling it here too" in message for message in warnings), warnings


def compiles_side_by_side_once_bypassed(rank: int, world: int) -> None:
    from filelock import FileLock, Timeout
    from torch._dynamo.utils import counters

    _world_of_one()
    group = dist.new_group([0])
    graph, inputs = _all_reduce_graph(group.group_name), [torch.ones(3)]
    shared_compiles.groups_named_by_shape(graph)
    lock = _lock_path(graph, inputs)

    def held_by_this_compile() -> bool:
        probe = FileLock(lock, timeout=0)
        try:
            probe.acquire()
        except Timeout:
            return True
        probe.release()
        return False

    def bypassing_compile(g, i):
        counters["inductor"]["fxgraph_cache_bypass"] += 1
        return held_by_this_compile()

    assert shared_compiles.compile_shared(bypassing_compile, graph, inputs) is True      # the first: locked
    assert shared_compiles.compile_shared(bypassing_compile, graph, inputs) is False     # then: side by side


def unpacks_a_bucket_of_several_dtypes(rank: int, world: int) -> None:
    from torch._inductor.fx_passes import bucketing

    from dynshard.backend.compiler import gather_buckets_copied_out

    _world_of_one()
    ag_ins = [torch.randn(4, 3), torch.randn(6).to(torch.bfloat16), torch.randn(2, 2)]
    out_dtypes = [torch.float32, torch.bfloat16, torch.bfloat16]
    with gather_buckets_copied_out():
        merge = bucketing.all_gather_merge_fn_to_trace_custom_ops
        outs = merge(ag_ins, dist.group.WORLD.group_name, 1, torch.float32, out_dtypes, 0)
        same = merge(ag_ins[:1], dist.group.WORLD.group_name, 1, torch.float32, [torch.float32], 0)
    for shard, out, dtype in zip(ag_ins, outs, out_dtypes):
        assert out.dtype == dtype and out.shape == shard.shape
        assert torch.equal(out, shard.to(dtype))
    assert torch.equal(same[0], ag_ins[0])

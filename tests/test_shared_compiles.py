"""Process groups named by their shape, and when ranks may share compiles (one process, a gloo group of
one; the multi-rank behaviour is in test_compile_cache.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from dynshard.compat import inductor, shared_compiles


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _all_reduce_graph(group_name: str) -> torch.fx.GraphModule:
    def fn(x):
        return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", group_name))
    return make_fx(fn)(torch.ones(3))


def _group_names(graph: torch.fx.GraphModule) -> list[str]:
    return [node.args[2] for node in graph.graph.nodes if node.target is torch.ops._c10d_functional.all_reduce.default]


def test_a_graph_names_its_groups_by_shape_and_still_runs(world_of_one):
    group = dist.new_group([0])
    graph = shared_compiles.groups_named_by_shape(_all_reduce_graph(group.group_name))
    assert _group_names(graph) == ["dynshard:0"]
    assert torch.equal(graph(torch.ones(3)), torch.ones(3))
    # a second group of the same shape on this rank gets a name of its own
    other = dist.new_group([0])
    assert shared_compiles.group_alias(other.group_name) == "dynshard:0#1"
    assert shared_compiles.group_alias(group.group_name) == "dynshard:0"


def test_the_name_of_a_destroyed_group_goes_to_the_next_group_of_its_shape(world_of_one):
    group = dist.new_group([0])
    assert shared_compiles.group_alias(group.group_name) == "dynshard:0"
    dist.destroy_process_group(group)
    del group
    again = dist.new_group([0])
    assert shared_compiles.group_alias(again.group_name) == "dynshard:0"
    graph = shared_compiles.groups_named_by_shape(_all_reduce_graph(again.group_name))
    assert torch.equal(graph(torch.ones(3)), torch.ones(3))


def test_ranks_do_not_share_compiles_where_a_compile_runs_collectives_or_bakes_the_rank_in(world_of_one):
    group = dist.new_group([0])
    seen = []
    compile_graph = lambda graph, inputs: seen.append(_group_names(graph))      # noqa: E731
    overlap = {"aten_distributed_optimizations.enable_overlap_scheduling": True}
    with torch._inductor.config.patch(overlap):
        shared_compiles.compile_shared(compile_graph, _all_reduce_graph(group.group_name), [torch.ones(3)])
        assert "rank 0" in inductor._DYNSHARD_COMPILE.uuid()
    shared_compiles.compile_shared(compile_graph, _all_reduce_graph(group.group_name), [torch.ones(3)])
    assert seen == [[group.group_name], ["dynshard:0"]]
    assert "rank 0" not in inductor._DYNSHARD_COMPILE.uuid()


def test_a_rank_compiles_a_graph_itself_when_another_holds_it_too_long(world_of_one, tmp_path, monkeypatch, caplog):
    from filelock import FileLock

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(shared_compiles, "LOCK_TIMEOUT_S", 0.2)
    group = dist.new_group([0])
    graph, inputs = _all_reduce_graph(group.group_name), [torch.ones(3)]
    shared_compiles.groups_named_by_shape(graph)
    held = FileLock(str(tmp_path / "dynshard_compiles" / f"{shared_compiles.graph_digest(graph, inputs)}.lock"))
    (tmp_path / "dynshard_compiles").mkdir()
    with held:
        compiled = shared_compiles.compile_shared(lambda g, i: "compiled", graph, inputs)
    assert compiled == "compiled"
    assert "compiling it here too" in caplog.text


def test_ranks_compile_a_graph_side_by_side_once_the_cache_bypassed_it(world_of_one, tmp_path, monkeypatch):
    from filelock import FileLock, Timeout
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    group = dist.new_group([0])
    graph, inputs = _all_reduce_graph(group.group_name), [torch.ones(3)]
    shared_compiles.groups_named_by_shape(graph)
    lock = str(tmp_path / "dynshard_compiles" / f"{shared_compiles.graph_digest(graph, inputs)}.lock")

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

"""What the aot-cache naming tests run, on one spawned rank with a gloo group of one (module level, so
spawned processes can import it; the test process may hold the pass tests' fake default group)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from dynshard.backend.compiler import cache_names
from dynshard.passes.grad_sync import GradSync
from dynshard.passes.insert_collectives import place_fn, split_output_fn, wrap_input_fn
from dynshard.passes.outline_repeated_blocks import _Boundary


class _Layout:
    """The one field the wrapper factories read."""

    def __init__(self, mesh):
        self.tp_mesh = mesh


def _calling(*functions) -> fx.GraphModule:
    graph = fx.Graph()
    value = graph.placeholder("x")
    for function in functions:
        value = graph.call_function(function, (value,))
    graph.output(value)
    return fx.GraphModule(torch.nn.Module(), graph)


def _not_dynshards(x):
    return x


def _targets(gm: fx.GraphModule) -> list:
    return [node.target for node in gm.graph.nodes if node.op == "call_function"]


def names_functions_by_what_they_capture(rank: int, world: int) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    layout = _Layout(init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    group = dist.new_group([0]).group_name
    syncing = GradSync(dp_group=group)
    accumulating = GradSync(dp_group=group, communicate=False)    # the no-sync variant: same code, one flag

    def wrap(sync):
        return wrap_input_fn(layout, [Replicate()], [Replicate()], (4,), (1,), sync)

    gm = _calling(wrap(syncing), wrap(accumulating), wrap(syncing), place_fn(layout, [Shard(0)]))
    assert cache_names.program_functions_named(gm)
    first, second, third, place = _targets(gm)
    # two closures of one state in one program: one copy serves both; the no-sync flag names another
    assert first is third and first is not second, (first, second)
    for function in (first, second, place):
        # importable by its name, which aot_autograd's key pickles; the name carries the digest
        assert getattr(cache_names, function.__qualname__) is function
        assert function.__module__ == cache_names.__name__
    assert first.__qualname__.startswith("wrap_input_") and place.__qualname__.startswith("place_")
    nodes = [node for node in gm.graph.nodes if node.op == "call_function"]
    assert all(node.meta["is_wrapped"] and node.meta["user_cache_hash"] for node in nodes)
    assert first.__qualname__ in gm.code
    # the same state on another group of the same shape: the same name (ranks of one program share it)
    other = GradSync(dp_group=dist.new_group([0]).group_name)
    again = _calling(wrap(other))
    assert cache_names.program_functions_named(again)
    assert _targets(again)[0] is not first      # "#1": the second group of that shape, named apart
    # another program of the same state: the same name, but a copy of its own (the last one named is the
    # one importable), so that no program calls into another's cells
    same = _calling(wrap(GradSync(dp_group=group)))
    assert cache_names.program_functions_named(same)
    assert _targets(same)[0].__qualname__ == first.__qualname__ and _targets(same)[0] is not first
    assert getattr(cache_names, first.__qualname__) is _targets(same)[0]
    # a function that is not dynshard's keeps the program out (the source digest covers only dynshard)
    foreign = _calling(wrap(syncing), _not_dynshards)
    assert not cache_names.program_functions_named(foreign)
    # a state the program writes while it is traced (gather_outputs=False's output specs) keeps the
    # program out of the cache, untouched
    split = split_output_fn(layout, 0, {})
    kept = _calling(wrap(syncing), split)
    code = kept.code
    assert not cache_names.program_functions_named(kept)
    assert kept.code == code and _targets(kept)[1] is split
    # an outlined block's boundary is named by its block; the specs its trace records stay its own
    earlier, later = _Boundary("dynshard_block_0"), _Boundary("dynshard_block_0")
    named = [_calling(boundary.localize("input")) for boundary in (earlier, later)]
    assert all(cache_names.program_functions_named(gm) for gm in named)
    cells = [{id(cell.cell_contents) for cell in _targets(gm)[0].__closure__} for gm in named]
    assert id(earlier) in cells[0] and id(later) in cells[1] and id(earlier) not in cells[1]
    dist.destroy_process_group()

"""TorchShard's helpers: slice, register_parallel_dim / register_parallel_attribute / get_parallel_dim, and
register_ddp_parameters_to_ignore (DDP around a model of which one submodule is compiled with dynshard)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import dynshard
from distributed import run_ranks
from dynshard.runtime.mesh import Layout
from dynshard.runtime.parallel_attributes import get_order_type
from dynshard.runtime.sharding import TAG_ATTR, ShardTag, get_tag
from parity import assert_trains_like_one_process
from workers_parallel_attributes import Block, ddp_and_tensor_parallel

# ---------------------------------------------------------------------------------------------- slice


def test_slice_returns_every_chunk_as_torch_split_does():
    tensor = torch.arange(30.).reshape(3, 10)
    chunks = dynshard.slice(tensor, 2, dim=-1)
    assert isinstance(chunks, tuple) and [c.shape for c in chunks] == [torch.Size([3, 5])] * 2
    for got, expected in zip(chunks, torch.split(tensor, 5, dim=-1)):
        assert torch.equal(got, expected)
    rows = dynshard.slice(tensor, 3, dim=0)
    assert [r.tolist() for r in rows] == [[row] for row in tensor.tolist()]


def test_slice_without_a_dim_splits_the_last_dimension():
    tensor = torch.randn(2, 3, 8)
    chunks = dynshard.slice(tensor, 4)
    assert [c.shape for c in chunks] == [torch.Size([2, 3, 2])] * 4
    assert torch.equal(torch.cat(chunks, dim=-1), tensor)


def test_slice_gives_views_unless_asked_for_contiguous_chunks():
    tensor = torch.randn(3, 10)
    views = dynshard.slice(tensor, 2, dim=1)
    assert all(v.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr() for v in views)
    assert not views[0].is_contiguous()
    copies = dynshard.slice(tensor, 2, dim=1, contiguous=True)
    assert all(c.is_contiguous() for c in copies)
    assert all(torch.equal(c, v) for c, v in zip(copies, views))


def test_slice_refuses_what_does_not_divide():
    with pytest.raises(ValueError, match="does not divide into 3 parts"):
        dynshard.slice(torch.empty(3, 10), 3, dim=1)
    with pytest.raises(ValueError, match="num_partitions"):
        dynshard.slice(torch.empty(4), 0)
    with pytest.raises(ValueError, match="0-dimensional"):
        dynshard.slice(torch.tensor(1.), 1)


def test_slice_does_not_replace_the_builtin_outside_dynshard():
    assert dynshard.slice is not slice and slice(1, 2) == slice(1, 2)

# -------------------------------------------------------------------------------------- parallel dims


def test_register_parallel_dim_is_what_get_parallel_dim_returns():
    data = torch.empty(20, 30)
    assert dynshard.get_parallel_dim(data) is None
    dynshard.register_parallel_dim(data, -1)
    assert dynshard.get_parallel_dim(data) == -1
    dynshard.register_parallel_dim(data, 0)
    assert dynshard.get_parallel_dim(data) == 0
    dynshard.register_parallel_dim(data, None)
    assert dynshard.get_parallel_dim(data) is None
    assert get_tag(data) is None     # registering never makes a tensor look sharded by dynshard


def test_register_parallel_dim_on_a_parameter_keeps_it_a_parameter():
    param = torch.nn.Parameter(torch.empty(4, 6))
    dynshard.register_parallel_dim(param, 1)
    assert isinstance(param, torch.nn.Parameter) and dynshard.get_parallel_dim(param) == 1


def test_register_parallel_dim_refuses_a_dimension_the_tensor_does_not_have():
    with pytest.raises(ValueError, match="not a dimension"):
        dynshard.register_parallel_dim(torch.empty(2, 3), 2)
    with pytest.raises(ValueError, match="not a dimension"):
        dynshard.register_parallel_dim(torch.empty(2, 3), -3)
    with pytest.raises(TypeError):
        dynshard.register_parallel_dim(torch.empty(2, 3), "1")


def test_register_parallel_attribute_records_the_dim_and_the_order_type():
    param = torch.empty(20, 30)
    assert get_order_type(param) == 0
    dynshard.register_parallel_attribute(param, -1, 1)
    assert dynshard.get_parallel_dim(param) == -1 and get_order_type(param) == 1
    dynshard.register_parallel_attribute(param, 0)
    assert dynshard.get_parallel_dim(param) == 0 and get_order_type(param) == 0
    with pytest.raises(ValueError, match="order_type"):
        dynshard.register_parallel_attribute(param, 0, 2)


def _tag(tensor: torch.Tensor, placements) -> ShardTag:
    layout = Layout(world_size=1, rank=0, plan_ngpus=1, device_type="cpu", mesh=None)
    tag = ShardTag(fqn="w", global_shape=tensor.shape, global_stride=tuple(tensor.stride()),
                   placements=placements, layout=layout)
    setattr(tensor, TAG_ATTR, tag)
    return tag


@pytest.mark.parametrize("placements,expected", [((Shard(1),), 1), ((Shard(0),), 0), ((Replicate(),), None),
                                                 ((), None)], ids=["shard1", "shard0", "replicate", "unit-of-one"])
def test_dynshard_tag_wins_over_a_registered_dim(placements, expected):
    for register_first in (True, False):
        tensor = torch.empty(4, 6)
        if register_first:
            dynshard.register_parallel_dim(tensor, -1)
        tag = _tag(tensor, placements)
        if not register_first:
            dynshard.register_parallel_dim(tensor, -1)
        assert dynshard.get_parallel_dim(tensor) == expected
        assert get_tag(tensor) is tag and tag.placements == placements

# ------------------------------------------------------------------------- register_ddp_parameters_to_ignore


def test_register_ddp_parameters_to_ignore_lists_registered_parameters_as_torchshard_does():
    model = torch.nn.ModuleDict({"layer1": torch.nn.Linear(20, 20), "layer2": torch.nn.Linear(20, 30)})
    for param in model["layer2"].parameters():
        dynshard.register_parallel_dim(param, -1)
    assert dynshard.register_ddp_parameters_to_ignore(model) == ["layer2.weight", "layer2.bias"]
    assert model._ddp_params_and_buffers_to_ignore == ["layer2.weight", "layer2.bias"]
    assert all(getattr(p, "_ddp_ignored", False) for p in model["layer2"].parameters())
    assert not any(hasattr(p, "_ddp_ignored") for p in model["layer1"].parameters())


def test_a_parameter_registered_as_whole_is_left_to_ddp():
    model = torch.nn.ModuleDict({"layer": torch.nn.Linear(2, 2)})
    dynshard.register_parallel_dim(model["layer"].weight, None)
    assert dynshard.register_ddp_parameters_to_ignore(model) == []


class _Outer(torch.nn.Module):
    def __init__(self, body: torch.nn.Module):
        super().__init__()
        self.embed, self.body, self.head = torch.nn.Linear(8, 16), body, torch.nn.Linear(16, 4)


_DYNSHARD = {"policy": "dp", "compiler": "aot_eager"}
_BODY = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "scale"]


def test_a_submodule_compiled_with_dynshard_is_ignored_before_its_first_run():
    model = _Outer(torch.compile(Block(), backend="dynshard", options=dynshard.Config(**_DYNSHARD)))
    assert dynshard.register_ddp_parameters_to_ignore(model) == [f"body._orig_mod.{n}" for n in _BODY]


def test_a_submodule_compiled_in_place_with_dynshard_is_ignored():
    body = Block()
    body.compile(backend="dynshard", options=dynshard.Config(**_DYNSHARD))
    model = _Outer(body)
    assert dynshard.register_ddp_parameters_to_ignore(model) == [f"body.{n}" for n in _BODY]


def test_a_submodule_compiled_with_another_backend_is_left_to_ddp():
    inplace = Block()
    inplace.compile(backend="aot_eager")
    model = torch.nn.ModuleDict({"a": torch.compile(Block(), backend="aot_eager"), "b": inplace})
    assert dynshard.register_ddp_parameters_to_ignore(model) == []


def test_a_whole_model_compiled_with_dynshard_is_ignored_entirely():
    model = torch.compile(Block(), backend="dynshard", options=dynshard.Config(**_DYNSHARD))
    assert dynshard.register_ddp_parameters_to_ignore(model) == [f"_orig_mod.{n}" for n in _BODY]


def test_tagged_tensors_and_shared_parameters_are_ignored_under_every_name():
    model = _Outer(Block())
    tied = torch.nn.Parameter(torch.randn(4, 16))
    model.head.weight = tied
    model.extra = torch.nn.Linear(16, 4)
    model.extra.weight = tied
    _tag(tied, (Shard(0),))
    _tag(model.body.scale, ())
    assert dynshard.register_ddp_parameters_to_ignore(model) == ["head.weight", "extra.weight", "body.scale"]


def test_a_root_parameter_is_also_listed_under_the_name_ddp_gives_it_in_its_reducer():
    model = _Outer(Block())
    model.gain = torch.nn.Parameter(torch.ones(4))
    dynshard.register_parallel_dim(model.gain, 0)
    assert dynshard.register_ddp_parameters_to_ignore(model) == ["gain", ".gain"]


def test_names_already_registered_for_ddp_are_kept_and_not_repeated():
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["a.bias"])
    dynshard.register_parallel_dim(model["b"].weight, 0)
    assert dynshard.register_ddp_parameters_to_ignore(model) == ["a.bias", "b.weight"]
    assert dynshard.register_ddp_parameters_to_ignore(model) == ["a.bias", "b.weight"]

# ----------------------------------------------------------------------------------------- two ranks


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(ddp_and_tensor_parallel, 2)


def test_ddp_around_a_dynshard_submodule_trains_like_one_process(two_ranks):
    for rank, result in enumerate(two_ranks):
        assert_trains_like_one_process(result, f"rank {rank}")


def test_ddp_reduces_only_what_dynshard_does_not(two_ranks):
    body = [f"body._orig_mod.{n}" for n in _BODY]
    for result in two_ranks:
        assert result["ignored"] == body
        assert set(result["ddp_ignores"]) == set(body)
        # dynshard tagged and reduced its parameters itself (one all-reduce over dp in its backward) ...
        assert result["dynshard_params"] == sorted(n for n in body if n != "body._orig_mod.scale")
        assert result["dynshard_collectives"] == [("backward", "all_reduce", "dp")]
        # ... and DDP's buckets held every other parameter and none of dynshard's
        outer = sorted(set(result["all_params"]) - set(body))
        assert result["reduced_by_ddp"] == outer == ["embed.bias", "embed.weight", "gain", "head.bias",
                                                     "head.weight"]
        assert result["refused_ddp_module"]


def test_tags_of_tensors_dynshard_shards_win_over_registered_dims(two_ranks):
    for result in two_ranks:
        tp = result["tp"]
        assert tp["dims"] == tp["tag_dims"]
        assert tp["dims"]["fc1.weight"] == 0 and tp["dims"]["fc2.weight"] == 1, tp
        assert tp["local_shapes"]["fc1.weight"] == (16, 16) and tp["local_shapes"]["fc2.weight"] == (16, 16)
        assert tp["order_type"] == 1
        assert tp["activation_dim"] == -1

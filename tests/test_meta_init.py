"""A model built on the meta device: each rank materialises only its shards, with one process's values."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from distributed import run_ranks
from parity import assert_tensors_equal, assert_trains_like_one_process
from dynshard import Config, ConfigError
from dynshard.runtime import materialize
from workers_meta_init import init_module, meta_training_cases, seeds_differ, two_programs


def assert_materialised_like_one_process(result: dict, rank: int) -> None:
    # bitwise: the same draws, sliced
    assert_tensors_equal(result["initial"], result["ref_initial"], f"rank {rank} initial values")
    # SGD with momentum, held tighter than parity's standard (rtol 1e-5, not 1e-4)
    assert_trains_like_one_process(result, f"rank {rank}", rtol=1e-5, tensor_keys=("trained",))
    assert result["same_objects"], "the parameters (and the optimizer's) are no longer the objects built on meta"
    assert result["momentum"] == result["trainable_in_graph"], "the optimizer built before the first step did not step"
    assert result["tied"]
    assert result["dynamo_graphs"] == 1, "materialising the model made Dynamo compile again"
    storage = result["storage"]
    assert all(s["device"] == "cpu" for s in storage.values())
    for name, s in storage.items():     # a split tensor holds its piece only, in storage of the piece's size
        assert s["storage_numel"] == s["numel"], f"{name}: storage of {s['storage_numel']} for {s['numel']} elements"
        if s["split"]:
            assert s["numel"] < s["global_numel"], name
    unused = {name for name in storage if name.startswith("unused")}
    assert unused == {"unused_pre.weight", "unused_pre.bias", "unused_norm.weight", "unused_norm.bias",
                      "unused_norm.running_mean", "unused_norm.running_var", "unused_norm.num_batches_tracked"}
    assert not any(storage[name]["tagged"] for name in unused), "tensors no graph uses stay whole and untagged"


def test_tensor_parallel_meta_model_initialises_like_one_process_with_and_without_param_init_fn():
    ranks = run_ranks(meta_training_cases, 2, [("tp", 2, 0, True, True), ("tp", 2, 0, False)])
    for rank, (with_fn, without_fn) in enumerate(ranks):
        for result in (with_fn, without_fn):
            assert_materialised_like_one_process(result, rank)
            assert sum(s["split"] for s in result["storage"].values()) > 10   # tp split most of the GPT
        # while initialising, the model's tensors hold at most their local pieces, one module whole, and
        # the tied embedding whole until its last owner (the LM head) is initialised: never the whole model
        held = with_fn["held_during_init"]
        assert len(held) == 22, "one call per module owning tensors: 2 unused, 2 embeddings, 2 x 8 in blocks, 2"
        bound = with_fn["held_after"] + with_fn["largest_module_bytes"] + with_fn["tied_bytes"]
        assert max(held) <= bound < with_fn["whole_bytes"], (held, bound, with_fn["whole_bytes"])
        # the two initialisers drew different values: the comparison above is not trivially true
        assert not torch.equal(with_fn["initial"]["gpt.blocks.0.fc1.weight"],
                               without_fn["initial"]["gpt.blocks.0.fc1.weight"])


def test_zero3_meta_model_stores_only_its_rows():
    ranks = run_ranks(meta_training_cases, 2, [("dp", 1, 3, True)])
    for rank, (result,) in enumerate(ranks):
        assert_materialised_like_one_process(result, rank)
        in_graph = [s for name, s in result["storage"].items() if not name.startswith("unused")]
        assert all(s["split"] for s in in_graph), "ZeRO-3 splits every trainable parameter the graph uses"


def test_a_later_program_cuts_the_tensors_the_first_materialised_whole():
    for rank, result in enumerate(run_ranks(two_programs, 2)):
        assert_trains_like_one_process(result, f"rank {rank}", rtol=1e-5, tensor_keys=("trained",))
        assert result["split"]["up1.weight"] and result["split"]["up2.weight"], result["split"]


def test_ranks_seeded_differently_are_refused_naming_the_tensors():
    for message in run_ranks(seeds_differ, 2):
        assert message.startswith("MetaInitError: dynshard: ranks initialised different values for blocks.0.0.weight")
        assert "seed every rank the same" in message


class Scale(nn.Module):
    """Owns a parameter and has no reset_parameters()."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale


def test_meta_module_without_reset_parameters_or_param_init_fn_is_a_clear_error():
    materialize.install()      # the fixture's torch._dynamo.reset() dropped the hook dynshard installs at import
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    compiled = torch.compile(model, backend="dynshard", options=Config(compiler="aot_eager"))
    with pytest.raises(Exception, match=r"'1' \(Scale\) own meta parameters or buffers but have no "
                                        r"reset_parameters\(\); pass Config\(param_init_fn=init\)"):
        compiled(torch.randn(2, 4))
    assert model[1].scale.is_meta, "nothing was materialised"


def test_param_init_fn_is_a_callable_or_an_import_path_and_is_in_the_plan_key():
    assert Config(param_init_fn=init_module).param_init_fn is init_module
    assert Config(param_init_fn="workers_meta_init:init_module").param_init_fn is init_module
    assert Config(param_init_fn="workers_meta_init.init_module").param_init_fn is init_module
    env = {"DYNSHARD_PARAM_INIT_FN": "workers_meta_init:init_module"}
    assert Config.from_options(None, environ=env).param_init_fn is init_module
    with pytest.raises(ConfigError, match="param_init_fn must be a callable"):
        Config(param_init_fn=3)
    with pytest.raises(ConfigError, match="cannot import param_init_fn 'no_such_module:init'"):
        Config(param_init_fn="no_such_module:init")
    with pytest.raises(ConfigError, match="does not name a callable"):
        Config(param_init_fn="workers_meta_init:SEED")
    assert "param_init_fn" in Config.fields()
    token = json.loads(Config(param_init_fn=init_module).cache_token())
    assert token["param_init_fn"] == "workers_meta_init.init_module"
    assert json.loads(Config().cache_token())["param_init_fn"] is None
    assert Config(param_init_fn=init_module).cache_token() == Config(param_init_fn=init_module).cache_token()


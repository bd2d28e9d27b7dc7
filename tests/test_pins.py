"""Pins (``Config.partition_constraints``, autodist's ``partition_constraints_path``): the user holds a
parameter or module to a placement, the policy plans around it, and the job trains like one process; and
``dynshard.why_not``, which prices a placement the plan did not take by pinning it."""

from __future__ import annotations

import json
import re

import pytest
import torch

import dynshard
from distributed import run_ranks
from dynshard.config import ConfigError
from dynshard.policies import PlanError
from models import GPT, GPTConfig, gpt_batch
from parity import assert_trains_like_one_process
from plans import plan_for
from workers import train_parity
from workers_autodist import offline_autodist, why_not_pinned

PINS = {"blocks.*.fc1": "replicate", "wte.weight": "replicate", "blocks.0.attn.q.weight": "S1"}


@pytest.fixture
def _world(fake_world):
    pass


def test_pinned_tensors_take_their_placement_and_tp_plans_the_rest_around_them(_world):
    torch.manual_seed(0)
    plan = plan_for(GPT(GPTConfig()), gpt_batch(GPTConfig(), 4, 0), policy="tp", plan_ngpus=2,
                    partition_constraints=PINS).plan
    tp = {name: t.tp for name, t in plan.tensors.items()}
    assert tp["wte.weight"] == "R" and tp["blocks.0.attn.q.weight"] == "S1"
    assert tp["blocks.0.fc1.weight"] == tp["blocks.1.fc1.bias"] == "R"
    assert tp["blocks.0.fc2.weight"] == "R"            # its Megatron partner is whole: the pair stays whole
    assert tp["blocks.1.attn.q.weight"] == "S0"        # what no pin covers, the policy places as always


@pytest.mark.parametrize("pins,message", [
    ({"wte.weight": "S"}, "pin 'replicate' or 'S<dim>'"),
    ({"wte.weight": 0}, "pin 'replicate' or 'S<dim>'"),
    ({"": "R"}, "patterns are non-empty strings"),
    (["wte.weight"], "maps parameter or module patterns"),
])
def test_bad_pins_are_config_errors_that_say_what_to_write(pins, message):
    with pytest.raises(ConfigError, match=message):
        dynshard.Config(policy="tp", plan_ngpus=2, partition_constraints=pins)


def test_a_pin_that_cannot_split_its_tensor_evenly_is_a_plan_error(_world):
    torch.manual_seed(0)
    with pytest.raises(Exception) as raised:       # (Dynamo wraps what its backend raises)
        plan_for(GPT(GPTConfig()), gpt_batch(GPTConfig(), 4, 0), policy="tp", plan_ngpus=2,
                 partition_constraints={"ln_f.bias": "S1"})
    error = raised.value
    while error is not None and not isinstance(error, PlanError):
        error = error.__cause__ or getattr(error, "inner_exception", None)
    assert error is not None, raised.value
    assert re.search(r"pins ln_f.bias \[32\] to S1, but dim 1 does not split evenly over 2 tp ranks", str(error))


def test_the_constraints_file_is_read_and_nnscalers_operator_form_is_refused(tmp_path):
    good, theirs = tmp_path / "pins.json", tmp_path / "nnscaler.json"
    good.write_text(json.dumps({"pins": PINS}))
    theirs.write_text(json.dumps([{"name": "torch.matmul", "allowed_partition_dims": ["0,0"]}]))
    config = dynshard.Config(policy="autodist", plan_ngpus=2, pas_config={"partition_constraints_path": str(good)})
    assert dict(config.partition_constraints) == {**PINS, "wte.weight": "R", "blocks.*.fc1": "R"}
    with pytest.raises(ConfigError, match="looks like nnScaler's per-operator constraints"):
        dynshard.Config(policy="autodist", plan_ngpus=2, pas_config={"partition_constraints_path": str(theirs)})
    with pytest.raises(ConfigError, match="cannot read the partition constraints file"):
        dynshard.Config(policy="autodist", plan_ngpus=2, pas_config={"partition_constraints_path": str(tmp_path / "x")})


def test_a_pinned_tp_plan_trains_like_one_process():
    results = run_ranks(train_parity, 2, "gpt", "tp", 2, "aot_eager", 3, 4, {"partition_constraints": PINS},
                        timeout=300)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")
        plan = json.loads(result["plans"][0])
        assert plan["tensors"]["blocks.0.attn.q.weight"]["tp"] == "S1"


@pytest.mark.parametrize("pinned", [pytest.param(("blocks.*.attn",), marks=pytest.mark.slow), ("wte", "blocks.*.attn")],
                         ids=["attention", "vocabulary"])      # (attention alone: transformers' Llama, test_transformers_tp)
def test_layers_pinned_whole_run_on_batch_shards_under_batch_parallel_and_train_like_one_process(pinned):
    """tp's batch parallelism with attention pinned whole: attention runs on each rank's batch rows (data
    parallelism inside the unit, its weights' gradients all-reduced), the MLP split over the unit. With the
    vocabulary whole too, the token lookup's output is split along the batch where it is made (a local slice),
    so the first block's attention runs on the batch shard as the others do."""
    options = {"partition_constraints": dict.fromkeys(pinned, "replicate"), "pas_config": {"batch_parallel": True}}
    results = run_ranks(train_parity, 2, "gpt", "tp", 2, "inductor", 3, 4, options, timeout=300)
    for rank, result in enumerate(results):
        assert_trains_like_one_process(result, f"rank {rank}")
        plan = json.loads(result["plans"][0])
        assert plan["tensors"]["blocks.0.attn.q.weight"]["tp"] == "R"
        assert plan["tensors"]["blocks.0.fc1.weight"]["tp"] == "S0"
        assert {a["tp"] for a in plan["activations"].values()} == {"R", "S0"}
        lookup = {key: a["tp"] for key, a in plan["activations"].items() if key.startswith("wte:")}
        assert lookup == {"wte:aten.embedding.default:0": "S0"}, lookup     # (reduce-scattered, or sliced)


def test_autodists_choice_holds_the_pins_of_its_constraints_file(tmp_path):
    path = tmp_path / "pins.json"
    path.write_text(json.dumps({"pins": {"wpe.weight": "S1", "blocks.*.fc2": "replicate"}}))
    plan = json.loads(run_ranks(offline_autodist, 1, 4, {"partition_constraints_path": str(path)}, timeout=300)[0])
    assert plan["tensors"]["wpe.weight"]["tp"] == "S1"       # no placement splits it by itself
    assert {t["tp"] for name, t in plan["tensors"].items() if ".fc2." in name} == {"R"}


def test_why_not_prices_the_placement_autodist_did_not_take():
    text = run_ranks(why_not_pinned, 1, {"blocks.*.fc1": "S0"}, None, timeout=300)[0]
    chosen, pinned, moved = text.splitlines()
    assert chosen.startswith("program 0: autodist chose ") and "with blocks.*.fc1 -> S0: autodist chose" in pinned
    assert int(re.search(r"\(([+-]\d+)% time", pinned)[1]) >= 0      # the pinned space is inside the searched one
    assert "blocks.0.fc1.weight" in moved and "blocks.1.fc1.weight" in moved


@pytest.mark.slow       # (two searches: about 10 s)
def test_why_not_says_when_no_plan_holding_the_pins_fits():
    everything = {"blocks.*": "replicate", "wte.weight": "replicate", "wpe.weight": "replicate"}
    text = run_ranks(why_not_pinned, 1, everything, 0.0003, timeout=300)[0]
    assert text.startswith("with blocks.* -> replicate") and "no plan fits" in text and "mem_constraint" in text

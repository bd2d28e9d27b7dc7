"""dynshard.Plan as a value: its JSON as a reviewer reads it, its round trip, its checks, the keys that name a
graph's values, a callable policy's choices (recompute), and explain on plans."""

from __future__ import annotations

import dataclasses

import expecttest
import pytest
import torch

import dynshard
from dynshard.planning import Plan, PlanFileError
from dynshard.planning.costs import memory_at_rest, step_collectives
from dynshard.policies import tp
from models import GPT, MLP, GPTConfig, gpt_batch, mlp_batch
from plans import plan_for


@pytest.fixture(autouse=True)
def _world(fake_world):
    pass


def tp_with_recompute(plan, config) -> None:
    """The tp policy, and the blocks recomputed: a callable chooses recompute through the PlanBuilder."""
    tp(plan, config)
    plan.recompute("Block")


def _returned(code: str) -> int:
    """How many values a forward program returns (its output and what it saves for the backward)."""
    last = [line for line in code.splitlines() if line.strip().startswith("return ")][-1]
    return last.count(",") + 1


class TestPlanValue(expecttest.TestCase):
    def test_the_tp_plan_of_an_mlp_reads_as_json_one_tensor_per_line(self):
        torch.manual_seed(0)
        plan = plan_for(MLP(dim=8, hidden=16, layers=1), mlp_batch(4, 0, dim=8), policy="tp", plan_ngpus=2).plan
        self.assertExpectedInline(plan.to_json(), """\
{
  "dynshard_plan": 1,
  "made_for": {"graph": "5f45d155db63b251", "world_size": 2, "modes": "grad=True autocast=off default_dtype=torch.float32"},
  "policy": "tp",
  "mesh": {"world": 2, "dp": 1, "pp": 1, "tp": 2},
  "zero": {"level": 0, "ngroups": 1, "reduce_scatter": false},
  "tensors": {
    "blocks.0.0.weight": {"kind": "parameter", "shape": [16, 8], "dtype": "float32", "tp": "S0", "dp": "replicate"},
    "blocks.0.0.bias": {"kind": "parameter", "shape": [16], "dtype": "float32", "tp": "S0", "dp": "replicate"},
    "x": {"kind": "input", "shape": [4, 8], "dtype": "float32", "tp": "R", "dp": "batch"},
    "blocks.0.2.weight": {"kind": "parameter", "shape": [8, 16], "dtype": "float32", "tp": "S1", "dp": "replicate"},
    "blocks.0.2.bias": {"kind": "parameter", "shape": [8], "dtype": "float32", "tp": "R", "dp": "replicate"},
    "head.weight": {"kind": "parameter", "shape": [1, 8], "dtype": "float32", "tp": "R", "dp": "replicate"},
    "head.bias": {"kind": "parameter", "shape": [1], "dtype": "float32", "tp": "R", "dp": "replicate"},
    "y": {"kind": "input", "shape": [4], "dtype": "float32", "tp": "R", "dp": "batch"}
  },
  "activations": {},
  "recompute": [],
  "mixed_precision": null,
  "pipeline": null,
  "predicted": {"forward_collectives": [{"at": "blocks.0.2:aten.mm.default:0", "kind": "all_reduce", "dim": "tp", "bytes": 128}]}
}
""")
        again = Plan.from_json(plan.to_json())
        assert again == plan and again.to_json() == plan.to_json()     # byte-identical round trip
        assert again.digest() == plan.digest()
        assert plan.with_tensor("blocks.0.0.weight", tp="R").digest() != plan.digest()

    def test_sequence_parallel_activations_are_keyed_by_module_op_and_occurrence(self):
        torch.manual_seed(0)
        plan = plan_for(GPT(GPTConfig(layers=1)), gpt_batch(GPTConfig(layers=1), 2, 0), policy="tp", plan_ngpus=2,
                        pas_config={"sequence_parallel": True}).plan
        assert plan.activations, "sequence parallelism places activations"
        for key, choice in plan.activations.items():
            path, op, occurrence = key.split(":")
            assert (op.startswith("aten.") or op == "getitem") and occurrence.isdigit() and choice.tp in ("R", "S1")
        assert any(key.startswith("blocks.0.") for key in plan.activations)
        assert Plan.from_json(plan.to_json()).activations == plan.activations

    def test_a_callable_policy_chooses_recompute_and_the_plan_carries_it(self):
        torch.manual_seed(0)
        cfg = GPTConfig(layers=2)
        plain = plan_for(GPT(cfg), gpt_batch(cfg, 2, 0), policy="tp", plan_ngpus=2)
        torch._dynamo.reset()
        chosen = plan_for(GPT(cfg), gpt_batch(cfg, 2, 0), policy=tp_with_recompute, plan_ngpus=2)
        assert chosen.plan.recompute == ("Block",) and plain.plan.recompute == ()
        assert chosen.plan.policy == "tp_with_recompute"
        # the blocks' forward matmuls run again in the backward
        # the forward keeps fewer values for the backward (the blocks' are recomputed there)
        assert _returned(chosen.program.graphs["forward"]) < _returned(plain.program.graphs["forward"])

    def test_memory_and_collectives_are_read_from_the_plan(self):
        torch.manual_seed(0)
        plan = plan_for(MLP(dim=8, hidden=16, layers=1), mlp_batch(4, 0, dim=8), policy="tp", plan_ngpus=2).plan
        (memory,) = memory_at_rest(plan)
        # fc1 [16, 8] + [16] split in two, fc2 [8, 16] split in two, its bias and the head whole: floats
        assert memory.parameters == 4 * (16 * 8 // 2 + 16 // 2 + 8 * 16 // 2 + 8 + 8 + 1)
        assert memory.optimizer == 2 * memory.parameters and memory.gradients == memory.parameters
        assert [(c.kind, c.dim, c.bytes) for c in step_collectives(plan)] == [("all_reduce", "tp", 128)]
        four = dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, world=4, dp=2))
        assert ("all_reduce", "dp") in {(c.kind, c.dim) for c in step_collectives(four)}
        text = str(dynshard.explain([plan]))
        assert "every rank" in text and "forward activations (tp)" in text


def _predicted(solver: str, status_last: bool) -> dict:
    """A ``"predicted"`` object as plan files hold it: the forward collectives, the cost model's keys at the top
    level, autodist's record (an ILP's names its status second, the enumeration's after its solve)."""
    solve = {"objective": 0.25, "bound": 0.25, "gap": 0.0, "lp_integral": None if status_last else True}
    head = {"chosen": "tp", "solver": solver, **solve, "status": "optimal"} if status_last else {
        "chosen": "tp", "solver": solver, "status": "optimal", **solve}
    return {
        "forward_collectives": [{"at": "fc1:aten.mm.default:0", "kind": "all_reduce", "dim": "tp", "bytes": 128},
                                {"at": "loss:aten.sum.default:0", "kind": "all_reduce", "dim": "tp", "bytes": 4,
                                 "mirrored": False}],
        "step_seconds": 0.25, "compute_seconds": 0.125, "communication_seconds": 0.125,
        "tp_communication_seconds": 0.0625, "dp_communication_seconds": 0.0625,
        **({"shared_gradient_seconds": 0.0} if status_last else {}), "bubble_seconds": 0.0,
        "tp_collectives_per_micro_batch": {"count": 3, "bytes": 260},
        **({"micro_batches_held": [2, 1]} if status_last else {}),
        "bytes_per_rank": {"parameters": 1, "buffers": 2, "gradients": 3, "optimizer": 4, "gathered": 5,
                           "activations": 6, "transient": 7, "peak": 28},
        "autodist": {**head, "ilps": 2, "objective_seconds": 0.25, "mem_constraint_gb": None, "update_freq": 1,
                     "device_profile": {"name": "cpu", "digest": "abc"}, "task_name": None,
                     "candidates": [{"plan": "tp", "step_seconds": 0.25, "compute_seconds": 0.125,
                                     "communication_seconds": 0.125, "bubble_seconds": 0.0, "peak_bytes": 28,
                                     "fits": True, "estimated": False},
                                    {"plan": "data", "step_seconds": 0.5, "peak_bytes": 56, "fits": False}]},
    }


@pytest.mark.parametrize("solver,status_last", [("HiGHS (scipy.optimize.milp)", False),
                                                ("enumeration (pipelines: every schedule priced)", True)])
def test_a_plans_prediction_is_typed_and_its_json_reads_back_to_the_same_bytes(solver, status_last):
    import json

    torch.manual_seed(0)
    plan = plan_for(MLP(dim=8, hidden=16, layers=1), mlp_batch(4, 0, dim=8), policy="tp", plan_ngpus=2).plan
    data = json.loads(plan.to_json())
    data["predicted"] = _predicted(solver, status_last)
    text = dynshard.planning.plan.format_json(data) + "\n"
    read = Plan.from_json(text)
    assert read.to_json() == text       # key order included: a file written before reads back to its bytes
    p = read.predicted
    assert [c.mirrored for c in p.forward_collectives] == [True, False]
    assert p.cost.step_seconds == 0.25 and p.cost.bytes_per_rank.peak == 28
    assert p.cost.tp_collectives_per_micro_batch.count == 3
    assert p.cost.micro_batches_held == ((2, 1) if status_last else None)
    assert p.autodist.device_profile.name == "cpu" and p.autodist.candidates[0].estimated is False
    older = p.autodist.candidates[1]    # (a record from before the step's parts and estimates were kept)
    assert older.compute_seconds is None and older.estimated is None and older.peak_bytes == 56
    assert Plan.from_json(plan.to_json()).predicted.cost is None        # a plan its policy did not price
    data["predicted"]["steps"] = 1
    with pytest.raises(PlanFileError, match="predicted has no key 'steps'"):
        Plan.from_json(json.dumps(data), "test.plan.json")


_PIPELINE = {"schedule": "1f1b", "nmicros": 2, "nstages": 1, "nchunks": 1, "starts": []}    # (a hand edit's)


@pytest.mark.parametrize("change,message", [
    (lambda d: d.update(dynshard_plan=7), "version 7 plan"),
    (lambda d: d["mesh"].update(dp=3), "is not its world"),
    (lambda d: d["tensors"]["blocks.0.0.weight"].update(tp="Q1"), "is not a placement"),
    (lambda d: d["tensors"]["blocks.0.0.weight"].update(dp="zero"), "the plan's zero level is 0"),
    (lambda d: d["tensors"]["blocks.0.0.weight"].update(tp="S5"), "cannot be split along dim 5"),
    (lambda d: d.pop("tensors"), "not a well-formed dynshard plan"),
    (lambda d: d["zero"].update(ngroups=3), "does not divide its dp=1 units"),
    (lambda d: d.update(pipeline=_PIPELINE | {"schedule": "2f2b"}), "schedule '2f2b' is not one of"),
    (lambda d: d.update(pipeline=_PIPELINE | {"nstages": 2}), "but its mesh has pp=1"),
    (lambda d: d.update(pipeline=_PIPELINE | {"nstages": 2, "nchunks": 2}), "needs pipeline_scheduler '1f1b_interleaved'"),
])
def test_a_plan_that_cannot_work_is_refused_when_read(change, message):
    import json

    torch.manual_seed(0)
    plan = plan_for(MLP(dim=8, hidden=16, layers=1), mlp_batch(4, 0, dim=8), policy="tp", plan_ngpus=2).plan
    data = json.loads(plan.to_json())
    change(data)
    with pytest.raises(PlanFileError, match=message):
        Plan.from_json(json.dumps(data), "test.plan.json")

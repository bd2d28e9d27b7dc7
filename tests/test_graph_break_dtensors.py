"""Split values crossing a graph break (issue 25, item 3).

With ``Config(gather_outputs=False)`` a program returns its outputs split inside the plan unit (the
logits, split along the vocabulary) as DTensors. When such a DTensor flows into the next compiled graph (a
graph break between the LM head and the loss: transformers' GPT-2, whose loss follows one, or a user's
``torch._dynamo.graph_break()``), that graph is planned with the DTensor's placements fixed, runs on its
local tensor, and hands its gradient back as a DTensor of the same placements. The loss on the split logits
is the vocab-parallel cross-entropy: exact, and the logits are never gathered.

Two real gloo ranks (plan_ngpus=2, policy "tp") train like one process; the pass-level tests run in one
process on a process group that never communicates.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

import dynshard
from distributed import run_ranks
from parity import assert_trains_like_one_process
from workers_graph_break import ROWS, SEQ, VOCAB, train_graph_break

MODELS = ["custom", "gpt2"]


@functools.cache
def job(name: str) -> tuple[dict, ...]:
    """One 2-rank job per model; every test of that model reads its result."""
    if name == "gpt2":
        pytest.importorskip("transformers")
    return tuple(run_ranks(train_graph_break, 2, name, timeout=900))


@pytest.mark.parametrize("name", MODELS)
def test_split_logits_across_a_graph_break_train_like_one_process(name):
    for rank, result in enumerate(job(name)):
        # one break (the head's program, then the loss's), and no recompilation on later steps
        assert result["dynamo_graphs"] == 2, result["explain"]
        assert not result["warnings"], result["warnings"]
        # the user holds the logits as a DTensor split along the vocabulary, and a plain loss
        assert result["logits_placements"] == ("S(2)",) and result["logits_error"] < 1e-5, result
        assert result["loss_type"] == "Tensor"
        assert_trains_like_one_process(result, f"rank {rank}")


@pytest.mark.parametrize("name", ["bigram", "embedding_head"])
def test_a_lookup_in_a_vocabulary_split_table_crossing_a_break_trains_like_one_process(name):
    # bigram: the lookup is the logits, flattened before the break (the masked partial sum was reduced after
    # the view, with a mask of the indices' shape: IndexError); embedding_head: the lookup feeds the LM head
    # directly (the head's partial input gradient met the lookup's masked partial: "Redistribution from one
    # partial type (P(sum)) to another (MaskP(sum, ...)) is unsupported")
    for rank, result in enumerate(job(name)):
        assert result["dynamo_graphs"] == 2 and not result["warnings"], (result["warnings"], result["explain"])
        assert result["logits_error"] < 1e-5
        assert_trains_like_one_process(result, f"rank {rank}")


@pytest.mark.parametrize("name", MODELS)
def test_loss_after_the_break_is_vocab_parallel_and_never_gathers_the_logits(name):
    one_per_row = (ROWS * SEQ, 1)
    for result in job(name):
        programs = result["programs"]
        # explain(model) lists the loss's program too (it has no parameters: it is found through the
        # logits it takes from the head's program)
        assert len(programs) == 2, result["explain"]
        head, loss = programs
        # no gather anywhere: the logits leave the head's program split and enter the loss's split
        assert not [c for p in programs for c in p if c[1] == "all_gather"], result["explain"]
        assert not [c for p in programs for c in p if c[3] >= ROWS * SEQ * VOCAB * 4 // 2], result["explain"]
        # the vocab-parallel cross-entropy: max, sum of exponentials and target logit, one value per row;
        # its backward needs nothing (aot_eager's partitioner may recompute the max)
        forward = [(c[1], c[4]) for c in loss if c[0] == "forward"]
        assert forward == [("all_reduce", one_per_row)] * 3, result["explain"]
        assert [c[4] for c in loss if c[0] == "backward"] in ([], [one_per_row]), result["explain"]
        assert {c[1] for c in head} == {"all_reduce"}, result["explain"]


# --------------------------------------------------------------------------------------- in one process

def plan_for(fn, inputs, **options):
    """The plan dynshard makes for ``fn(*inputs)`` (Dynamo traces a frame fed DTensors, as after a break)."""
    from dynshard.backend import dynshard_backend
    from dynshard.compat.dtensor_inputs import tensors_as_replicated

    options = {"policy": "tp", "plan_ngpus": 2, "compiler": "aot_eager", "gather_outputs": False, **options}
    plans = []

    def backend(gm, example_inputs):
        plans.append(dynshard_backend(gm, example_inputs, options=options).plan)
        return gm.forward

    # (dynshard's hooks let Dynamo trace a mix of DTensors and tensors from its second compile on; this
    # frame is the process's first)
    with tensors_as_replicated():
        torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return plans[0]


def split_logits(mesh, requires_grad=True) -> DTensor:
    local = torch.randn(ROWS, SEQ, VOCAB // 2, requires_grad=requires_grad)
    return DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=(ROWS, SEQ, VOCAB),
                              stride=(SEQ * VOCAB, VOCAB, 1))


def loss_of(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def test_a_dtensor_input_is_planned_with_its_placements_fixed(fake_world):
    from dynshard.runtime.mesh import layout_for

    mesh = layout_for(2, "cpu").tp_mesh
    y = torch.randint(0, VOCAB, (ROWS, SEQ))
    plan = plan_for(loss_of, (split_logits(mesh), y))
    logits, labels = plan.inputs
    assert logits.is_split_value and logits.placements == (Shard(2),) and logits.kind == "input"
    assert tuple(logits.shape) == (ROWS, SEQ, VOCAB)            # planned on the global shape
    assert not labels.is_split_value
    assert plan.placements[logits.index] == (Shard(2),) and plan.placements[labels.index] == (Replicate(),)
    assert plan.propagation.vocab_parallel_losses, plan.propagation
    kinds = [(c.phase, c.kind, tuple(c.shape)) for c in plan.program.collectives]
    assert [k for k in kinds if k[0] == "forward"] == [("forward", "all_reduce", (ROWS * SEQ, 1))] * 3, kinds
    assert not [k for k in kinds if k[1] != "all_reduce"], kinds
    # another placement of the same value is another plan
    whole = DTensor.from_local(torch.randn(ROWS, SEQ, VOCAB), mesh, [Replicate()], run_check=False)
    torch._dynamo.reset()
    other = plan_for(loss_of, (whole, y))
    assert other.key != plan.key and other.placements[0] == (Replicate(),)


def test_a_policy_cannot_move_a_split_value(fake_world):
    from dynshard.runtime.mesh import layout_for

    def replicate_everything(plan, config):
        assert plan.is_fixed("logits")
        plan.replicate("logits")

    with pytest.raises(Exception, match="placement is fixed"):
        plan_for(loss_of, (split_logits(layout_for(2, "cpu").tp_mesh), torch.randint(0, VOCAB, (ROWS, SEQ))),
                 policy=replicate_everything)


def test_a_dtensor_on_another_mesh_is_refused(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("elsewhere",))
    with pytest.raises(Exception, match="split outputs of its own programs"):
        plan_for(loss_of, (split_logits(mesh), torch.randint(0, VOCAB, (ROWS, SEQ))))


def test_a_program_runs_on_the_local_tensor_and_hands_back_a_gradient_of_the_same_placements(fake_world):
    """What the program that produced a split output gets back in its backward: the gradient of its local
    shard, through ``to_local`` (here) and ``from_local`` (where it was returned), with no communication."""
    from dynshard.runtime.mesh import layout_for
    from dynshard.runtime.split_values import local_arguments, split_input_indices

    mesh = layout_for(2, "cpu").tp_mesh
    produced = torch.randn(ROWS, SEQ, VOCAB // 2, requires_grad=True)   # the producing program's output
    logits = split_logits(mesh)
    logits = DTensor.from_local(produced, mesh, logits.placements, run_check=False, shape=logits.shape,
                                stride=logits.stride())
    seen = []
    logits.register_hook(lambda grad: seen.append(grad))
    plan = plan_for(loss_of, (logits, torch.randint(0, VOCAB, (ROWS, SEQ))))
    (index,) = split_input_indices(plan.inputs)
    (local,) = local_arguments((logits,), [index])
    assert not isinstance(local, DTensor) and local.shape == produced.shape
    weight = torch.randn_like(local)
    (local * weight).sum().backward()
    (grad,) = seen
    assert isinstance(grad, DTensor) and grad.placements == logits.placements and grad.shape == logits.shape
    torch.testing.assert_close(produced.grad, weight)

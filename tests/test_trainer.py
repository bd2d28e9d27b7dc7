"""transformers' Trainer around a dynshard model, on 2 real gloo ranks (issue 25, item 8).

Trainer (through accelerate) wraps the model it is given in DistributedDataParallel. dynshard releases
that DDP at its first compile (no reducer: its forward only calls the model; DDP's no_sync becomes
dynshard's), so each gradient is reduced once, by dynshard, and tp no longer fails with "CompiledFunction-
Backward returned an invalid gradient". Each job trains a small Llama with SGD + momentum, Trainer's default
clipping (max_grad_norm=1.0, torch's clip_grad_norm_ routed to dynshard's global norm) and docs/transformers.md's
recipe for the dataloader (split over data-parallel units), and compares with one eager process trained on
the same global batches. The gloo collectives of one step are profiled: exactly the program's own (as
``dynshard.explain`` lists them) plus scalars (the clipping norm), where Trainer's DDP used to add a
buffer broadcast, its unused-parameter bitmap and an all-reduce of every gradient.

A DDP dynshard cannot leave as a pass-through is refused, on every rank: one that averages dynshard's
parameters with others, and one built after dynshard had cut the parameters into pieces.
"""

from __future__ import annotations

import functools

import pytest
import torch

from distributed import run_ranks
from parity import assert_trains_like_one_process
from workers_trainer import STEPS, refused_wraps, train_with_trainer, user_ddp

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

JOBS = {
    "dp-accumulate2": (dict(options={}, plan_ngpus=1, accumulation=2)),
    "zero3": (dict(options={"use_zero": 3}, plan_ngpus=1)),
    # (Trainer's token averaging scales the loss in place, ``loss *= world``: programs return copies, not views)
    "tp": (dict(options={"policy": "tp"}, plan_ngpus=2)),
    # (a budget the data plan does not meet: autodist splits the weights)
    "autodist-budget": (dict(options={"policy": "autodist", "pas_config": {"mem_constraint": 0.0003}}, plan_ngpus=2)),
}


@functools.cache
def job(name: str) -> tuple[dict, ...]:
    kwargs = JOBS[name]
    return tuple(run_ranks(train_with_trainer, 2, kwargs["options"], kwargs["plan_ngpus"], "trainer", STEPS,
                           kwargs.get("accumulation", 1), kwargs.get("trainer_args"), timeout=600))


@pytest.mark.parametrize("name", list(JOBS))
def test_trainer_trains_like_one_process(name):
    for result in job(name):
        assert_trains_like_one_process(result)
        # clipping at max_grad_norm=1.0 saw the global norm (the reference's, before clipping)
        torch.testing.assert_close(result["grad_norms"], result["ref_norms"], rtol=1e-5, atol=0)
        assert result["programs"] == 1, result["explain"]


def test_trainer_trains_on_the_plan_autodist_chose_under_a_budget():
    """autodist, the recommended policy, behind Trainer: the plan it chose under the budget splits the weights
    over the unit (so the parity above is tp's, not data's), and every rank runs that plan."""
    results = job("autodist-budget")
    placements = [result["explain"].split("\nprogram ")[0] for result in results]
    assert "tp=S(0)" in placements[0] and "tp=S(1)" in placements[0], placements[0]
    assert placements[1] == placements[0]


@pytest.mark.parametrize("name", list(JOBS))
def test_trainer_ddp_is_released(name):
    for result in job(name):
        assert result["ddps"] == 1                 # Trainer did wrap the model in DDP...
        assert result["ddp_reducers"] == [False]   # ...which now has no reducer
        assert result["ddp_ignored"]               # and Dynamo's DDPOptimizer leaves dynshard's graph whole


@pytest.mark.parametrize("name", list(JOBS))
def test_trainer_step_reduces_each_gradient_once(name):
    """A profiled optimizer step sends the program's own collectives and scalars, nothing of DDP's. With
    gradient accumulation (Trainer's DDP.no_sync, now dynshard's), the first micro-step sends nothing and
    the accumulated gradients go out in one bucket."""
    flushes = 1 if JOBS[name].get("accumulation", 1) > 1 else 0
    for result in job(name):
        sent = [(kind, shapes) for kind, shapes in result["events"] if shapes and shapes[0] not in ([], [1])]
        assert len(sent) == len(result["collectives"]) + flushes, (sent, result["explain"])


def test_user_built_ddp_around_a_tp_model_trains_like_one_process():
    for result in run_ranks(user_ddp, 2, {"policy": "tp"}, 2, timeout=600):
        assert_trains_like_one_process(result)
        assert result["ddp_reducers"] == [False]
        assert result["programs"] == 1      # not DDPOptimizer's bucket-sized pieces


# ------------------------------------------------------------------------------------------- refused

@functools.cache
def refused() -> tuple[dict, ...]:
    return tuple(run_ranks(refused_wraps, 2, timeout=600))


def test_ddp_over_dynshard_and_other_parameters_is_refused_on_every_rank():
    for errors in refused():
        assert errors["mixed"] is not None
        _, message = errors["mixed"]
        assert "DDPWrapError" in message or errors["mixed"][0] == "DDPWrapError"
        assert "register_ddp_parameters_to_ignore(model) before" in message
        assert "'parts.embed.weight'" in message


def test_ddp_built_after_the_parameters_were_cut_is_refused_on_every_rank():
    for errors in refused():
        assert errors["late"] is not None and errors["late"][0] == "DDPWrapError", errors["late"]
        assert "Build it before the model's first call" in errors["late"][1]

"""What each rank runs in tests/test_eager_guard.py."""

from __future__ import annotations

import copy

import torch

import dynshard
from models import MLP, mlp_batch
from workers import train_beside
from workers_transformers import VOCAB, build as build_transformers, make_batch


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def eager_calls_after_tp(rank: int, world: int) -> dict:
    """An MLP trained a step under tp, then called eagerly, inside summon_full_params, and trained on."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy="tp", plan_ngpus=2, compiler="aot_eager"))
    opt, ref_opt = _sgd(model.parameters()), _sgd(reference.parameters())
    result = {"losses": [], "ref_losses": []}
    for step in range(3):
        x, y = mlp_batch(4, seed=step)
        if step == 1:
            try:
                model(x, y)
                result["eager_error"] = None
            except dynshard.EagerCallOnShardsError as error:
                result["eager_error"] = str(error)
            with torch.no_grad(), dynshard.summon_full_params(compiled):
                result["summoned"] = (model(x, y).item(), compiled(x, y).item(), reference(x, y).item())
        loss, ref_loss = compiled(x, y), reference(x, y)
        result["losses"].append(loss.item())
        result["ref_losses"].append(ref_loss.item())
        loss.backward()
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    result["params"] = dynshard.collect_state_dict(compiled)
    result["ref_params"] = {k: v.detach() for k, v in reference.state_dict().items()}
    return result


def generate_after_tp(rank: int, world: int) -> dict:
    """transformers' GPT-2 trained a step under tp, then generate(): refused on shards, equal to one
    process's inside summon_full_params."""
    model = build_transformers("gpt2")
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy="tp", plan_ngpus=2, compiler="aot_eager"))
    opt, ref_opt = _sgd(model.parameters()), _sgd(reference.parameters())
    batch = make_batch("gpt2", 2, 0)
    compiled(**batch).loss.backward()
    reference(**batch).loss.backward()
    for o in (opt, ref_opt):
        o.step()
        o.zero_grad()
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(7))
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    try:
        compiled.generate(prompt, **settings)
        error = None
    except dynshard.EagerCallOnShardsError as raised:
        error = str(raised)
    with dynshard.summon_full_params(compiled):
        generated = compiled.generate(prompt, **settings)
    return {"error": error, "generated": generated, "expected": reference.generate(prompt, **settings),
            "local_vocab": model.transformer.wte.weight.shape[0]}


def two_models_under(rank: int, world: int, options: dict, steps: int = 2) -> dict:
    """Two models of one class and shapes (another seed) compiled with the same options in one process
    (Dynamo serves both from one compiled frame): each trains like its own one-process reference."""
    out = {}
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = MLP()
        reference = copy.deepcopy(model)
        compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(compiler="aot_eager", **options))
        out[seed] = train_beside(compiled, reference, (_sgd(model.parameters()), _sgd(reference.parameters())),
                                 [mlp_batch(4, seed=10 * step + seed) for step in range(steps)])
    return out

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


def _step(*optimizers) -> None:
    for o in optimizers:
        o.step()
        o.zero_grad()


def _with_params(result: dict, compiled, reference) -> dict:
    result["params"] = dynshard.collect_state_dict(compiled)
    result["ref_params"] = {k: v.detach() for k, v in reference.state_dict().items()}
    return result


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
        _step(opt, ref_opt)
    return _with_params(result, compiled, reference)


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


class TemperatureMLP(torch.nn.Module):
    """A forward that takes a Python float: Dynamo guards on its value, so each new value recompiles."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

    def forward(self, x, y, temperature: float):
        return torch.nn.functional.mse_loss(self.b(torch.relu(self.a(x)) / temperature).squeeze(-1), y)


RECOMPILE_LIMIT = 2      # (Dynamo's default is 8: the same path, reached sooner)


def recompile_limit_under(rank: int, world: int, options: dict, model_name: str = "mlp",
                          dynamic: bool | None = None) -> dict:
    """Train until Dynamo's recompile limit, a new temperature (or sequence length) each step, beside one
    process; report the error each rank raised, at which step, and both models as they were then.
    ``dynamic``: torch.compile's (None: a size that changed once compiles symbolic)."""
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    torch.manual_seed(0)
    model = TemperatureMLP() if model_name == "mlp" else build_transformers("llama")
    reference = copy.deepcopy(model)
    plan_ngpus = options.get("plan_ngpus", 1)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(compiler="aot_eager", **options),
                             dynamic=dynamic)
    opt, ref_opt = _sgd(model.parameters()), _sgd(reference.parameters())
    dp_rank, dp_size = dynshard.data_parallel_rank(plan_ngpus)
    result = {"losses": [], "ref_losses": [], "error": None}
    for step in range(RECOMPILE_LIMIT + 2):
        generator = torch.Generator().manual_seed(step)
        if model_name == "mlp":
            x, y = torch.randn(4 * dp_size, 8, generator=generator), torch.randn(4 * dp_size, generator=generator)
            rows = slice(4 * dp_rank, 4 * dp_rank + 4)
            args, ref_args = (x[rows], y[rows], 1.0 + 0.1 * step), (x, y, 1.0 + 0.1 * step)
            call = lambda m, a: m(*a)         # noqa: E731
        else:
            ids = torch.randint(0, VOCAB, (2 * dp_size, 8 + step), generator=generator)
            rows = slice(2 * dp_rank, 2 * dp_rank + 2)
            args, ref_args = ids[rows], ids
            call = lambda m, a: m(input_ids=a, labels=a).loss      # noqa: E731
        try:
            loss = call(compiled, args)
        except dynshard.EagerCallError as error:
            result["error"], result["error_type"], result["error_step"] = str(error), type(error).__name__, step
            break
        loss.backward()
        ref_loss = call(reference, ref_args)
        ref_loss.backward()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        result["losses"].append(mean.item() / world)
        result["ref_losses"].append(ref_loss.item())
        _step(opt, ref_opt)
    from torch._dynamo.utils import counters
    result["graphs"] = counters["stats"]["unique_graphs"]
    return _with_params(result, compiled, reference)


def eager_calls_under_dp(rank: int, world: int) -> dict:
    """dp: after a compiled step, an eager call of the original module with gradients enabled is refused
    (nothing would reduce its gradients); under no_grad it computes what the compiled model does."""
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(compiler="aot_eager"))
    x, y = mlp_batch(4, seed=rank)
    compiled(x, y).backward()
    result = {}
    try:
        model(x, y)
        result["error"] = None
    except dynshard.EagerCallError as error:
        result["error"], result["error_type"] = str(error), type(error).__name__
    with torch.no_grad():
        result["eager"], result["compiled"] = model(x, y).item(), compiled(x, y).item()
    result["grads"] = [p.grad.clone() for p in model.parameters()]     # the refused call added nothing
    compiled(x, y).backward()
    result["grads_after"] = [p.grad.clone() for p in model.parameters()]
    return result


def generate_on_tp_llama(rank: int, world: int) -> dict:
    """transformers' Llama trained a step under tp, then generate() on the compiled module."""
    from dynshard.runtime.eager_guard import _GUARDED

    model = build_transformers("llama")
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy="tp", plan_ngpus=2, compiler="aot_eager"))
    batch = make_batch("llama", 2, 0)
    compiled(**batch).loss.backward()
    result = {"guarded": [name for name, m in model.named_modules() if getattr(m, _GUARDED, False)]}
    try:
        compiled.generate(batch["input_ids"][:, :5], max_new_tokens=2, do_sample=False, pad_token_id=0)
        result["error"] = result["error_type"] = None
    except Exception as error:      # noqa: BLE001  (the test names what it must be)
        result["error"], result["error_type"] = str(error), type(error).__name__
    return result

"""The plan key holds everything that changes the compiled program while Dynamo's graph stays the same."""

from __future__ import annotations

import json

import pytest
import torch

from dynshard import Config
from dynshard.backend.plan_cache import plan_key
from dynshard.runtime.mesh import Layout

ONE_PROCESS = Layout(world_size=1, rank=0, plan_ngpus=1, device_type="cpu", mesh=None)


def _key(config: Config = Config()) -> str:
    return plan_key("graph code", [], config, ONE_PROCESS)


def _compiled_mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    compiled = torch.compile(mlp, backend="dynshard", options={"compiler": "aot_eager"})
    return compiled, torch.randn(4, 16)


def _autocast_then_plain(reset_between: bool) -> list[torch.dtype]:
    compiled, x = _compiled_mlp()
    with torch.autocast("cpu", torch.bfloat16):
        first = compiled(x).dtype
    if reset_between:
        torch._dynamo.reset()       # the plan cache outlives Dynamo's
    return [first, compiled(x).dtype]


def _plain_then_autocast(reset_between: bool) -> list[torch.dtype]:
    compiled, x = _compiled_mlp()
    first = compiled(x).dtype
    if reset_between:
        torch._dynamo.reset()
    with torch.autocast("cpu", torch.bfloat16):
        return [first, compiled(x).dtype]


@pytest.mark.parametrize("reset_between", [False, True], ids=["same-dynamo", "after-dynamo-reset"])
def test_a_plain_call_after_an_autocast_call_is_not_served_the_autocast_program(reset_between):
    assert _autocast_then_plain(reset_between) == [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("reset_between", [False, True], ids=["same-dynamo", "after-dynamo-reset"])
def test_an_autocast_call_after_a_plain_call_is_not_served_the_plain_program(reset_between):
    assert _plain_then_autocast(reset_between) == [torch.float32, torch.bfloat16]


def test_the_key_holds_autocast_per_device_and_dtype_and_grad_mode():
    keys = [_key()]
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype):
            keys.append(_key())
    with torch.autocast("cpu", torch.bfloat16, enabled=False):
        keys.append(_key())
    with torch.no_grad():
        keys.append(_key())
    assert len(set(keys)) == 4, keys      # autocast switched off is the plain key again
    assert keys[3] == keys[0]


def test_the_key_holds_every_config_field_but_where_plans_and_traces_are_stored_and_who_traces():
    # (a loaded plan enters the key by its digest, not by its path)
    assert set(json.loads(Config().cache_token())) == set(Config.fields()) - {
        "cache_dir", "trace_dir", "share_traces", "save_plan_path", "load_plan_path"}
    variants = [Config(), Config(compiler="aot_eager"), Config(policy="data"), Config(user_config={"a": 1}),
                Config(pas_config={"b": 2}), Config(inference_only=True), Config(recompute_modules="ROOT"),
                Config(mixed_precision={"param_dtype": "bfloat16"}), Config(use_zero=1), Config(use_end2end=True)]
    assert len({_key(c) for c in variants}) == len(variants)
    assert _key(Config(cache_dir="/tmp/plans")) == _key() == _key(Config(trace_dir="/tmp/traces"))

"""What each rank runs in tests/test_output_warnings.py."""

from __future__ import annotations

import warnings

import torch

import dynshard
from workers_transformers import build, make_batch


def warnings_of_a_step(rank: int, world: int, use_cache: bool) -> list[str]:
    """transformers' GPT-2 under tp, one training step: dynshard's warnings about gathered outputs."""
    model = build("gpt2")
    model.config.use_cache = use_cache
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy="tp", plan_ngpus=2, compiler="aot_eager"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(**make_batch("gpt2", 2, 0))
        out.loss.backward()
    return [str(w.message) for w in caught if "gathers them whole" in str(w.message)]

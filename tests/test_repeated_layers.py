"""The tp policy ties its trial decisions across a model's repeated layers (policies/repeated_layers.py):
the plans are the ones a trial per layer gives, including where one layer differs from the others."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dynshard.policies.repeated_layers import TiedDecisions, layer_pattern
from models import GPT, GPTConfig, gpt_batch
from plans import plan_for


@pytest.fixture(autouse=True)
def _world(fake_world):
    pass


class Block(nn.Module):
    def __init__(self, dim: int, softmax: bool):
        super().__init__()
        self.fc1, self.fc2, self.softmax = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim), softmax

    def forward(self, x):
        h = self.fc1(x)
        return x + self.fc2(h.softmax(-1) if self.softmax else F.gelu(h))    # a softmax over a split dim gathers


class Stack(nn.Module):
    """Five blocks with the same parameter names; the fourth normalises over fc1's output dimension."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, softmax=i == 3) for i in range(5))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def untied(monkeypatch):
    monkeypatch.setattr(TiedDecisions, "decision", lambda self, group: None)


def test_layer_patterns_mask_every_numeric_path_part():
    assert layer_pattern("model.layers.12.mlp.0.weight") == "model.layers.#.mlp.#.weight"
    assert layer_pattern("3.weight") == "#.weight" and layer_pattern("wte.weight") == "wte.weight"


@pytest.mark.parametrize("sequence_parallel", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_deep_gpts_tied_plan_is_the_plan_of_a_trial_per_layer(monkeypatch, sequence_parallel):
    cfg = GPTConfig(layers=5)
    options = dict(policy="tp", plan_ngpus=2, pas_config={"sequence_parallel": sequence_parallel})
    torch.manual_seed(0)
    tied = plan_for(GPT(cfg), gpt_batch(cfg, 4, 0), **options).plan
    torch._dynamo.reset()
    untied(monkeypatch)
    torch.manual_seed(0)
    assert tied.to_json() == plan_for(GPT(cfg), gpt_batch(cfg, 4, 0), **options).plan.to_json()
    assert {tied.tensors[f"blocks.{i}.fc1.weight"].tp for i in range(5)} == {"S0"}


def test_a_layer_unlike_the_first_two_gets_the_plan_its_own_trial_gives(monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    tied = plan_for(Stack(), (x,), policy="tp", plan_ngpus=2).plan
    torch._dynamo.reset()
    untied(monkeypatch)
    torch.manual_seed(0)
    assert tied.to_json() == plan_for(Stack(), (x,), policy="tp", plan_ngpus=2).plan.to_json()
    split = {i: tied.tensors[f"layers.{i}.fc1.weight"].tp for i in range(5)}
    assert split == {0: "S0", 1: "S0", 2: "S0", 3: "R", 4: "S0"}, split

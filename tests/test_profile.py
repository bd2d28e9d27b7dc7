"""dynshard.profile: per-module FLOPs and saved bytes on FakeTensors equal what real tensors give."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

import dynshard
from models import GPT, GPTConfig, gpt_batch

CFG = GPTConfig(vocab=512, seq=64, d_model=128, heads=4, layers=2)


def _real_costs(model, batch):
    """FlopCounterMode and a saved-tensors hook on a real run: forward and backward FLOPs by module (as
    FlopCounterMode names them) and the bytes saved for the backward that are not parameters."""
    params = {id(p) for p in model.parameters()}
    saved = {}

    def pack(t):
        if id(t) not in params and id(getattr(t, "_base", None)) not in params:
            saved[id(t)] = t.numel() * t.element_size()
        return t

    counter = FlopCounterMode(display=False)
    with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*batch)
        forward = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
        loss.backward()
        both = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    return forward, both, sum(saved.values())


def test_fake_costs_equal_real_ones_module_by_module():
    torch.manual_seed(0)
    model, batch = GPT(CFG), gpt_batch(CFG, 4, 0)
    report = dynshard.profile(model, *batch)
    forward, both, saved = _real_costs(model, batch)
    assert report[""].forward_flops == forward["Global"] > 0
    # (more than twice the forward: attention's backward is 2.5 times its forward, the matmuls' twice theirs)
    assert report[""].backward_flops == both["Global"] - forward["Global"] > 2 * forward["Global"]
    for path in ("blocks.0", "blocks.1.fc1", "lm_head"):
        assert report[path].forward_flops == forward[f"GPT.{path}"], path
        assert report[path].backward_flops == both[f"GPT.{path}"] - forward[f"GPT.{path}"], path
    assert report[""].saved_bytes == saved > 0
    assert report["blocks.0"].saved_bytes == report["blocks.1"].saved_bytes > 0
    assert report[""].parameter_bytes == 4 * sum(p.numel() for p in model.parameters())   # the tied head once
    assert "blocks" not in [m.path for m in report.modules]      # a ModuleList runs nothing itself
    assert "blocks.0.attn.q" in str(report)


def test_a_model_on_the_meta_device_profiles_without_memory():
    cfg = GPTConfig(vocab=32000, seq=512, d_model=1024, heads=16, layers=24)
    with torch.device("meta"):
        model = GPT(cfg)
    report = dynshard.profile(model, *[t.to("meta") for t in gpt_batch(cfg, 2, 0)])
    assert report["blocks.23"].forward_flops == report["blocks.0"].forward_flops > 0
    assert report[""].parameter_bytes > 1e9      # 0.3B parameters, none allocated

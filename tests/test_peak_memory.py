"""dynshard.peak_memory: a block's peak on one rank, held at its start plus the most allocated at once inside."""

from __future__ import annotations

import torch

import dynshard


def test_a_blocks_peak_is_what_the_model_and_optimizer_held_plus_the_most_allocated_at_once():
    model = torch.nn.Linear(256, 256, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    opt.zero_grad()
    with dynshard.peak_memory(model, opt) as measured:
        first = torch.empty(1 << 20, dtype=torch.uint8)
        second = torch.empty(2 << 20, dtype=torch.uint8)
        del first
        third = torch.empty(1 << 19, dtype=torch.uint8)
        del second, third
    assert measured.device == "cpu"
    assert measured.at_start == 2 * 256 * 256 * 4         # the weight and its momentum (no gradient: zeroed)
    assert measured.during == 3 << 20                     # first and second at once; third after first's free
    assert measured.peak == measured.at_start + measured.during and "held at the start" in str(measured)


def test_a_training_steps_peak_counts_its_gradients_and_activations():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    with dynshard.peak_memory(model) as measured:
        model(torch.randn(128, 64)).square().mean().backward()
    grads = sum(p.numel() * 4 for p in model.parameters())
    hidden = 128 * 256 * 4                                # the first layer's output, saved for the backward
    assert measured.at_start == grads and measured.during >= grads + hidden

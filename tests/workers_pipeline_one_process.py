"""One-process pipelines, run in a spawned one-rank job (tests/test_pipeline_one_process.py): the pass-level
tests' fake 2-rank process group lives for the whole pytest session, and a compile in that process would
see a world of 2 (a data-parallel unit that never communicates)."""

from __future__ import annotations

import copy

import torch

import dynshard
from dynshard import Config
from parity import assert_losses_close, assert_tensors_close
from workers_pipeline import EndToEndGPT, build

PP = dict(policy="pp", use_end2end=True)


def _one_process(model, scheduler="gpipe", nchunks=1, m=4, **options):
    return torch.compile(model, backend="dynshard", options=Config(**PP, compiler="aot_eager", **options, pas_config={
        "pipeline_nmicros": m, "pipeline_scheduler": scheduler, "pipeline_nchunks": nchunks}))


def _assert_grads_match(model, reference) -> None:
    assert_tensors_close({n: p.grad for n, p in model.named_parameters()},
                         {n: p.grad for n, p in reference.named_parameters()}, "grads")


def train_step_parity(rank: int, world: int, scheduler: str, nchunks: int) -> int:
    """Two stages on one rank (interleaved) hand activations and gradients over without transfers."""
    torch.manual_seed(0)
    model = EndToEndGPT(build("gpt")[0].cfg)
    make = build("gpt")[1]
    reference = copy.deepcopy(model)
    compiled = _one_process(model, scheduler, nchunks)
    samples = [make(2, i) for i in range(4)]
    losses = dynshard.train_step(compiled, samples)
    ref_losses = []
    for sample in samples:
        loss = reference(sample)
        loss.backward()
        ref_losses.append(loss.detach())
    assert_losses_close(losses, ref_losses)
    _assert_grads_match(model, reference)
    report = dynshard.explain(compiled).pipelines[0]
    assert report.p2p_bytes == 0
    return len(report.stages)


def plain_call_parity(rank: int, world: int, name: str) -> None:
    model, make = build(name)
    reference = copy.deepcopy(model)
    batch = make(8, 0)
    loss = _one_process(model, "1f1b")(batch)
    loss.backward()
    ref_loss = reference(batch)
    ref_loss.backward()
    assert_losses_close(loss, ref_loss)
    _assert_grads_match(model, reference)
    with torch.no_grad():
        assert_losses_close(_one_process(model, "1f1b")(batch), reference(batch), "no_grad loss")


def recompute_saved_bytes(rank: int, world: int) -> dict:
    saved = {}
    for names in ("", "Block"):
        torch._dynamo.reset()
        model, make = build("gpt")
        reference = copy.deepcopy(model)
        compiled = _one_process(model, "1f1b_interleaved", 2, 2, recompute_modules=names)
        samples = [make(2, i) for i in range(2)]
        dynshard.train_step(compiled, samples)
        for sample in samples:
            reference(sample).backward()
        _assert_grads_match(model, reference)
        saved[names] = [s.saved_bytes for s in dynshard.explain(compiled).pipelines[0].stages]
    return saved


def all_device_first(rank: int, world: int) -> dict:
    """1f1b_plus on one rank: the untied GPT trains like one process (the all-device segment and one
    stage); the tied GPT is refused (its embedding would be shared by the segment and the last stage)."""
    import pytest

    from workers_pipeline import UntiedEndToEndGPT

    torch.manual_seed(0)
    make = build("gpt")[1]
    model = UntiedEndToEndGPT(build("gpt")[0].cfg)
    reference = copy.deepcopy(model)
    samples = [make(2, i) for i in range(4)]
    losses = dynshard.train_step(_one_process(model, "1f1b_plus"), samples)
    for sample in samples:
        reference(sample).backward()
    _assert_grads_match(model, reference)
    torch._dynamo.reset()
    with pytest.raises(NotImplementedError) as info:
        dynshard.train_step(_one_process(EndToEndGPT(build("gpt")[0].cfg), "1f1b_plus"), samples)
    return {"losses": len(losses), "error": str(info.value)}

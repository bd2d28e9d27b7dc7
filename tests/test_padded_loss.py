"""A loss over padded targets (-100, rows nearly all padding) split over ranks (policy ``data``) or
micro-batches (``pp``) is the batch's loss: each part weighs by its count of counted targets (its total
weight), never a mean of the parts' means. Issue 25, item 9."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed import run_ranks
from parity import assert_trains_like_one_process
from dynshard.passes.microbatch_outputs import MicrobatchError, microbatch_combine, seed_scale
from dynshard.passes.microbatch_weights import WeightedMean
from workers_padded_loss import CASES, PaddedLM, padded_batch, padded_parity


def _assert_like_one_process(results: list[dict], cases) -> None:
    for rank, by_case in enumerate(results):
        assert set(cases) <= set(by_case), f"rank {rank} ran {sorted(by_case)}"
        for case in cases:
            result = by_case[case]
            assert_trains_like_one_process(result, f"rank {rank}, {case}:")


# -- on 2 real ranks ------------------------------------------------------------------------------------
def test_data_policy_trains_on_padded_targets_like_one_process():
    """plan_ngpus=2, the batch split over the two ranks: plain, label-smoothed, class-weighted, shifted
    and ignore_index=0 cross-entropies, a rank whose rows hold no target, and train_step (one row per rank
    per sample)."""
    _assert_like_one_process(run_ranks(padded_parity, 2, "data", list(CASES)), CASES)


@pytest.fixture(scope="module")
def pipeline_results() -> list[dict]:
    """One 2-rank pp job for the pipeline tests below (the cases, then the refused model)."""
    return run_ranks(padded_parity, 2, "pp", list(CASES), True)


def test_pipeline_plain_calls_weigh_each_micro_batch_by_its_counted_targets(pipeline_results):
    """plan_ngpus=2 stages, 4 micro-batches of a plain call: the same cases; a micro-batch without any
    target adds nothing; train_step keeps nnScaler's sum of the samples' own losses."""
    _assert_like_one_process(pipeline_results, CASES)


def test_a_pipelined_loss_mixing_counted_targets_with_a_mean_over_samples_is_refused_on_every_rank(
        pipeline_results):
    for rank, by_case in enumerate(pipeline_results):
        result = by_case["refused_mixed_loss"]
        assert result["type"] == "MicrobatchError", f"rank {rank}: {result}"
        assert "combines a mean over the batch's samples" in result["message"]
        assert "mean over counted targets (cross_entropy at" in result["message"]
        assert "workers_padded_loss.py" in result["message"]


# -- the analysis, on one process -----------------------------------------------------------------------
def _combine(model: nn.Module, batch: dict, nmicros: int):
    """``microbatch_combine`` where the pipeline calls it (Dynamo's graph and example inputs); the kinds
    and the graph inputs."""
    found = []

    def backend(gm, example_inputs):
        inputs = [i for i, value in enumerate(example_inputs) if any(value is t for t in batch.values())]
        found.append((microbatch_combine(gm, list(example_inputs), inputs, nmicros), list(example_inputs)))
        return gm.forward

    try:
        torch.compile(model, backend=backend, fullgraph=True)(batch)
    except torch._dynamo.exc.BackendCompilerFailed as failed:
        raise failed.inner_exception from None
    return found[0]


def _assert_weighted_exact(model: nn.Module, batch: dict, nmicros: int = 4) -> WeightedMean:
    """The kind is a WeightedMean; combining the micro-batch losses with it gives the batch's loss, and
    the micro-batch gradients scaled by its scales give the batch's gradient."""
    (kind,), graph_inputs = _combine(model, batch, nmicros)
    assert isinstance(kind, WeightedMean) and kind == "mean", kind
    params = list(model.parameters())
    whole = model(batch)
    whole_grads = torch.autograd.grad(whole, params, allow_unused=True, materialize_grads=True)
    micro = [{k: v.chunk(nmicros)[i] for k, v in batch.items()} for i in range(nmicros)]
    losses = [model(mb) for mb in micro]
    scales = kind.scales(graph_inputs, nmicros)
    assert not torch.allclose(scales, torch.full_like(scales, 1 / nmicros))    # padding: unequal weights
    torch.testing.assert_close(kind.combine([l.detach() for l in losses], graph_inputs), whole.detach(),
                               rtol=1e-6, atol=0)
    seeded = sum(float(s) * l for s, l in zip(scales, losses))
    for got, want in zip(torch.autograd.grad(seeded, params, allow_unused=True, materialize_grads=True), whole_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # the mean of the micro-batch means, the combination before this fix, is off
    assert not torch.allclose(torch.stack(losses).mean(), whole, rtol=1e-4)
    return kind


@pytest.mark.parametrize("loss", ["plain", "smoothed", "weighted", "shifted", "ignore_zero"])
def test_cross_entropy_over_padded_targets_is_a_mean_weighted_by_each_micro_batchs_counted_targets(loss):
    torch.manual_seed(0)
    _assert_weighted_exact(PaddedLM(loss), padded_batch(8, 0))


def test_the_cross_entropy_module_and_nll_loss_are_weighted_too():
    class ModuleLoss(PaddedLM):
        def __init__(self):
            super().__init__()
            self.criterion = nn.CrossEntropyLoss(label_smoothing=0.05)

        def forward(self, batch):
            return self.criterion(self.head(self.emb(batch["idx"])).flatten(0, 1), batch["tgt"].flatten())

    class NllLoss(PaddedLM):
        def forward(self, batch):
            logits = self.head(self.emb(batch["idx"]))
            return F.nll_loss(logits.log_softmax(-1).transpose(1, 2), batch["tgt"])     # [B, C, T]: nll_loss2d

    torch.manual_seed(0)
    _assert_weighted_exact(ModuleLoss(), padded_batch(8, 1))
    kind = _assert_weighted_exact(NllLoss(), padded_batch(8, 1))
    assert kind.dim == 0


def test_two_losses_over_the_same_targets_combine_and_over_other_targets_are_refused():
    class TwoHeads(PaddedLM):
        def __init__(self, other_target: bool):
            super().__init__()
            self.other, self.head2 = other_target, nn.Linear(16, 24)

        def forward(self, batch):
            h = self.emb(batch["idx"])
            tgt = batch["tgt"].flatten()
            second = torch.where(tgt % 2 == 0, tgt, -100) if self.other else tgt
            return F.cross_entropy(self.head(h).flatten(0, 1), tgt) + \
                0.5 * F.cross_entropy(self.head2(h).flatten(0, 1), second)

    torch.manual_seed(0)
    _assert_weighted_exact(TwoHeads(False), padded_batch(8, 2))
    with pytest.raises(MicrobatchError, match="combines losses normalised by different counts of targets"):
        _combine(TwoHeads(True), padded_batch(8, 2), 4)


@pytest.mark.parametrize("loss", ["probabilities", "batchmean"])
def test_class_probabilities_and_a_batchmean_kl_div_are_plain_means_of_the_micro_batches(loss):
    """Their decompositions divide by a number of samples taken from the shape they run at: a micro-batch
    divides by its own (before, the analysis divided by the whole batch's, called it a sum, and a plain
    call under pp returned 4 times the loss)."""
    class SoftTargets(PaddedLM):
        def forward(self, batch):
            logits = self.head(self.emb(batch["idx"]))
            soft = F.one_hot(batch["idx"], 24).float() * 0.9 + 0.1 / 24
            if loss == "batchmean":
                return F.kl_div(logits.log_softmax(-1), soft, reduction="batchmean")
            return F.cross_entropy(logits.flatten(0, 1), soft.flatten(0, 1))

    torch.manual_seed(0)
    model, batch = SoftTargets(), padded_batch(8, 0)
    (kind,), _ = _combine(model, batch, 4)
    assert kind == "mean" and not isinstance(kind, WeightedMean)
    assert seed_scale(kind, 4) == 0.25
    micro = [model({k: v.chunk(4)[i] for k, v in batch.items()}) for i in range(4)]
    torch.testing.assert_close(torch.stack(micro).mean(), model(batch), rtol=1e-6, atol=0)


def test_a_weighted_mean_has_no_single_seed_scale_and_an_unrecognised_mean_nll_loss_is_refused():
    torch.manual_seed(0)
    (kind,), _ = _combine(PaddedLM(), padded_batch(8, 0), 4)
    with pytest.raises(ValueError, match="do not weigh the same"):
        seed_scale(kind, 4)

    class LegacyArguments(PaddedLM):
        def forward(self, batch):
            logp = self.head(self.emb(batch["idx"])).flatten(0, 1).log_softmax(-1)
            return F.nll_loss(logp, batch["tgt"].flatten(), size_average=True)

    with pytest.raises(MicrobatchError, match=r"mean over the targets not equal to ignore_index=-100.*F.cross_entropy"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)      # (size_average's deprecation)
        _combine(LegacyArguments(), padded_batch(8, 0), 4)

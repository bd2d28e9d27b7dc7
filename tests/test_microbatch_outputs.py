"""How a graph's outputs combine over micro-batches (dynshard.passes.microbatch_outputs), checked against
eager runs of the model on the micro-batches: values and gradients."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dynshard.passes.microbatch_outputs import MicrobatchError, microbatch_combine, seed_scale
from dynshard.passes.microbatch_weights import WeightedMean
from models import GPT, MLP, BatchNormMLP, GPTConfig, gpt_batch, mlp_batch


def combine(model, inputs, nmicros, **options):
    """``microbatch_combine`` called where the pipeline calls it: inside the backend, on Dynamo's graph
    and example inputs; the batch inputs are those of the model's tensor arguments the graph reads."""
    found = []

    def backend(gm, example_inputs):
        batch = [i for i, value in enumerate(example_inputs) if any(value is t for t in inputs)]
        found.append(microbatch_combine(gm, list(example_inputs), batch, nmicros, **options))
        return gm.forward

    try:
        torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    except torch._dynamo.exc.BackendCompilerFailed as failed:
        raise failed.inner_exception from None
    return found[0]


def outputs_of(model, inputs) -> tuple:
    out = model(*inputs)
    return out if isinstance(out, tuple) else (out,)


def _uniform_seed(kind, nmicros: int) -> float:
    """``seed_scale``; a cross-entropy's WeightedMean weighs its micro-batches alike here, where no target is
    ignored (tests/test_padded_loss.py weighs padded ones)."""
    return 1.0 / nmicros if isinstance(kind, WeightedMean) else seed_scale(kind, nmicros)


def assert_exact(model, inputs, kinds, nmicros):
    """Combining the micro-batch outputs by ``kinds`` gives the whole batch's outputs, and the micro-batch
    backwards seeded by ``seed_scale`` (cat: each its slice) give the whole batch's gradients."""
    torch.manual_seed(0)
    params = [p for p in model.parameters() if p.requires_grad]
    whole = outputs_of(model, inputs)
    cotangents = [torch.randn_like(o) for o in whole]
    whole_grads = torch.autograd.grad(sum((o * g).sum() for o, g in zip(whole, cotangents)), params,
                                      allow_unused=True, materialize_grads=True)
    micro_outs, micro_grads = [], [torch.zeros_like(p) for p in params]
    for i in range(nmicros):
        out = outputs_of(model, [t.chunk(nmicros)[i] for t in inputs])
        micro_outs.append([o.detach() for o in out])
        seeded = sum((o * (g.chunk(nmicros)[i] if kind == "cat" else g * _uniform_seed(kind, nmicros))).sum()
                     for o, g, kind in zip(out, cotangents, kinds))
        for total, grad in zip(micro_grads, torch.autograd.grad(seeded, params, allow_unused=True)):
            if grad is not None:
                total += grad
    for k, kind in enumerate(kinds):
        parts = [outs[k] for outs in micro_outs]
        combined = {"cat": lambda: torch.cat(parts), "mean": lambda: torch.stack(parts).mean(0),
                    "sum": lambda: torch.stack(parts).sum(0), "same": lambda: parts[0]}[kind]()
        torch.testing.assert_close(combined, whole[k].detach(), rtol=1e-5, atol=1e-5)
    for whole_grad, micro_grad in zip(whole_grads, micro_grads):
        torch.testing.assert_close(micro_grad, whole_grad, rtol=1e-4, atol=1e-5)


class Lambda(nn.Module):
    """A linear layer and a forward given as a function ``(module, x, y) -> outputs``."""

    def __init__(self, forward, dim: int = 16):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.tensor(2.0))
        self._forward = forward

    def forward(self, x, y):
        return self._forward(self, x, y)


class GPTWithLoss(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.gpt = GPT(cfg)

    def forward(self, idx, targets):
        logits = self.gpt(idx)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class ConvNet(nn.Module):
    def __init__(self, norm: nn.Module, reduction: str = "mean"):
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(3, 8, 3, padding=1), norm, nn.Linear(8, 10)
        self.reduction = reduction

    def forward(self, x, y):
        features = torch.relu(self.norm(self.conv(x))).mean((2, 3))
        return F.cross_entropy(self.head(features), y, reduction=self.reduction)


def image_batch(batch: int = 8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 3, 6, 6, generator=g), torch.randint(0, 10, (batch,), generator=g)


# -- what combines, and exactly --------------------------------------------------------------------------
@pytest.mark.parametrize("nmicros", [2, 4])
def test_mlp_mse_loss_is_a_mean(nmicros):
    torch.manual_seed(0)
    model, batch = MLP(), mlp_batch(8, 0)
    kinds = combine(model, batch, nmicros)
    assert kinds == ["mean"]
    assert_exact(model, batch, kinds, nmicros)


def test_sum_reduced_loss_is_a_sum():
    torch.manual_seed(0)
    model = Lambda(lambda m, x, y: F.mse_loss(m.fc(x).sum(-1), y, reduction="sum"))
    batch = mlp_batch(8, 0)
    kinds = combine(model, batch, 4)
    assert kinds == ["sum"]
    assert_exact(model, batch, kinds, 4)


def test_a_copy_to_the_device_the_batch_is_on_stays_a_mean():
    # transformers' masks: mask(...).to(result.device); the analysis runs on meta tensors, whatever the device
    torch.manual_seed(0)
    model = Lambda(lambda m, x, y: (m.fc(x).sum(-1) * (y > 0).to(y.device, torch.float32)).mean())
    batch = mlp_batch(8, 0)
    kinds = combine(model, batch, 4)
    assert kinds == ["mean"]
    assert_exact(model, batch, kinds, 4)


def test_gpt_logits_are_concatenated_and_its_cross_entropy_averaged():
    torch.manual_seed(0)
    cfg = GPTConfig(layers=2)
    model, batch = GPTWithLoss(cfg), gpt_batch(cfg, 4, 0)
    kinds = combine(model, batch, 4)
    assert kinds == ["cat", "mean"]
    assert_exact(model, batch, kinds, 4)


def test_a_4_layer_gpt_is_analysed_whole():
    cfg = GPTConfig(layers=4)
    model, batch = GPTWithLoss(cfg), gpt_batch(cfg, 8, 0)
    found = []

    def backend(gm, example_inputs):
        users = [i for i, value in enumerate(example_inputs) if any(value is t for t in batch)]
        found.append(microbatch_combine(gm, list(example_inputs), users, 4))
        return gm.forward

    torch.compile(model, backend=backend, fullgraph=True)(*batch)
    assert found == [["cat", "mean"]]      # (its time is a benchmark's business, not a test's)


@pytest.mark.parametrize("loss", [
    lambda m, x, y: (m.fc(x).pow(2).sum(-1) / 16.0).mean(),          # mean of (per-sample value / constant)
    lambda m, x, y: m.fc(x).pow(2).mean() / 3,                        # (mean over the batch) / constant
    lambda m, x, y: m.fc(x).pow(2).mean() + 0.1 * m.fc.weight.pow(2).sum(),   # + a batch-independent term
], ids=["mean-of-scaled", "scaled-mean", "mean-plus-regulariser"])
def test_means_over_the_batch_scaled_or_shifted_by_constants_are_means(loss):
    torch.manual_seed(0)
    model, batch = Lambda(loss), mlp_batch(8, 0)
    kinds = combine(model, batch, 4)
    assert kinds == ["mean"]
    assert_exact(model, batch, kinds, 4)


def test_a_sum_divided_by_a_number_stays_a_sum():
    """Numbers in the graph keep their whole-batch values in every micro-batch (even one Dynamo took from
    ``x.shape[0]``): the micro-batch sums, each divided by 8, add up to the batch's."""
    torch.manual_seed(0)
    model, batch = Lambda(lambda m, x, y: m.fc(x).pow(2).sum() / 8), mlp_batch(8, 0)
    kinds = combine(model, batch, 4)
    assert kinds == ["sum"]
    assert_exact(model, batch, kinds, 4)


def test_an_output_that_does_not_depend_on_the_batch_is_the_same_in_every_micro_batch():
    torch.manual_seed(0)
    model = Lambda(lambda m, x, y: (F.mse_loss(m.fc(x).sum(-1), y), m.fc.weight.sum() * m.scale, m.fc(x)))
    batch = mlp_batch(8, 0)
    kinds = combine(model, batch, 2)
    assert kinds == ["mean", "same", "cat"]
    assert_exact(model, batch, kinds, 2)


def test_convolutions_and_group_norm_split_along_the_batch():
    torch.manual_seed(0)
    model, batch = ConvNet(nn.GroupNorm(2, 8), reduction="sum"), image_batch()
    kinds = combine(model, batch, 4)
    assert kinds == ["sum"]
    assert_exact(model, batch, kinds, 4)


def test_batch_norm_in_eval_mode_is_per_sample():
    torch.manual_seed(0)
    model, batch = ConvNet(nn.BatchNorm2d(8)).eval(), image_batch()
    kinds = combine(model, batch, 2)
    assert kinds == ["mean"]
    assert_exact(model, batch, kinds, 2)


def test_dropout_keeps_the_batch_split():
    model = Lambda(lambda m, x, y: (F.dropout(m.fc(x), 0.1), F.dropout(m.fc(x), 0.1).mean()))
    assert combine(model, mlp_batch(8, 0), 4) == ["cat", "mean"]


def test_one_micro_batch_is_the_batch():
    assert combine(BatchNormMLP(), mlp_batch(8, 0), 1) == ["same"]


def test_gradient_seed_scales():
    assert [seed_scale(kind, 4) for kind in ("cat", "mean", "sum", "same")] == [1.0, 0.25, 1.0, 0.25]
    with pytest.raises(ValueError, match="unknown combine kind"):
        seed_scale("max", 4)


# -- what does not combine, and why ----------------------------------------------------------------------
@pytest.mark.parametrize("model", [BatchNormMLP(), ConvNet(nn.BatchNorm2d(8, track_running_stats=False))],
                         ids=["running-stats", "no-running-stats"])
def test_batch_norm_in_training_mode_is_refused(model):
    batch = mlp_batch(8, 0) if isinstance(model, BatchNormMLP) else image_batch()
    with pytest.raises(MicrobatchError) as error:
        combine(model, batch, 4)
    message = str(error.value)
    assert "BatchNorm in training mode" in message
    assert "statistics differ from the whole batch's" in message
    assert "eval mode" in message                     # what to do
    assert "test_microbatch_outputs.py" in message or "models.py" in message   # where
    assert "While executing" not in message           # fx's trailer is left off: the message names the node


def test_a_max_over_the_batch_is_refused():
    with pytest.raises(MicrobatchError, match=r"output 0 .* is a max over the batch"):
        combine(Lambda(lambda m, x, y: m.fc(x).max()), mlp_batch(8, 0), 4)


@pytest.mark.parametrize("loss,match", [
    (lambda m, x, y: (m.fc(x).sum(-1) * (y > 0)).sum() / (y > 0).sum(),
     r"aten.div.Tensor.*uses the sum over the whole batch as one value"),
    (lambda m, x, y: m.fc(x).pow(2).sum() + m.fc.weight.pow(2).sum(),
     r"adds a value that does not depend on the batch to a sum over the batch.*count 4 times"),
    (lambda m, x, y: m.fc(x).mean().exp(), r"uses the mean over the whole batch as one value"),
    (lambda m, x, y: m.fc(x)[0], r"aten.select.int.*needs the whole batch at once"),
    (lambda m, x, y: m.fc(x).t(), r"holds the batch along dimension 1, not dimension 0"),
    (lambda m, x, y: m.fc(x).log_softmax(0).sum(), r"needs the whole batch at once"),
], ids=["count-normalised", "sum-plus-constant", "exp-of-mean", "one-row",
        "transposed", "softmax-over-batch"])
def test_outputs_that_no_combination_gives_exactly_are_refused(loss, match):
    with pytest.raises(MicrobatchError, match=match):
        combine(Lambda(loss), mlp_batch(8, 0), 4)


@pytest.mark.parametrize("loss", [
    lambda m, x, y: F.cross_entropy(m.fc(x), (y > 0).long(), ignore_index=0),
    lambda m, x, y: F.cross_entropy(m.fc(x), (y > 0).long(), weight=torch.arange(1.0, 17.0)),
], ids=["ignore_index", "class-weights"])
def test_cross_entropy_with_ignored_targets_or_class_weights_is_a_weighted_mean(loss):
    kinds = combine(Lambda(loss), mlp_batch(8, 0), 4)
    assert kinds == ["mean"] and isinstance(kinds[0], WeightedMean)


def test_an_unsplit_input_with_a_batch_dimension_is_refused():
    model = Lambda(lambda m, x, w: (m.fc(x).sum(-1) * w).mean())
    found = []

    def backend(gm, example_inputs):
        x_only = [i for i, value in enumerate(example_inputs) if value is batch[0]]
        with pytest.raises(MicrobatchError, match="not split into micro-batches") as error:
            microbatch_combine(gm, list(example_inputs), x_only, 4)
        found.append(str(error.value))
        return gm.forward

    batch = mlp_batch(8, 0)
    torch.compile(model, backend=backend, fullgraph=True)(*batch)
    assert "l_y_" in found[0]


def test_an_in_place_update_of_an_input_is_refused():
    with pytest.raises(MicrobatchError, match=r"updates graph input l_x_ .* in place: run per micro-batch, "
                                              r"the update happens on each micro-batch.s slice"):
        combine(Lambda(lambda m, x, y: m.fc(x.mul_(2)).mean()), [t.clone() for t in mlp_batch(8, 0)], 4)


def test_a_batch_that_does_not_split_evenly_is_refused():
    with pytest.raises(MicrobatchError, match="batch size 6, which does not split into 4 equal micro-batches"):
        combine(MLP(), mlp_batch(6, 0), 4)


# -- whatever process group there is -----------------------------------------------------------------------
def test_on_a_fake_process_group_of_another_size(fake_world):
    import torch.distributed as dist

    assert dist.get_world_size() == 2
    torch.manual_seed(0)
    model, batch = MLP(), mlp_batch(12, 0)
    for nmicros in (2, 3, 4):
        assert combine(model, batch, nmicros) == ["mean"]


def test_with_no_process_group_and_with_a_real_gloo_group_of_one():
    """In a fresh process: first with no process group at all, then with a real gloo group of world size
    1 and 4 micro-batches."""
    script = textwrap.dedent("""
        import os, sys, tempfile
        import torch, torch.distributed as dist
        sys.path.insert(0, {tests!r})
        from test_microbatch_outputs import GPTWithLoss, combine
        from models import GPTConfig, gpt_batch
        cfg = GPTConfig(layers=1)
        model, batch = GPTWithLoss(cfg), gpt_batch(cfg, 4, 0)
        assert not dist.is_initialized()
        print("none", combine(model, batch, 4))
        torch._dynamo.reset()
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
        print("gloo", dist.get_backend(), dist.get_world_size(), combine(model, batch, 4))
        dist.destroy_process_group()
    """).format(tests=os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith(("none", "gloo"))]
    assert lines == ["none ['cat', 'mean']", "gloo gloo 1 ['cat', 'mean']"]


def combine_symbolic(model, inputs, nmicros):
    """``combine`` on the graph Dynamo traces with ``dynamic=True``: its batch's size input given as the
    pipeline gives it (divided with the batch)."""
    found = []

    def backend(gm, example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        batch = [i for i, value in enumerate(example_inputs) if any(value is t for t in inputs)]
        rows = str(placeholders[batch[0]].meta["example_value"].shape[0])
        sizes = [i for i, value in enumerate(example_inputs) if isinstance(value, torch.SymInt) and str(value) == rows]
        hinted = [int(str(v.node.hint)) if isinstance(v, torch.SymInt) else v for v in example_inputs]
        found.append(microbatch_combine(gm, hinted, batch, nmicros, sizes))
        return gm.forward

    try:
        torch.compile(model, backend=backend, fullgraph=True, dynamic=True)(*inputs)
    except torch._dynamo.exc.BackendCompilerFailed as failed:
        raise failed.inner_exception from None
    return found[0]


def _masked_by_positions(module, x, mask):
    """transformers' padding mask: the mask read by the batch's positions (``masking_utils.sdpa_mask``)."""
    rows = torch.arange(x.shape[0])[:, None, None]
    keep = mask[rows, torch.arange(x.shape[1])[None, None, :]]      # [B, 1, T]
    return (module.fc(x) * keep.transpose(1, 2)).mean()


def test_a_symbolic_batchs_positions_index_its_rows_and_the_outputs_combine_exactly():
    model = Lambda(_masked_by_positions)
    x, mask = torch.randn(8, 5, 16), (torch.rand(8, 5) > 0.3).float()
    kinds = combine_symbolic(model, [x, mask], 4)
    assert kinds == ["mean"], kinds
    assert_exact(model, [x, mask], kinds, 4)
    with pytest.raises(MicrobatchError, match="needs the whole batch at once"):     # static: arange(8), a constant
        combine(model, [x, mask], 4)


def test_anything_else_computed_from_a_symbolic_batchs_positions_is_refused():
    def first_row_only(module, x, mask):
        first = (torch.arange(x.shape[0]) == 0).float()       # each micro-batch's first row, not the batch's
        return (module.fc(x).mean((1, 2)) * first).sum()

    with pytest.raises(MicrobatchError, match="computes with the batch's positions"):
        combine_symbolic(Lambda(first_row_only), [torch.randn(8, 5, 16), torch.ones(8, 5)], 4)

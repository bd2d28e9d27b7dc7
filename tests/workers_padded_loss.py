"""What each rank runs in the padded-loss tests (module level, so spawned processes can import it).

A tiny language model whose loss is a cross-entropy over targets padded with -100 (transformers' labels),
some rows nearly all padding, so that the rows of a batch hold different numbers of counted targets: a
batch split over ranks or micro-batches must weight each part by its count of counted targets (its total
weight), never average the parts' means."""

from __future__ import annotations

import copy
import datetime

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import pipe_split

import dynshard

VOCAB, DIM, SEQ = 24, 16, 8
LR = 0.1


class PaddedLM(nn.Module):
    """An end-to-end module (a sample in, the loss out): embedding, two residual blocks, LM head.

    ``loss``: "plain" (cross_entropy's defaults), "smoothed" (label_smoothing=0.1), "weighted" (class
    weights, a buffer), "shifted" (transformers' causal-LM loss: the labels shifted left inside the model,
    padded with -100 at the end), "ignore_zero" (ignore_index=0 on the labels + 1, padding 0)."""

    def __init__(self, loss: str = "plain", split: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))
                                    for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)
        self.loss, self.split = loss, split
        if loss == "weighted":
            self.register_buffer("class_weight", torch.linspace(0.25, 2.0, VOCAB))

    def forward(self, batch):
        h = self.emb(batch["idx"])
        for i, block in enumerate(self.blocks):
            if self.split and i == 1:
                pipe_split()
            h = h + block(h)
        logits = self.head(h)
        tgt = batch["tgt"]
        if self.loss == "shifted":
            tgt = F.pad(tgt, (0, 1), value=-100)[:, 1:]
        if self.loss == "ignore_zero":
            return F.cross_entropy(logits.flatten(0, 1), (tgt + 1).clamp(0, VOCAB - 1).flatten(), ignore_index=0)
        weight = self.class_weight if self.loss == "weighted" else None
        smoothing = 0.1 if self.loss == "smoothed" else 0.0
        return F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), weight=weight, label_smoothing=smoothing)


def padded_batch(rows: int, seed: int, empty: tuple[int, int] | None = None) -> dict:
    """Token ids and targets; row 1 of every 4 keeps one target, row 2 of every 8 three, the rest
    are padded at random (-100); the rows ``empty`` (start, stop) hold no target at all."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    keep = torch.rand(rows, SEQ, generator=g) > 0.25
    keep[1::4, 1:] = False
    keep[2::8, 3:] = False
    if empty is not None:
        keep[empty[0]:empty[1]] = False
    return {"idx": idx, "tgt": torch.where(keep, tgt, torch.full_like(tgt, -100))}


def _short_timeouts() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))


# case -> (the model's loss, rows without any target, how a step runs, rows per batch). Every case compiles
# a graph or a shape of its own: a second model of the same graph and shape in one process would be served
# the first one's pipeline plan, which holds the first model's tensors (see the report of issue 25 item 9)
CASES = {
    "plain": ("plain", None, "call", 8),
    "smoothed": ("smoothed", None, "call", 8),
    "weighted": ("weighted", None, "call", 8),
    "shifted": ("shifted", None, "call", 8),
    "ignore_zero": ("ignore_zero", None, "call", 8),
    "empty_part": ("plain", "part", "call", 12),   # one micro-batch (pp) / one rank's rows (data) without targets
    "train_step": ("plain", None, "train_step", 8),  # 4 samples of 2 rows: the sum of their losses' gradients
}


def padded_parity(rank: int, world: int, policy: str, cases: list[str], refusal: bool = False, steps: int = 3,
                  compiler: str = "aot_eager") -> dict:
    """For each case, ``steps`` steps of ``loss = model(batch); loss.backward()`` (or ``train_step``) and
    SGD with momentum under ``policy`` (one plan unit of 2 ranks; pp: 4 micro-batches), and the same steps
    on one process: {case: the losses and parameters of both}; with ``refusal``, also
    {"refused_mixed_loss": what :func:`refused_mixed_loss` returns} (one job: spawning one costs seconds)."""
    _short_timeouts()
    results = {case: _parity(policy, case, steps, compiler) for case in cases}
    if refusal:
        torch._dynamo.reset()
        results["refused_mixed_loss"] = refused_mixed_loss(rank, world)
    return results


def _parity(policy: str, case: str, steps: int, compiler: str) -> dict:
    loss, empty, entry, rows = CASES[case]
    if empty == "part":     # pp: micro-batch 1 of 4; data: the second rank's half of the batch
        empty = (rows // 4, rows // 2) if policy == "pp" else (rows // 2, rows)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PaddedLM(loss, split=policy == "pp")
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", options=_config(policy, compiler))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    losses, ref_losses = [], []
    for step in range(steps):
        batch = padded_batch(rows, step, empty)
        if entry == "train_step":
            samples = [{k: v[i:i + 2] for k, v in batch.items()} for i in range(0, rows, 2)]
            losses.append([float(v) for v in dynshard.train_step(compiled, samples)])
            ref = [reference(sample) for sample in samples]
            sum(ref).backward()
            ref_losses.append([float(v.detach()) for v in ref])
        else:
            out = compiled(batch)
            out.backward()
            losses.append(float(out.detach()))
            ref = reference(batch)
            ref.backward()
            ref_losses.append(float(ref.detach()))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"losses": losses, "ref_losses": ref_losses, "params": dynshard.collect_state_dict(compiled),
            "ref_params": {k: v.detach() for k, v in reference.state_dict().items()}}


def _config(policy: str, compiler: str = "aot_eager") -> dynshard.Config:
    options = dict(policy=policy, plan_ngpus=2, compiler=compiler)
    if policy == "pp":
        options.update(use_end2end=True, pas_config={"pipeline_nmicros": 4})
    return dynshard.Config(**options)


class MixedLossLM(PaddedLM):
    """A cross-entropy over padded targets plus a mean over the samples (an activation penalty): the
    micro-batches weigh differently in each, so no combination of the micro-batch losses is exact."""

    def forward(self, batch):
        h = self.emb(batch["idx"])
        for i, block in enumerate(self.blocks):
            if self.split and i == 1:
                pipe_split()
            h = h + block(h)
        logits = self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), batch["tgt"].flatten()) + 0.01 * h.pow(2).mean()


def refused_mixed_loss(rank: int, world: int) -> dict:
    """A plain call of the mixed loss under pp: the error each rank raises (or None)."""
    _short_timeouts()
    torch.manual_seed(0)
    compiled = torch.compile(MixedLossLM(split=True), backend="dynshard", options=_config("pp"))
    try:
        compiled(padded_batch(8, 0)).backward()
    except Exception as error:  # noqa: BLE001 (the test checks which)
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None, "message": ""}

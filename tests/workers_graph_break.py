"""What each rank runs in tests/test_graph_break_dtensors.py: language models whose logits leave one compiled
program split along the vocabulary (``Config(gather_outputs=False)``: a DTensor) and reach the loss in the
next one, across a graph break (module level, so spawned processes can import it)."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import dynshard

VOCAB, SEQ, ROWS, HIDDEN = 64, 8, 2, 16     # ROWS: the batch rows of one data-parallel unit
LR, MOMENTUM, STEPS = 0.1, 0.9, 3


class BrokenLM(nn.Module):
    """A small language model whose logits cross a graph break before ``F.cross_entropy``: its head
    (untied, column-split by ``tp``) runs in one program, the loss in the next."""

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x, y):
        h = self.wte(x)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        logits = self.head(self.norm(h))
        torch._dynamo.graph_break()
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()), logits


class BrokenBigram(nn.Module):
    """The bigram model nanoGPT's lessons start from: the token embedding's table, split along the vocabulary by
    ``tp`` (its lookup is a masked partial sum), gives the logits, flattened as nanoGPT does, and they cross a
    graph break before ``F.cross_entropy``. ``head``: the embedding feeds an LM head directly instead."""

    def __init__(self, vocab: int = VOCAB, head: bool = False):
        super().__init__()
        self.table = nn.Embedding(vocab, HIDDEN if head else vocab)
        self.head = nn.Linear(HIDDEN, vocab, bias=False) if head else None

    def forward(self, x, y):
        logits = self.table(x)
        if self.head is not None:
            logits = self.head(logits)
        B, T, C = logits.shape
        logits = logits.view(B * T, C)
        torch._dynamo.graph_break()
        return F.cross_entropy(logits, y.view(B * T)), logits.view(B, T, C)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "custom":
        return BrokenLM()
    if name in ("bigram", "embedding_head"):
        return BrokenBigram(head=name == "embedding_head")
    if name == "gpt2":
        import transformers

        # loss_type left unset: transformers' warning that "GPT2LMHeadModel" names no loss breaks Dynamo's
        # graph before the loss, which then runs in a second program on the split logits
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=32, attn_pdrop=0.0, resid_pdrop=0.0,
            embd_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config)
    raise ValueError(name)


def make_batch(rows: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    return x, torch.roll(x, -1, dims=1)


def run(model: nn.Module, name: str, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits)."""
    if name == "gpt2":
        out = model(input_ids=x, labels=x)
        return out.loss, out.logits
    return model(x, y)


def train_graph_break(rank: int, world: int, name: str, plan_ngpus: int = 2, steps: int = STEPS) -> dict:
    """Train with dynshard (tp, split outputs returned as DTensors) and, on the same global batch,
    single-process eager; report both, the collectives of every program and what the user was handed."""
    from torch._dynamo.utils import counters

    model = build(name)
    model.train()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy="tp", plan_ngpus=plan_ngpus, gather_outputs=False, compiler="aot_eager"))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    dp_rank, dp_size = dynshard.data_parallel_rank(plan_ngpus)
    losses, ref_losses, caught = [], [], []
    for step in range(steps):
        x, y = make_batch(ROWS * dp_size, step)
        rows = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            loss, logits = run(compiled, name, x[rows], y[rows])
            loss.backward()
        if step == 0:
            caught = [str(w.message) for w in record if str(w.message).startswith("dynshard:")]
            with torch.no_grad():
                _, expected = run(reference, name, x[rows], y[rows])
            placements = tuple(map(str, logits.placements)) if isinstance(logits, DTensor) else None
            logits_error = ((logits.full_tensor() if placements else logits) - expected).abs().max().item()
            loss_type = type(loss).__name__
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)           # ranks of a unit hold the same loss; units hold their rows'
        losses.append(mean.item() / world)
        ref_loss, _ = run(reference, name, x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    report = dynshard.explain(compiled)
    return {
        "losses": losses, "ref_losses": ref_losses,
        "params": dynshard.collect_state_dict(compiled),
        "ref_params": {k: v.detach().clone() for k, v in reference.state_dict().items()},
        "programs": [[(c.phase, c.kind, c.group, c.bytes, tuple(c.shape)) for c in p.collectives]
                     for p in report.programs],
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "logits_placements": placements, "logits_error": logits_error, "loss_type": loss_type,
        "warnings": caught,
        "explain": str(report),
    }

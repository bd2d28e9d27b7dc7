"""What each rank runs in tests/test_random_ops.py: models with dropout, trained under a unit of 2 ranks beside one
process that draws from the same generator state."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dynshard

VOCAB, SEQ, ROWS = 128, 16, 4
LR, MOMENTUM, STEPS = 0.1, 0.9, 3


class Attention(nn.Module):
    """Attention whose heads tp splits, with dropout inside ``scaled_dot_product_attention`` (drawn on the
    split probabilities) and on the whole output."""

    def __init__(self, dim: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.drop = nn.Dropout(0.3)

    def hidden(self, x):
        B, T, C = x.shape
        q, k, v = (m(x).view(B, T, self.heads, C // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5 if self.training else 0.0, is_causal=True)
        return self.drop(self.o(y.transpose(1, 2).reshape(B, T, C)))

    def forward(self, x):
        return self.hidden(x).square().mean()


class DropoutKinds(nn.Module):
    """Dropout of each kind on a hidden activation tp splits (its columns) and data splits (its rows):
    element-wise in place, channels (``Dropout1d``, ``feature_alpha_dropout``), alpha dropout, and a noise
    drawn with ``rand_like``."""

    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        h = F.dropout(self.up(x), 0.2, self.training, inplace=True)       # [rows, tokens, hidden]
        h = torch.relu(h)
        h = F.dropout1d(h.transpose(1, 2), 0.2, self.training).transpose(1, 2)
        h = F.alpha_dropout(h, 0.2, self.training) + F.feature_alpha_dropout(h, 0.2, self.training)
        h = h * (1 + 0.1 * torch.rand_like(h))
        return self.down(h).square().mean()


def gpt2() -> nn.Module:
    """transformers' GPT-2 with its default dropouts (0.1 on embeddings, attention and residuals)."""
    import transformers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False, bos_token_id=0,
        eos_token_id=0))
    model.loss_type = "ForCausalLM"
    return model


def _batch(model_name: str, step: int):
    generator = torch.Generator().manual_seed(100 + step)
    if model_name in ("attention", "dropout kinds"):
        return (torch.randn(ROWS, 8, 16, generator=generator),), {}
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    return (), {"input_ids": ids, "labels": ids}


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def dropout_parity(rank: int, world: int, model_name: str, policy: str, compiler: str, options: dict | None = None,
                   steps: int = STEPS, reference_compiled: bool = False, device: str = "cpu") -> dict:
    """Trains with dynshard and, from the same generator state each step, one process (SGD with momentum):
    eager, or compiled by Inductor (``reference_compiled``: Inductor draws some random numbers its own way).
    Also reports whether both drew as many random numbers (the generator's state after the step). On
    ``device`` "cuda" (benchmarks/cuda_ranks_check.py) with the CUDA generator."""
    torch.manual_seed(0)
    rng = torch.cuda if device == "cuda" else torch
    model = {"attention": Attention, "dropout kinds": DropoutKinds, "gpt2": gpt2}[model_name]().to(device)
    model.train()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy=policy, plan_ngpus=2, compiler=compiler, **(options or {})))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    ref_module = reference
    if reference_compiled:
        reference = torch.compile(reference)
    torch.manual_seed(1)
    losses, ref_losses, same_draws = [], [], []
    for step in range(steps):
        args, kwargs = _batch(model_name, step)
        args, kwargs = [a.to(device) for a in args], {k: v.to(device) for k, v in kwargs.items()}
        before = rng.get_rng_state()
        loss = _loss(compiled(*args, **kwargs))
        loss.backward()
        after = rng.get_rng_state()
        rng.set_rng_state(before)
        ref_loss = _loss(reference(*args, **kwargs))
        ref_loss.backward()
        same_draws.append(torch.equal(rng.get_rng_state(), after))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    report = dynshard.explain(compiled)
    return {"losses": losses, "ref_losses": ref_losses, "same_draws": same_draws,
            "params": {k: v.cpu() for k, v in dynshard.collect_state_dict(compiled).items()},
            "ref_params": {k: v.detach().cpu().clone() for k, v in ref_module.state_dict().items()},
            "collectives": [(c.phase, c.kind) for c in report.collectives()],
            "placements": {n: str(dynshard.get_parallel_dim(p)) for n, p in model.named_parameters()}}


def seeded_per_rank(rank: int, world: int, plan_ngpus: int, seed_of_rank: str, train: bool = True,
                    calls: int = 2, device: str = "cpu") -> dict:
    """Seeds each rank as ``seed_of_rank`` says ("alike", "rank": nanoGPT's seed + rank), then calls
    a tp-split model with dropout; the error each rank raised, or None, and the call it came at."""
    torch.manual_seed(0)
    model = Attention().to(device)
    model.train(train)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy="tp" if plan_ngpus > 1 else "dp", plan_ngpus=plan_ngpus, compiler="aot_eager"))
    dp_rank, _ = dynshard.data_parallel_rank(plan_ngpus)
    torch.manual_seed({"alike": 0, "rank": rank}[seed_of_rank])
    x = torch.randn(ROWS, 8, 16, generator=torch.Generator().manual_seed(dp_rank)).to(device)
    for call in range(calls):
        try:
            loss = compiled(x)
            if train:
                loss.backward()
        except dynshard.UnitInputMismatchError as error:
            return {"error": str(error), "call": call}
    gathered = [torch.empty_like(loss) for _ in range(world)]
    dist.all_gather(gathered, loss.detach())
    return {"error": None, "call": None, "losses": [g.item() for g in gathered]}


class AttentionStack(nn.Module):
    """Four residual attention blocks with dropout, end to end (a batch in, the loss out): a pipeline's model."""

    def __init__(self, layers: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(Attention() for _ in range(layers))

    def forward(self, batch):
        x = batch["x"]
        for block in self.blocks:
            x = x + block.hidden(x)
        return x.square().mean()


def hybrid_seeded(rank: int, world: int, seed_of_rank: str) -> dict:
    """Seeds each rank as ``seed_of_rank`` says ("alike", "rank", "stage": alike on a stage's tp ranks), then
    runs two steps of a hybrid pipeline (2 stages of 2 tp ranks) whose blocks draw dropout; the error each
    rank raised, or None, and the call it came at, and its losses."""
    torch.manual_seed(0)
    model = AttentionStack()
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy="hybrid", plan_ngpus=4, use_end2end=True, compiler="aot_eager",
        pas_config={"pipeline_nstages": 2, "pipeline_nmicros": 2}))
    torch.manual_seed({"alike": 0, "rank": rank, "stage": rank // 2}[seed_of_rank])
    x = torch.randn(ROWS, 8, 16, generator=torch.Generator().manual_seed(0))
    losses = []
    for call in range(2):
        try:
            losses.append([float(v) for v in dynshard.train_step(compiled, [{"x": x[:2]}, {"x": x[2:]}])])
        except dynshard.UnitInputMismatchError as error:
            return {"error": str(error), "call": call}
    return {"error": None, "call": None, "losses": losses}


def all_device_dropout(rank: int, world: int, seeding: str, steps: int = 2) -> dict:
    """1f1b_plus on 2 ranks: the untied test GPT with dropout 0.5 on its embeddings, the all-device stage every
    rank runs, and none in the layers the two pipeline stages run. The ranks seeded ``seeding`` ("alike": 0;
    "apart": rank), after the model is built; its parameters after ``steps`` train_steps."""
    from workers_pipeline import UntiedEndToEndGPT, build

    _, make = build("untied_gpt")

    class EmbeddingDropout(UntiedEndToEndGPT):
        def forward(self, batch):
            idx = batch["idx"]
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            x = F.dropout(x, 0.5, self.training)
            for block in self.blocks:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["tgt"].reshape(-1))

    from models import GPTConfig

    torch.manual_seed(0)
    model = EmbeddingDropout(GPTConfig(layers=4))
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy="pp", plan_ngpus=2, use_end2end=True, compiler="aot_eager",
        pas_config={"pipeline_nmicros": 4, "pipeline_scheduler": "1f1b_plus"}))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    torch.manual_seed({"alike": 0, "apart": rank}[seeding])
    losses = []
    for step in range(steps):
        batch = make(8, step)
        samples = [{k: v[i * 2:(i + 1) * 2] for k, v in batch.items()} for i in range(4)]
        losses.append([float(v) for v in dynshard.train_step(compiled, samples)])
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": dynshard.collect_state_dict(compiled)}

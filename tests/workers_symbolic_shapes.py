"""Rank functions for tests/test_symbolic_shapes.py: graphs Dynamo traces with symbolic sizes.

Each rank pads its own rows (a different sequence length on every rank and every step, as transformers'
padding collators give), the model is compiled with ``dynamic=True`` (or ``mark_dynamic``), and a one-process
eager copy trains on every rank's rows, each unit's mean loss averaged as dp averages gradients. SGD with
momentum: every update depends on every gradient so far.
"""

from __future__ import annotations

import contextlib
import copy
import json
import tempfile

import torch
import torch.distributed as dist

import dynshard

LR, MOMENTUM, DIM = 0.05, 0.9, 8


class TokenMLP(torch.nn.Module):
    """Rows of tokens ``[batch, length, DIM]``: a per-token MLP, a LayerNorm and a mean over the length."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(DIM, 4 * DIM), torch.nn.Linear(4 * DIM, DIM)
        self.norm = torch.nn.LayerNorm(DIM)

    def forward(self, x, target):
        h = self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))
        return torch.nn.functional.mse_loss(h.mean(dim=1), target)


def lengths(steps: int, world: int) -> list[list[int]]:
    """Per step, each rank's sequence length: all different, none repeated (>= 2: Dynamo keeps 0 and 1
    static)."""
    return [[3 + step * world + rank for rank in range(world)] for step in range(steps)]


def _batch(step: int, rank: int, length: int, rows: int = 2):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, length, DIM, generator=generator), torch.randn(rows, DIM, generator=generator)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def train_lengths(rank: int, world: int, options: dict, steps: int, mark: str = "dynamic",
                  accumulation: int = 1, first_step: int = 0) -> dict:
    """``mark``: "dynamic" (``torch.compile(dynamic=True)``), "mark_dynamic" (the length dimension of the
    first batch) or "automatic" (neither: torch.compile's automatic dynamic shapes). ``accumulation``: micro-steps per optimizer step, the first ones under ``no_sync``."""
    return _train_over_lengths(rank, world, options, lengths(first_step + steps, world)[first_step:], 1, mark,
                               accumulation)


def train_lengths_in_units(rank: int, world: int, options: dict, steps: int, plan_ngpus: int,
                           per_step: list[list[int]] | None = None, accumulation: int = 1,
                           model: str = "TokenMLP", mark: str = "dynamic") -> dict:
    """Units of ``plan_ngpus`` ranks (tp): the ranks of a unit read one batch, the units their own lengths
    (``per_step``: each step's, per unit). A step that raises ends the run: its error is returned."""
    per_step = per_step or lengths(steps, world // plan_ngpus)
    return _train_over_lengths(rank, world, {"plan_ngpus": plan_ngpus, **options}, per_step, plan_ngpus,
                               mark, accumulation, stop_at_error=True, model_class=globals()[model])


def train_one_row_on_one_rank(rank: int, world: int, options: dict, steps: int, alone_step: int,
                              mark: str = "dynamic", model_class: type | None = None) -> dict:
    """Every rank 2 rows per step, but the last rank 1 row at ``alone_step`` (Dynamo keeps a size of 1 out of
    a symbolic family: only that rank compiles). A step that raises ends the run: its error is returned."""
    def rows(step: int, unit: int) -> int:
        return 1 if (step, unit) == (alone_step, world - 1) else 2
    return _train_over_lengths(rank, world, options, lengths(steps, world), 1, mark, 1, stop_at_error=True,
                               rows=rows, model_class=model_class)


@torch.library.custom_op("dynshard_tests::doubled", mutates_args=())
def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


doubled.register_fake(torch.empty_like)
doubled.register_autograd(lambda ctx, grad: doubled(grad))


def _doubled_placements(x):
    """DTensor's rule for ``doubled``: any placement, kept; a rule that cannot reason on symbolic sizes."""
    from torch.distributed.tensor import Replicate, Shard

    if any(isinstance(size, torch.SymInt) for size in x.shape):
        raise NotImplementedError("doubled has no sharding rule for symbolic sizes")
    return [([p], [p]) for p in (Replicate(), *(Shard(d) for d in range(len(x.shape))))]


class OpaqueToSymbols(TokenMLP):
    """TokenMLP with an op between its two layers (a custom op of this module) that DTensor places at
    concrete sizes only: its program on symbols fails, and every rank compiles a program per size."""

    def __init__(self):
        super().__init__()
        from torch.distributed.tensor.experimental import register_sharding

        register_sharding(torch.ops.dynshard_tests.doubled.default)(_doubled_placements)

    def forward(self, x, target):
        h = self.norm(x + self.down(doubled(torch.nn.functional.gelu(self.up(x)))))
        return torch.nn.functional.mse_loss(h.mean(dim=1), target)


class BranchOnRows(TokenMLP):
    """A Python branch on the batch's size: a batch of one row computes no gradient for a layer (nor the
    collective that would carry it)."""

    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Linear(DIM, DIM)

    def forward(self, x, target):
        extra = self.extra(x)
        x = x + (extra if x.shape[0] > 1 else extra.detach())
        return super().forward(x, target)


def _train_over_lengths(rank: int, world: int, options: dict, per_step: list[list[int]], plan_ngpus: int,
                        mark: str, accumulation: int, stop_at_error: bool = False, rows=None,
                        model_class: type | None = None) -> dict:
    """Each unit trains on its own length at every step; a one-process copy trains on every unit's batch,
    their mean losses averaged as dp averages gradients. ``stop_at_error``: a step that raises ends the run
    and its error is returned (else it fails the rank). ``rows(step, unit)``: the rows of a unit's batch (2)."""
    torch.manual_seed(0)
    model = (model_class or TokenMLP)()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(**options),
                             dynamic=True if mark == "dynamic" else None)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    units, unit = world // plan_ngpus, rank // plan_ngpus
    losses, ref_losses, error = [], [], None
    for step, per_unit in enumerate(per_step):
        batches = [_batch(step, u, length, rows(step, u) if rows else 2) for u, length in enumerate(per_unit)]
        x, target = batches[unit]
        if mark == "mark_dynamic" and step == 0:
            torch._dynamo.mark_dynamic(x, 1)
        micro = step % accumulation < accumulation - 1
        try:
            with dynshard.no_sync(compiled) if micro else contextlib.nullcontext():
                loss = compiled(x, target)
                (loss / accumulation).backward()
        except Exception as raised:      # noqa: BLE001  (the test reads the type and message)
            if not stop_at_error:
                raise
            error = f"{type(raised).__name__}: {raised}"
            break
        ref_loss = sum(reference(*b) for b in batches) / units
        (ref_loss / accumulation).backward()
        if not micro:
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        ref_losses.append(ref_loss.item())
    report = dynshard.explain(compiled)
    return {"losses": losses, "ref_losses": ref_losses, "params": dynshard.collect_state_dict(compiled),
            "ref_params": {k: v.detach().clone() for k, v in reference.state_dict().items()},
            "error": error, "graphs": _graphs(), "programs": len(report.programs),
            "plans": [json.loads(plan.to_json()) for plan in report.plans],
            "sizes": [p.compiled_sizes for p in report.programs], "symbolic": [p.symbolic for p in report.programs],
            "saved": [p.saved_bytes for p in report.programs],
            "local": {k: tuple(v.shape) for k, v in model.state_dict().items()}}


def saved_then_loaded(rank: int, world: int, path: str, options: dict, load: bool, plan_ngpus: int = 1) -> dict:
    """A symbolic job (units of ``plan_ngpus`` ranks) that saves its plans (``load`` False: 2 steps), or a later
    job that runs them (``load`` True: 3 steps, other lengths than the saving job's first); the length marked
    dynamic."""
    steps, first = (3, 5) if load else (2, 0)
    per_step = lengths(first + steps, world // plan_ngpus)[first:]
    options = {**options, "plan_ngpus": plan_ngpus, ("load_plan_path" if load else "save_plan_path"): path}
    result = _train_over_lengths(rank, world, options, per_step, plan_ngpus, "mark_dynamic", 1)
    if not load:
        return result
    with open(path) as f:
        result["saved"] = f.read()
    return result


def modes_and_ends(rank: int, world: int, options: dict | None = None) -> list[tuple[str, int]]:
    """Dynamo graphs after each phase: training over lengths, eval under no_grad and inference_mode at other
    batch sizes and lengths, the ragged last batch of an epoch, a batch of one row; then, per program, whether
    it was compiled on symbols and the sizes it was compiled at (a program per size). Under a unit of several
    ranks (``options``' plan_ngpus) the unit's ranks read one batch (rank 0's)."""
    torch.manual_seed(0)
    model = TokenMLP()
    options = {"compiler": "aot_eager", **(options or {})}
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(**options), dynamic=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rank = rank if options.get("plan_ngpus", 1) == 1 else 0
    seen = []
    for step in range(4):
        compiled(*_batch(step, rank, 5 + step + rank, rows=4)).backward()
        opt.step()
        opt.zero_grad()
    seen.append(("train", _graphs()))
    with torch.no_grad():
        for length in (7, 9, 13):
            compiled(*_batch(9, rank, length, rows=3))
    seen.append(("no_grad", _graphs()))
    with torch.inference_mode():
        for length in (7, 11):
            compiled(*_batch(9, rank, length, rows=5))
    seen.append(("inference_mode", _graphs()))
    compiled(*_batch(20, rank, 6, rows=3)).backward()
    seen.append(("ragged last batch", _graphs()))
    compiled(*_batch(21, rank, 6, rows=1)).backward()
    seen.append(("one row", _graphs()))
    seen.append(tuple((p.symbolic, p.compiled_sizes) for p in dynshard.explain(compiled).programs))
    return seen


# ------------------------------------------------------------------------- Trainer with a padding collator

def _tokenizer(vocab: int):
    """A word-level tokenizer built in memory (no download): what a padding collator needs, a pad token."""
    import tokenizers
    import transformers

    words = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, vocab)}}
    model = tokenizers.models.WordLevel(words, unk_token="[UNK]")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(model), pad_token="[PAD]",
                                                unk_token="[UNK]")


def trainer_padding(rank: int, world: int, options: dict, steps: int, plan_ngpus: int = 1,
                    dynamic: bool | None = True, pad_to_multiple_of: int | None = None) -> dict:
    """transformers' Trainer, ``DataCollatorForLanguageModeling(mlm=False)``: each rank's rows padded to its
    own longest (labels -100 at the padding), a new length nearly every step; the compiled Llama with
    ``dynamic=True`` (``dynamic``: None for torch.compile's automatic dynamic shapes; ``pad_to_multiple_of``
    the collator's, as context parallelism asks). The reference replays every unit's batch in one process with the token count Trainer
    passed (``num_items_in_batch``, over all ranks: each unit's tokens ``plan_ngpus`` times), so its gradient
    is the mean over every unit's tokens."""
    import transformers
    from workers_trainer import LR as T_LR, MAX_NORM, MOMENTUM as T_MOMENTUM, build_llama, unit_trainer_class

    model = build_llama()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(plan_ngpus=plan_ngpus, **options),
                             dynamic=dynamic)
    generator = torch.Generator().manual_seed(3)
    rows = [{"input_ids": torch.randint(2, 128, (int(n),), generator=generator).tolist()}
            for n in torch.randint(4, 30, (64,), generator=generator)]
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, max_steps=steps, learning_rate=T_LR,
        lr_scheduler_type="constant", max_grad_norm=MAX_NORM, report_to=[], save_strategy="no", logging_steps=1,
        remove_unused_columns=False, use_cpu=True, seed=0, disable_tqdm=True)
    opt = torch.optim.SGD(model.parameters(), lr=T_LR, momentum=T_MOMENTUM)
    fed = []

    class Recording(unit_trainer_class()):
        def training_step(self, model, inputs, num_items_in_batch=None):
            fed.append(({k: v.clone() for k, v in inputs.items()}, num_items_in_batch))
            loss = super().training_step(model, inputs, num_items_in_batch)
            losses.append(loss.item())
            return loss

    losses: list[float] = []
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(128), mlm=False,
                                                            pad_to_multiple_of=pad_to_multiple_of)
    Recording(model=compiled, args=args, train_dataset=rows, data_collator=collator, optimizers=(opt, None),
              plan_ngpus=plan_ngpus).train()

    gathered: list = [None] * world
    dist.all_gather_object(gathered, fed)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=T_LR, momentum=T_MOMENTUM)
    ref_losses = []
    for step in range(len(fed)):
        total = 0.0
        for inputs, count in (unit[step] for unit in gathered[::plan_ngpus]):
            loss = reference(**inputs, num_items_in_batch=count // plan_ngpus).loss
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(total)
    mean = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean)
    return {"losses": (mean / world).tolist(), "ref_losses": ref_losses,
            "params": dynshard.collect_state_dict(compiled),
            "ref_params": {k: v.detach().clone() for k, v in reference.state_dict().items()},
            "lengths": [tuple(inputs["input_ids"].shape) for inputs, _ in fed], "graphs": _graphs(),
            "programs": len(dynshard.explain(compiled).programs),
            "symbolic": [p.symbolic for p in dynshard.explain(compiled).programs]}


# ------------------------------------------------------------------------- pipelines over lengths

class _OneSample(torch.nn.Module):
    """``model(sample)``, as ``dynshard.train_step`` calls it: the sample is ``(idx, tgt)``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, sample):
        return self.model(*sample)


def pipeline_lengths(rank: int, world: int, options: dict, per_step: list[list[int]], entry: str = "plain",
                     rows: int = 4) -> dict:
    """A Llama (tests/models.LlamaLM) under a pipeline plan, compiled with ``dynamic=True``: each unit of
    ``plan_ngpus`` ranks trains on its own length at every step (``per_step``: the lengths per unit).
    ``entry`` "plain": ``model(batch).backward()``, the batch's mean loss; "train_step": one call per
    micro-batch through ``dynshard.train_step``, the micro-batches' losses summed (nnScaler's semantics).
    The one-process reference trains on every unit's batch, the units averaged as dp averages gradients."""
    from models import GPTConfig, LlamaLM

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=64, d_model=32, heads=4, layers=2)
    model = _OneSample(LlamaLM(cfg))
    reference = copy.deepcopy(model)
    compiled = torch.compile(model if entry == "train_step" else model.model, backend="dynshard",
                             options=dynshard.Config(**options), dynamic=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    plan_ngpus = options["plan_ngpus"]
    units, unit = world // plan_ngpus, rank // plan_ngpus
    m = options["pas_config"]["pipeline_nmicros"]
    losses, ref_losses = [], []
    for step, per_unit in enumerate(per_step):
        batches = []
        for u, length in enumerate(per_unit):
            generator = torch.Generator().manual_seed(1000 * step + u)
            batches.append(tuple(torch.randint(0, cfg.vocab, (rows, length), generator=generator) for _ in range(2)))
        idx, tgt = batches[unit]
        if entry == "train_step":
            rows_of = lambda t, k: t[k::m]      # noqa: E731  (strided samples: every m-th row)
            samples = [(rows_of(idx, k), rows_of(tgt, k)) for k in range(m)]
            loss = sum(float(v) for v in dynshard.train_step(compiled, samples))
            ref_loss = sum(reference((rows_of(i, k), rows_of(t, k))) for i, t in batches for k in range(m)) / units
        else:
            loss = compiled(idx, tgt)
            loss.backward()
            loss = loss.item()
            ref_loss = sum(reference(b) for b in batches) / units
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        mean = torch.tensor(loss)
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        ref_losses.append(ref_loss.item())
    report = dynshard.explain(compiled)
    params = dynshard.collect_state_dict(compiled)
    return {"losses": losses, "ref_losses": ref_losses,
            "params": params if entry == "train_step" else {f"model.{k}": v for k, v in params.items()},
            "ref_params": {k: v.detach().clone() for k, v in reference.state_dict().items()},
            "graphs": _graphs(), "plans": [json.loads(plan.to_json()) for plan in report.plans],
            "shapes": [p.compiled_shapes for p in report.pipelines]}


def pipeline_duck_shaped(rank: int, world: int, options: dict) -> str:
    """What a pipeline raises on a symbolic graph whose first batch has as many rows as tokens (Dynamo then
    gives both dimensions one symbol)."""
    from models import GPTConfig, LlamaLM

    model = LlamaLM(GPTConfig(vocab=64, seq=64, d_model=32, heads=4, layers=2))
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(**options), dynamic=True)
    idx = torch.randint(0, 64, (4, 4))
    try:
        compiled(idx, idx).backward()
    except Exception as error:     # noqa: BLE001  (the test reads the type and message)
        return f"{type(error).__name__}: {error}"
    return "no error"


def pipeline_then_eval_generate_and_save(rank: int, world: int, out: str) -> dict:
    """A transformers Llama under pp with ``dynamic=True``: three steps at three lengths with padded rows
    (attention mask, labels -100), then eval under no_grad at an unseen batch and length, ``generate`` inside
    ``summon_full_params``, and ``save_pretrained`` read back by ``from_pretrained`` in one process."""
    import transformers
    from workers_trainer import build_llama

    model = build_llama()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", dynamic=True, options=dynshard.Config(
        policy="pp", plan_ngpus=2, use_end2end=True, compiler="aot_eager", pas_config={"pipeline_nmicros": 2}))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for step, length in enumerate([9, 14, 11]):
        generator = torch.Generator().manual_seed(step)
        ids = torch.randint(2, 128, (4, length), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, length - 3:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        for m, o in ((compiled, opt), (reference, ref_opt)):
            m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            o.step()
            o.zero_grad()
    ids = torch.randint(2, 128, (6, 17), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        result = {"eval": (compiled(input_ids=ids).logits - expected).abs().max().item()}
    with dynshard.summon_full_params(model):
        generated = model.generate(ids[:2, :5], max_new_tokens=4, do_sample=False)
    result["generate_equal"] = torch.equal(generated, reference.generate(ids[:2, :5], max_new_tokens=4,
                                                                         do_sample=False))
    model.save_pretrained(out)
    if rank == 0:
        loaded = transformers.LlamaForCausalLM.from_pretrained(out)
        with torch.no_grad():
            result["loaded"] = (loaded(input_ids=ids).logits - expected).abs().max().item()
    return result


def split_logits_over_lengths(rank: int, world: int, dynamic: bool | None) -> dict:
    """tp over both ranks with ``gather_outputs=False``: the logits cross a graph break split along the
    vocabulary (workers_graph_break.BrokenLM); three steps at three lengths. What each step raised, if any."""
    from workers_graph_break import BrokenLM

    torch.manual_seed(0)
    model = BrokenLM()
    compiled = torch.compile(model, backend="dynshard", dynamic=dynamic, options=dynshard.Config(
        policy="tp", plan_ngpus=2, compiler="aot_eager", gather_outputs=False))
    out = {"error": None, "steps": 0}
    for step, length in enumerate((4, 6, 8)):
        idx = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(step))
        try:
            loss, _ = compiled(idx, torch.roll(idx, -1, dims=1))
            loss.backward()
        except Exception as error:     # noqa: BLE001  (the test reads the type and message)
            out["error"] = f"{type(error).__name__}: {error}"
            break
        out["steps"] += 1
    out["graphs"] = _graphs()
    return out


def _gpt2() -> torch.nn.Module:
    """transformers' GPT-2, tiny, no dropout: its blocks are repeated (compiled once, outlined)."""
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))


def tp_lm_eval_at_other_batch_sizes(rank: int, world: int, dynamic: bool | None, name: str = "llama") -> dict:
    """A tp language model of transformers' (``name``: "llama" or "gpt2"; one unit of both ranks) trained at 2
    rows over three lengths, then evaluated under no_grad at 3 and 5 rows: the eval graph's batch is symbolic,
    flattened with the split heads. Per call, the largest difference to one process (loss, then logits in
    eval); per program, whether it was compiled on symbols."""
    from workers_trainer import build_llama

    model = build_llama() if name == "llama" else _gpt2()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", dynamic=dynamic,
                             options=dynshard.Config(plan_ngpus=2, policy="tp", compiler="aot_eager"))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in (model, reference))
    generator = torch.Generator().manual_seed(0)
    differences = []
    for length in (5, 9, 12):
        ids = torch.randint(0, 100, (2, length), generator=generator)
        losses = []
        for m, o in ((compiled, opt), (reference, ref_opt)):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        differences.append(abs(losses[0] - losses[1]))
    with torch.no_grad():
        for rows, length in ((3, 7), (5, 9)):
            ids = torch.randint(0, 100, (rows, length), generator=generator)
            out, ref = compiled(input_ids=ids, labels=ids), reference(input_ids=ids, labels=ids)
            differences.append(max(abs(out.loss.item() - ref.loss.item()),
                                   (out.logits - ref.logits).abs().max().item()))
    return {"differences": differences, "symbolic": [p.symbolic for p in dynshard.explain(compiled).programs],
            "graphs": _graphs()}

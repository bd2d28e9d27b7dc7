"""What each rank runs in tests/test_trainer.py: transformers' Trainer around a dynshard model (module
level, so spawned processes can import it).

Trainer (through accelerate) wraps the model it is given in DistributedDataParallel; dynshard releases
that DDP at its first compile (a pass-through: no reducer). Each job trains a small Llama for a few steps
with SGD + momentum and Trainer's default clipping (max_grad_norm=1.0), records the batches every rank was
fed and the loss of every step, profiles the gloo collectives of one step, and then trains a single-process
eager reference on the same global batches.
"""

from __future__ import annotations

import copy
import functools
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import dynshard

VOCAB, SEQ, ROWS = 128, 16, 2        # ROWS: rows of one data-parallel unit per step
LR, MOMENTUM, STEPS, MAX_NORM = 0.1, 0.9, 3, 1.0
PROFILED_STEP = 1                    # after the first step's compile
GLOO_COLLECTIVE = "gloo:"            # the profiler's name of what went over the wire


def build_llama() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return transformers.LlamaForCausalLM(config)


def dataset(samples: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(0, VOCAB, (samples, SEQ), generator=generator)
    return [{"input_ids": row, "labels": row} for row in rows]


def unit_trainer_class():
    """docs/transformers.md's recipe: Trainer's dataloader split over the data-parallel units, not over the world."""
    import transformers

    class UnitTrainer(transformers.Trainer):
        def __init__(self, *args, plan_ngpus: int = 1, **kwargs):
            super().__init__(*args, **kwargs)
            self.plan_ngpus = plan_ngpus

        def get_train_dataloader(self) -> DataLoader:
            dp_rank, dp_size = dynshard.data_parallel_rank(self.plan_ngpus)
            sampler = DistributedSampler(self.train_dataset, num_replicas=dp_size, rank=dp_rank,
                                         shuffle=True, seed=self.args.seed)
            return DataLoader(self.train_dataset, batch_size=self.args.per_device_train_batch_size,
                              sampler=sampler, collate_fn=self.data_collator,
                              drop_last=self.args.dataloader_drop_last)

    return UnitTrainer


def _recording(trainer_class):
    """A Trainer that also records every micro-step's inputs and loss, and the gloo collectives of one step."""
    import transformers

    class Recording(trainer_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.fed, self.losses, self.events = [], [], []
            self.add_callback(_Profile(self))

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.fed.append(inputs["input_ids"].clone())
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.losses.append(loss.item())
            return loss

    class _Profile(transformers.TrainerCallback):
        def __init__(self, trainer):
            self.trainer, self.profiler = trainer, None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == PROFILED_STEP:
                self.profiler = torch.profiler.profile(record_shapes=True)
                self.profiler.start()

        def on_step_end(self, args, state, control, **kwargs):
            if self.profiler is not None:
                self.profiler.stop()
                self.trainer.events = [(e.name[len(GLOO_COLLECTIVE):], [list(s) for s in e.input_shapes if s])
                                       for e in self.profiler.events() if e.name.startswith(GLOO_COLLECTIVE)]
                self.profiler = None

    return Recording


def train_with_trainer(rank: int, world: int, options: dict, plan_ngpus: int = 1, wrap: str = "trainer",
                       steps: int = STEPS, accumulation: int = 1, trainer_args: dict | None = None) -> dict:
    """Trainer on a compiled Llama (``wrap="trainer"``: Trainer's own DDP; ``"user"``: the model handed to
    Trainer is already ``DistributedDataParallel(compiled)``), then the eager reference."""
    import transformers

    model = build_llama()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard",
                             options=dynshard.Config(compiler="aot_eager", plan_ngpus=plan_ngpus, **options))
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=ROWS, gradient_accumulation_steps=accumulation,
        max_steps=steps, learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=MAX_NORM, report_to=[],
        save_strategy="no", logging_steps=1, remove_unused_columns=False, use_cpu=True, seed=0,
        disable_tqdm=True, **(trainer_args or {}))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    given = compiled
    if wrap == "user":
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        given = torch.nn.parallel.DistributedDataParallel(compiled)
    trainer = _recording(unit_trainer_class())(
        model=given, args=args, train_dataset=dataset(64), optimizers=(opt, None), plan_ngpus=plan_ngpus)
    trainer.train()

    ddp = trainer.model_wrapped
    ddps = [m for m in (ddp, given) if isinstance(m, torch.nn.parallel.DistributedDataParallel)]
    grad_norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    report = dynshard.explain(compiled)
    ref_losses, ref_norms = _reference(reference, trainer.fed, plan_ngpus, accumulation)
    return {
        "losses": _mean_over_ranks(trainer.losses, world),
        "ref_losses": ref_losses,
        "grad_norms": grad_norms, "ref_norms": ref_norms,
        "params": dynshard.collect_state_dict(compiled),
        "ref_params": {k: v.detach().clone() for k, v in reference.state_dict().items()},
        "ddps": len(ddps),
        "ddp_reducers": [hasattr(d, "reducer") for d in ddps],
        "ddp_ignored": all(getattr(p, "_ddp_ignored", False) for p in model.parameters()),
        "events": trainer.events,
        "collectives": [(c.phase, c.kind, c.group, c.bytes, tuple(c.shape)) for c in report.collectives()],
        "programs": len(report.programs),
        "explain": str(report),
    }


def _mean_over_ranks(values: list[float], world: int) -> list[float]:
    """Each step's loss over the whole global batch: units hold their rows' (Trainer scales it by the
    world over the tokens of every rank), the ranks of a unit the same."""
    total = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(total)
    return (total / world).tolist()


def _reference(model: torch.nn.Module, fed: list[torch.Tensor], plan_ngpus: int,
               accumulation: int) -> tuple[list[float], list[float]]:
    """One process, eager: every micro-step on the rows the units were fed (unit order), Trainer's clipping."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, fed)
    units = gathered[::plan_ngpus]       # the first rank of each unit
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    for step in range(len(fed)):
        rows = torch.cat([unit[step] for unit in units])
        loss = model(input_ids=rows, labels=rows).loss / accumulation
        loss.backward()
        losses.append(loss.item())
        if (step + 1) % accumulation == 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            opt.step()
            opt.zero_grad()
    return losses, norms


def with_ddp_kept(fn, *args, **kwargs):
    """``fn`` with dynshard's release switched off (what happened before): DDP reduces every gradient again."""
    from dynshard.runtime import ddp

    torch._dynamo.callback_handler.start_callbacks.remove(ddp._on_compile_start)
    ddp.watch = lambda: None
    return fn(*args, **kwargs)


def trainer_without_release(rank: int, world: int, *args, **kwargs) -> dict:
    return with_ddp_kept(functools.partial(train_with_trainer, rank, world), *args, **kwargs)


# ---------------------------------------------------------------------------------- a user's own DDP

def user_ddp(rank: int, world: int, options: dict, plan_ngpus: int = 1, steps: int = STEPS) -> dict:
    """``DistributedDataParallel(torch.compile(model, backend="dynshard"))`` in a plain loop. DDP's buckets
    are made tiny, so that Dynamo's DDPOptimizer would cut the graph into pieces (as it does any model over
    1 MB): dynshard must still get it whole."""
    dist.init_process_group("gloo")
    model = build_llama()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard",
                             options=dynshard.Config(compiler="aot_eager", plan_ngpus=plan_ngpus, **options))
    torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = 1024    # DDPOptimizer's first bucket: 1 MB, the model's 0.1
    ddp = torch.nn.parallel.DistributedDataParallel(compiled, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    dp_rank, dp_size = dynshard.data_parallel_rank(plan_ngpus)
    rows = torch.stack([sample["input_ids"] for sample in dataset(ROWS * dp_size * steps)])
    fed, losses = [], []
    for step in range(steps):
        batch = rows[(step * dp_size + dp_rank) * ROWS:(step * dp_size + dp_rank + 1) * ROWS]
        fed.append(batch)
        loss = ddp(input_ids=batch, labels=batch).loss
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    ref_losses, _ = _reference(reference, fed, plan_ngpus, 1)
    return {"losses": _mean_over_ranks(losses, world), "ref_losses": ref_losses,
            "params": dynshard.collect_state_dict(compiled),
            "ref_params": {k: v.detach().clone() for k, v in reference.state_dict().items()},
            "ddp_reducers": [hasattr(ddp, "reducer")], "programs": len(dynshard.explain(compiled).programs)}


# ------------------------------------------------------------------------------------------- refused

def refused_wraps(rank: int, world: int) -> dict:
    """DDPs dynshard cannot leave as pass-throughs: what each rank raised (None: nothing)."""
    dist.init_process_group("gloo")
    x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))   # one unit: the same rows
    errors = {}

    # 1. only a submodule is compiled with dynshard, and DDP was not told to ignore its parameters
    torch.manual_seed(0)
    outer = torch.nn.ModuleDict({"embed": torch.nn.Embedding(VOCAB, 32), "body": torch.nn.Linear(32, 32)})
    outer.body = torch.compile(outer.body, backend="dynshard", options=dynshard.Config(compiler="aot_eager"))
    ddp = torch.nn.parallel.DistributedDataParallel(_Outer(outer))
    errors["mixed"] = _raised(lambda: ddp(x).sum().backward())

    # 2. DDP built after dynshard's first step had cut the parameters (tp)
    model = build_llama()
    compiled = torch.compile(model, backend="dynshard",
                             options=dynshard.Config(policy="tp", plan_ngpus=2, compiler="aot_eager"))
    compiled(input_ids=x, labels=x).loss.backward()
    late = torch.nn.parallel.DistributedDataParallel(compiled)
    errors["late"] = _raised(lambda: late(input_ids=x, labels=x))
    return errors


class _Outer(torch.nn.Module):
    def __init__(self, parts: torch.nn.ModuleDict):
        super().__init__()
        self.parts = parts

    def forward(self, x):
        return self.parts.body(self.parts.embed(x))


def _raised(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as error:       # noqa: BLE001  (the test reads the type and the message)
        return type(error).__name__, str(error)
    return None

"""What each rank runs in tests/test_pretrained.py: transformers' own checkpoints of a dynshard model
(``save_pretrained``, Trainer's ``checkpoint-N`` and resuming from it) hold the whole trained model."""

from __future__ import annotations

import copy
import os
import time

import torch
import torch.distributed as dist

import dynshard
from workers_trainer import LR, MOMENTUM, ROWS, VOCAB as VOCAB_SIZE, _mean_over_ranks, _recording, build_llama, dataset, unit_trainer_class

STEPS, SAVE_EVERY = 4, 2


def _config(options: dict) -> dynshard.Config:
    return dynshard.Config(compiler="aot_eager", **options)


def _train_two_steps(model, reference, options: dict) -> None:
    """Two SGD steps of the compiled ``model`` (its trainable tensors) on this unit's rows, and of the one-process
    ``reference`` on the global batch."""
    compiled = torch.compile(model, backend="dynshard", options=_config(options))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=MOMENTUM)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=LR, momentum=MOMENTUM)
    dp_rank, dp_size = dynshard.data_parallel_rank(options.get("plan_ngpus", 1))
    rows = torch.stack([row["input_ids"] for row in dataset(4 * dp_size)])
    for step in range(2):
        batch = rows[step * 2 * dp_size:(step + 1) * 2 * dp_size]
        mine = batch[dp_rank * 2:(dp_rank + 1) * 2]
        compiled(input_ids=mine, labels=mine).loss.backward()
        reference(input_ids=batch, labels=batch).loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()


def save_pretrained_after_training(rank: int, world: int, options: dict, directory: str) -> dict:
    """Two SGD steps beside one process, then ``save_pretrained`` on every rank; rank 0 reloads the files in
    this process with ``from_pretrained``."""
    import transformers

    model = build_llama()
    reference = copy.deepcopy(model)
    _train_two_steps(model, reference, options)
    local = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    started = time.perf_counter()
    model.save_pretrained(directory)
    result = {"seconds": time.perf_counter() - started, "local_shapes": local}
    if rank == 0:
        loaded = transformers.LlamaForCausalLM.from_pretrained(directory)
        result["params"] = {k: v.detach().clone() for k, v in loaded.state_dict().items()}
        result["ref_params"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}
        result["files"] = sorted(os.listdir(directory))
    return result


def save_pretrained_on_rank_zero_alone(rank: int, world: int, directory: str) -> dict:
    """tp: ``save_pretrained`` on rank 0 only must refuse, within seconds, rather than write its shards; the
    next one, on every rank, writes the whole model. A rank's own ``torch.save(model.state_dict())`` loads back
    on that rank, and a plain model or the other rank refuses it with the fix."""
    import transformers

    from dynshard.checkpoint import RankPiecesError, pretrained

    pretrained.RENDEZVOUS_SECONDS = 2.0
    model = build_llama()
    compiled = torch.compile(model, backend="dynshard", options=_config({"policy": "tp", "plan_ngpus": 2}))
    ids = torch.stack([row["input_ids"] for row in dataset(2)])
    compiled(input_ids=ids, labels=ids).loss.backward()
    result = {"error": None}
    if rank == 0:
        started = time.perf_counter()
        try:
            model.save_pretrained(directory)
        except dynshard.checkpoint.SavePretrainedError as error:
            result["error"], result["seconds"] = str(error), time.perf_counter() - started
        result["files"] = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    dist.barrier()
    model.save_pretrained(directory)          # every rank, after the refused one: the rounds still meet
    if rank == 0:
        loaded = transformers.LlamaForCausalLM.from_pretrained(directory)
        whole = dynshard.gather_state_dict(model)
        result["reloaded_exact"] = all(torch.equal(loaded.state_dict()[k], v) for k, v in whole.items())
    else:
        dynshard.gather_state_dict(model)

    own = os.path.join(os.path.dirname(directory), f"rank{rank}.pt")
    torch.save(model.state_dict(), own)
    dist.barrier()
    mine = torch.load(own)                                   # weights_only=True, torch's default
    model.load_state_dict(mine, strict=True)                 # a rank's own pieces, on that rank
    for name, target in (("plain", build_llama()), ("other", model)):
        state = torch.load(os.path.join(os.path.dirname(directory), f"rank{1 - rank if name == 'other' else rank}.pt"))
        try:
            target.load_state_dict(state)
            result[name] = None
        except RankPiecesError as error:
            result[name] = str(error)
    return result


def _trainer(model, options: dict, directory: str, plan_ngpus: int):
    import transformers

    compiled = torch.compile(model, backend="dynshard", options=_config(options))
    args = transformers.TrainingArguments(
        output_dir=directory, per_device_train_batch_size=ROWS, max_steps=STEPS, learning_rate=LR,
        lr_scheduler_type="linear", max_grad_norm=1.0, report_to=[], save_strategy="steps", save_steps=SAVE_EVERY,
        logging_steps=1, remove_unused_columns=False, use_cpu=True, seed=0, disable_tqdm=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / (2 * STEPS))
    return compiled, _recording(unit_trainer_class())(
        model=compiled, args=args, train_dataset=dataset(64), optimizers=(opt, scheduler), plan_ngpus=plan_ngpus)


def trainer_checkpoints(rank: int, world: int, options: dict, directory: str) -> dict:
    """Trainer saves checkpoint-2 and checkpoint-4; checkpoint-4 loads with from_pretrained and holds what
    one process trained on the same batches (weights and momentum)."""
    import transformers

    plan_ngpus = options.get("plan_ngpus", 1)
    model = build_llama()
    reference = copy.deepcopy(model)
    compiled, trainer = _trainer(model, options, directory, plan_ngpus)
    trainer.train()
    result = {"uninterrupted": dynshard.collect_state_dict(compiled), "losses": _mean_over_ranks(trainer.losses, world)}
    result["ref_losses"] = _reference_with_schedule(reference, trainer.fed, plan_ngpus)
    if rank == 0:
        loaded = transformers.LlamaForCausalLM.from_pretrained(os.path.join(directory, f"checkpoint-{STEPS}"))
        result["params"] = {k: v.detach().clone() for k, v in loaded.state_dict().items()}
        result["ref_params"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}
        saved = torch.load(os.path.join(directory, f"checkpoint-{STEPS}", "optimizer.pt"))
        names = [n for n, _ in reference.named_parameters()]
        result["momentum"] = {names[i]: s["momentum_buffer"] for i, s in saved["state"].items()}
        result["ref_momentum"] = reference.momentum
    return result


def trainer_resumed(rank: int, world: int, options: dict, directory: str) -> dict:
    """A new job: Trainer resumed from checkpoint-2 of :func:`trainer_checkpoints`, trained to its end."""
    model = build_llama()
    compiled, trainer = _trainer(model, options, directory + "-resumed", options.get("plan_ngpus", 1))
    trainer.train(resume_from_checkpoint=os.path.join(directory, f"checkpoint-{SAVE_EVERY}"))
    return {"resumed": dynshard.collect_state_dict(compiled)}


def _reference_with_schedule(model, fed, plan_ngpus):
    """One process on the units' rows with the same SGD, clipping and schedule as the Trainer jobs."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, fed)
    units = gathered[::plan_ngpus]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / (2 * STEPS))
    losses = []
    for step in range(len(fed)):
        rows = torch.cat([unit[step] for unit in units])
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        scheduler.step()
        opt.zero_grad()
    model.momentum = {n: opt.state[p]["momentum_buffer"] for n, p in model.named_parameters()}
    return losses


def lora_adapters_saved(rank: int, world: int, options: dict, directory: str) -> dict:
    """PEFT's LoRA on the tiny Llama, two SGD steps beside one process, then the PeftModel's
    ``save_pretrained`` on every rank; rank 0 loads the adapters onto a fresh base with ``from_pretrained``."""
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                             init_lora_weights="gaussian")     # (B nonzero: every adapter tensor has a gradient)
    torch.manual_seed(1)
    model = peft.get_peft_model(build_llama(), config)
    reference = copy.deepcopy(model)
    _train_two_steps(model, reference, options)
    split = sorted(n for n, p in model.named_parameters()
                   if p.requires_grad and dynshard.get_parallel_dim(p) is not None)
    model.save_pretrained(directory)
    result = {"split_adapters": split}
    if rank == 0:
        loaded = peft.PeftModel.from_pretrained(build_llama(), directory)
        result["files"] = sorted(os.listdir(directory))
        result["params"] = {k: v.detach().clone() for k, v in loaded.state_dict().items() if "lora_" in k}
        result["ref_params"] = {k: v.detach().clone() for k, v in reference.state_dict().items() if "lora_" in k}
    return result


def pipeline_whole_state(rank: int, world: int, plan: str) -> dict:
    """A pipeline plan trained 2 SGD steps beside one process; then the whole model and optimizer state that
    Trainer's checkpoints write, gathered to rank 0 (another stage's state comes from the rank holding it)."""
    from workers_checkpoint_matrix import CFG, SGD, Run, batch, make_optimizer
    from workers_pipeline import EndToEndGPT

    from dynshard.runtime.state_dict import gather_optimizer_state, gather_state_dict

    run = Run(plan, SGD)
    torch.manual_seed(0)
    reference = EndToEndGPT(CFG)
    ref_opt = make_optimizer(SGD, reference.parameters())
    for step in range(2):
        run.step(step)
        reference(batch(step)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    params, state = gather_state_dict(run.compiled), gather_optimizer_state(run.opt)
    if rank != 0:
        return {"empty": not params and not state}
    names = [n for n, _ in reference.named_parameters()]
    return {"losses": [], "ref_losses": [], "params": params,
            "ref_params": {k: v.detach().clone() for k, v in reference.state_dict().items()},
            "momentum": {names[i]: s["momentum_buffer"] for i, s in state["state"].items()},
            "ref_momentum": {n: ref_opt.state[p]["momentum_buffer"] for n, p in reference.named_parameters()}}


def second_model_of_the_class(rank: int, world: int, directory: str) -> dict:
    """Two Llamas in one process under tp: Dynamo serves the first one's compiled frame to the second, whose
    modules dynshard then finds on the call stack; its save_pretrained writes it whole and its eager call is
    refused."""
    import transformers

    options = _config({"policy": "tp", "plan_ngpus": 2})
    ids = torch.stack([row["input_ids"] for row in dataset(2)])
    first, second = build_llama(), build_llama()
    with torch.no_grad():
        for p in second.parameters():
            p.mul_(0.5)
    whole = {k: v.detach().clone() for k, v in second.state_dict().items()}
    for model in (first, second):
        torch.compile(model, backend="dynshard", options=options)(input_ids=ids, labels=ids).loss.backward()
    second.save_pretrained(directory)
    result = {"split": second.model.embed_tokens.weight.shape[0] < VOCAB_SIZE}
    if rank == 0:
        loaded = transformers.LlamaForCausalLM.from_pretrained(directory)
        result["exact"] = all(torch.equal(loaded.state_dict()[k], v) for k, v in whole.items())
    try:
        second(input_ids=ids, labels=ids)
        result["eager"] = None
    except dynshard.EagerCallError as error:
        result["eager"] = type(error).__name__
    return result

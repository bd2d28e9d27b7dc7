"""transformers' own checkpoints of a dynshard model hold the whole trained model.

After the first step the parameters are this rank's pieces (tp shards, ZeRO rows), so transformers'
``save_pretrained`` and Trainer's ``checkpoint-N`` would write rank 0's pieces, which ``from_pretrained``
refuses and which lose every other rank's part. Two integration points, both on the objects, none on
transformers' classes:

- **``model.save_pretrained(dir)``** of a transformers model that dynshard compiled is wrapped on the instance
  (when its first program is built). Called on every rank, as transformers documents for distributed saving
  (``is_main_process`` picks the writer), it gathers the whole state dict to rank 0, one tensor at a time and
  into host memory (:func:`~dynshard.runtime.state_dict.gather_state_dict`), and rank 0 writes it through
  transformers' own code (safetensors, shards, tied weights); a PEFT model (``peft.PeftModel``, whose
  ``save_pretrained`` writes the adapters) gathers its trainable tensors and not its frozen base. Called on
  one rank alone, it raises :class:`SavePretrainedError` within seconds (a rendezvous on the job's store)
  instead of writing pieces.
- **Trainer** calls ``save_model`` on every rank but writes from rank 0 alone, and saves rank 0's
  ``optimizer.state_dict()``. The Trainer whose ``training_step`` runs the model is found on the call stack
  when a program first cuts the model's tensors, and its ``save_model`` and ``_save_optimizer_and_scheduler``
  are wrapped on the instance: every rank gathers, rank 0 writes the whole model and the whole optimizer
  state (a plain optimizer's, loadable in one process; under a pipeline, every stage's).
  ``train(resume_from_checkpoint=...)`` loads both before the first step, when the parameters are still
  whole; the first step cuts the loaded optimizer state to each rank's piece. Trainer loads the weights into
  ``torch.compile``'s wrapper, whose keys all miss (a warning, nothing loaded, for any compiled model); when
  dynshard first compiles inside that ``train`` call, it loads them into the model itself, through Trainer's
  own loader.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from .. import compat
from ..runtime.call_stack import caller_self
from ..runtime.program import FRAME_MODULE_HOOKS, PREPARE_HOOKS
from ..runtime.state_dict import gather_optimizer_state, gather_state_dict, holds_split_tensors
from .api import _cut_whole_state_at_first_step

_WRAPPED = "_dynshard_saves_whole"
_RESUMED = "_dynshard_resumed"
RENDEZVOUS_SECONDS = float(os.environ.get("DYNSHARD_SAVE_RENDEZVOUS_SECONDS", "20"))
_round = 0          # this process's saves that met every rank


class SavePretrainedError(RuntimeError):
    """``save_pretrained`` of a model whose tensors are split was not called on every rank."""


def _every_rank_is_here(what: str) -> None:
    """Each rank signs in on the job's store; raise on a rank that waits in vain (no collective is entered).
    A refused rank takes its sign-in back and keeps its round, so the next save called on every rank meets."""
    global _round
    world, store = dist.get_world_size(), compat.default_store()
    key = f"dynshard/save/{_round}"
    store.add(key, 1)
    deadline = time.monotonic() + RENDEZVOUS_SECONDS
    while store.add(key, 0) < world:
        if time.monotonic() > deadline:
            store.add(key, -1)
            raise SavePretrainedError(
                f"dynshard: {what} was called on rank {dist.get_rank()}, but not on every rank within "
                f"{RENDEZVOUS_SECONDS:.0f} s, and the model's tensors are split over the ranks: each rank holds "
                "only its pieces. Call it on every rank (transformers' is_main_process=... picks the one that "
                "writes), or dynshard.checkpoint.save(path, model, optimizer) on every rank")
        time.sleep(0.01)
    _round += 1


def _what_is_written(module: torch.nn.Module, state_dict):
    """The tensors a save writes: a PEFT model's ``save_pretrained`` writes its adapters (trainable), so its
    frozen base weights are not gathered (a 7B base would be 28 GB on rank 0's host for 20 MB of adapters)."""
    state = module.state_dict(keep_vars=True) if state_dict is None else state_dict
    if getattr(module, "peft_config", None) is None:
        return state
    return {k: v for k, v in state.items()
            if not isinstance(v, torch.Tensor) or v.requires_grad or not holds_split_tensors({k: v})}


def _wrap_save_pretrained(module: torch.nn.Module) -> None:
    original = module.save_pretrained

    @functools.wraps(original)
    def save_pretrained(save_directory, *args, is_main_process: bool = True, state_dict=None, **kwargs):
        split = holds_split_tensors(module.state_dict(keep_vars=True) if state_dict is None else state_dict)
        if not split or not dist.is_initialized() or dist.get_world_size() == 1:
            return original(save_directory, *args, is_main_process=is_main_process, state_dict=state_dict, **kwargs)
        _every_rank_is_here("save_pretrained")
        full = gather_state_dict(module, _what_is_written(module, state_dict))
        result = None
        if dist.get_rank() == 0:
            result = original(save_directory, *args, is_main_process=is_main_process, state_dict=full, **kwargs)
        dist.barrier()
        return result

    module.save_pretrained = save_pretrained
    setattr(module, _WRAPPED, True)


def _is_trainer(candidate: Any) -> bool:
    trainer_module = sys.modules.get("transformers.trainer")
    return trainer_module is not None and isinstance(candidate, trainer_module.Trainer)


def _adopt_trainer(trainer: Any) -> None:
    """Trainer's checkpoints: the whole model and optimizer state, gathered on every rank, written by rank 0."""
    if getattr(trainer, _WRAPPED, False):
        return
    save_optimizer = trainer._save_optimizer_and_scheduler

    def whole_save_model(output_dir=None, _internal_call: bool = False):
        # (whole tensors too: Trainer would save torch.compile's wrapper's state_dict(), every key prefixed with
        # "_orig_mod.", which from_pretrained then finds none of)
        full = gather_state_dict(trainer.model)
        if trainer.args.should_save:
            trainer._save(output_dir if output_dir is not None else trainer.args.output_dir, state_dict=full)
        dist.barrier()
        if trainer.args.push_to_hub and not _internal_call:       # (as Trainer.save_model does)
            trainer.push_to_hub(commit_message="Model save", revision=getattr(trainer.args, "hub_revision", None))

    def whole_save_optimizer_and_scheduler(output_dir):
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)   # (accelerate's wrapper)
        full = gather_optimizer_state(optimizer)
        original_state_dict = optimizer.state_dict
        optimizer.state_dict = lambda: full
        try:
            save_optimizer(output_dir)
        finally:
            optimizer.state_dict = original_state_dict

    trainer.save_model = whole_save_model
    trainer._save_optimizer_and_scheduler = whole_save_optimizer_and_scheduler
    if trainer.optimizer is not None:      # a resumed run loaded whole optimizer state: the first step cuts it
        _cut_whole_state_at_first_step(getattr(trainer.optimizer, "optimizer", trainer.optimizer))
    setattr(trainer, _WRAPPED, True)


def hook_module(module: torch.nn.Module) -> None:
    """Each outermost module of a frame dynshard compiles (``FRAME_MODULE_HOOKS``), before its first run."""
    if callable(getattr(module, "save_pretrained", None)) and not getattr(module, _WRAPPED, False):
        _wrap_save_pretrained(module)
    trainer, resume_from = caller_self(_is_trainer, "resume_from_checkpoint")
    if trainer is not None and isinstance(resume_from, str) and not getattr(trainer, _RESUMED, False):
        # Trainer loaded the checkpoint into torch.compile's wrapper, whose keys carry "_orig_mod.": nothing
        # was loaded (transformers only logs the missing keys). The tensors are still whole: load into the model.
        setattr(trainer, _RESUMED, True)
        trainer._load_from_checkpoint(resume_from, model=getattr(trainer.model, "_orig_mod", trainer.model))


def adopt_trainer_on_stack() -> None:
    """A program has just cut a model's tensors (``PREPARE_HOOKS``): inside a Trainer's step, adopt it."""
    trainer, _ = caller_self(_is_trainer)
    if trainer is not None:
        _adopt_trainer(trainer)


FRAME_MODULE_HOOKS.append(hook_module)
PREPARE_HOOKS.append(adopt_trainer_on_stack)

"""Calls that bypass the compiled program must not compute on this rank's shards, nor train unreduced.

Parameters become this rank's shards in place, so a call on the module that does not go through the
compiled program (``model.generate(...)``, which calls the original module's ``forward``; an eager call
after training; a frame Dynamo runs eagerly) would compute on shards: an index error at best, a silently
wrong number at worst. A whole parameter is no safer in training: only the compiled backward reduces its
gradient across ranks, so an eager forward under ``dp`` lets each replica drift apart without a word.

* **Dynamo's recompile limit** (:func:`refuse_recompile_limit`): when a frame compiled for dynshard has
  used up ``torch._dynamo.config.recompile_limit``, Dynamo would run it, and every frame it calls, eagerly.
  :class:`RecompileLimitError` is raised instead, before the call does any work, naming the guard that
  failed and the fix. Ranks that call alike reach the limit at the same call, so every rank raises.
* **Every module that holds a tensor dynshard placed** gets a forward pre-hook: a split tensor (tp shards,
  ZeRO rows, another stage's tensor) refuses any eager call (:class:`EagerCallOnShardsError`); a whole
  trainable parameter whose gradient is reduced across ranks refuses an eager call with gradients enabled
  (:class:`EagerCallError`; under ``torch.no_grad()``, evaluation and ``generate``, it computes exactly). The
  hook passes when Dynamo is tracing the call (then it is part of a dynshard program:
  ``torch.compiler.is_compiling()`` folds the hook away), when the tensors are whole for the moment
  (:func:`summon_full_params`, FSDP's name for the same thing), and for the module ``torch.compile`` wrapped
  while its wrapper runs it (those hooks run outside Dynamo, right before the compiled frame).
"""

from __future__ import annotations

import contextlib
import itertools
import re
from types import CodeType
from typing import Iterator

import torch
import torch.nn as nn

from .. import compat
from .backend_identity import compiling_for_dynshard
from .sharding import full_tensor, get_tag

_GUARDED = "_dynshard_eager_guard"
_ROOT = "_dynshard_frame_root"
_WHOLE = {"depth": 0}


class EagerCallError(RuntimeError):
    """A module or frame dynshard placed would run outside its compiled program, where it trains wrong."""


class EagerCallOnShardsError(EagerCallError):
    """A module holding this rank's shards was called outside a dynshard program."""


class RecompileLimitError(EagerCallError):
    """Dynamo reached its recompile limit on a frame compiled for dynshard and would have run it eagerly."""


def _split_here(module: nn.Module) -> list[str]:
    return [name for name, t in itertools.chain(module._parameters.items(), module._buffers.items())
            if t is not None and (tag := get_tag(t)) is not None and tag.is_split]


def _reduced_here(module: nn.Module) -> list[str]:
    """Its trainable parameters whose gradients the compiled backward reduces across ranks."""
    return [name for name, p in module._parameters.items()
            if p is not None and p.requires_grad and (tag := get_tag(p)) is not None and tag.layout.world_size > 1]


_CALL_COMPILED = ("Call the compiled model; to run the module eagerly (model.generate(...), evaluation code), "
                  "gather its tensors for the duration: `with dynshard.summon_full_params(model): "
                  "model.generate(...)` on every rank")


def _refuse_eager(module: nn.Module, args) -> None:
    if torch.compiler.is_compiling() or _WHOLE["depth"]:
        return
    if getattr(module, _ROOT, False) and compat.in_optimized_module():
        return
    split = _split_here(module)
    if split:
        raise EagerCallOnShardsError(
            f"dynshard: {type(module).__name__} was called outside its compiled program, but its "
            f"{', '.join(split)} hold only this rank's shards, so it would compute on shards. {_CALL_COMPILED}. "
            "A torch.compiler.disable'd function or a graph Dynamo skipped calls it eagerly too (TORCH_LOGS="
            "graph_breaks says where)")
    reduced = _reduced_here(module) if torch.is_grad_enabled() else []
    if reduced:
        raise EagerCallError(
            f"dynshard: {type(module).__name__} was called outside its compiled program with gradients "
            f"enabled; only the compiled backward reduces the gradients of its {', '.join(reduced)} across "
            "ranks, so each rank would train on its own gradients and the replicas would drift apart. Call "
            "the compiled model for training; an eager call for evaluation or generation is exact under "
            "torch.no_grad(). A torch.compiler.disable'd function or a graph Dynamo skipped calls it "
            "eagerly too (TORCH_LOGS=graph_breaks says where)")


def guard_modules(roots: list[nn.Module]) -> None:
    """Hook every module under ``roots`` that directly holds a tensor dynshard placed (once per module)."""
    for root in roots:
        setattr(root, _ROOT, True)
        for module in root.modules():
            if not getattr(module, _GUARDED, False) and (_split_here(module) or _reduced_here(module)):
                module.register_forward_pre_hook(_refuse_eager)
                setattr(module, _GUARDED, True)


def refuse_recompile_limit(limit_type: str, limit: int, code: CodeType | None, reason: str | None) -> None:
    """Dynamo reached its ``limit_type`` of ``limit`` compiles for ``code`` (``compat.on_recompile_limit``): a
    frame compiled for dynshard raises :class:`RecompileLimitError` rather than running eagerly; other
    backends' frames are left to Dynamo."""
    if not compiling_for_dynshard():
        return
    function = f"'{code.co_name}' ({code.co_filename}:{code.co_firstlineno})" if code is not None else "a frame"
    if reason is not None:      # its first line, without the source line Dynamo appends after spaces and '#'
        reason = re.split(r"\s{2,}#", reason.split("\n")[0])[0].strip()
    reason = reason or "unknown (TORCH_LOGS=recompiles lists each reason)"
    if "size mismatch" in reason or "stride mismatch" in reason:
        cause = ("the inputs' shapes change from call to call, and the frame compiles a graph per shape "
                 "(dynamic=False, or a job where dynshard turns automatic dynamic shapes off and logs why: several "
                 "units of several ranks, a pipeline, split outputs): compile with dynamic=True or mark_dynamic (one graph for every length), or pad each "
                 "batch to one of a few lengths (a collator's pad_to_multiple_of=64, or padding='max_length')")
    else:
        cause = ("a value the frame reads changes from call to call, and Dynamo compiles a program per value (a "
                 "Python number passed to forward): pass it as a tensor (torch.tensor(value)) or keep it "
                 "constant")
    raise RecompileLimitError(
        f"dynshard: Dynamo reached torch._dynamo.config.{limit_type} ({limit}) for {function}, "
        "a frame compiled for dynshard, and would run it eagerly, where nothing reduces gradients across ranks "
        f"and split parameters are only this rank's shards. The guard that failed last: {reason}. The cause: "
        f"{cause}; or, if the variants are few and expected, raise torch._dynamo.config.{limit_type} "
        "(each variant plans and compiles its own program)")


@contextlib.contextmanager
def summon_full_params(model: nn.Module) -> Iterator[nn.Module]:
    """Inside, every tensor of ``model`` dynshard split holds its whole value and every call of the model,
    compiled or not, runs eagerly (``torch.compiler.set_stance("force_eager")``): evaluation code and
    ``model.generate(...)`` work as on one process. Every rank must enter it (the tensors are gathered);
    each rank then holds the whole model. On exit the shards are back, and changes made inside are
    discarded."""
    module = getattr(model, "_orig_mod", model)
    seen, swapped = set(), []
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        tag = get_tag(tensor)
        # (a pipeline's tensor is broadcast from its stage's ranks: every rank takes part, holder or not)
        if id(tensor) in seen or tag is None or (not tag.is_split and tag.owner is None):
            continue
        seen.add(id(tensor))
        whole = full_tensor(tensor)
        swapped.append((tensor, tensor.data))
        with torch.no_grad():
            tensor.data = whole
    _WHOLE["depth"] += 1
    try:
        with torch.compiler.set_stance("force_eager"):
            yield model
    finally:
        _WHOLE["depth"] -= 1
        with torch.no_grad():
            for tensor, local in swapped:
                tensor.data = local

"""Calls that bypass the compiled program must not compute on this rank's shards.

Parameters become this rank's shards in place, so a call on the module that does not go through the
compiled program (``model.generate(...)``, which calls the original module's ``forward``; an eager call
after training; a frame Dynamo runs eagerly after its ``recompile_limit``) would compute on shards: an
index error at best, a silently wrong number at worst. Each module that holds a split tensor gets a
forward pre-hook that raises :class:`EagerCallOnShardsError` unless Dynamo is tracing the call (then it
is part of a dynshard program: ``torch.compiler.is_compiling()`` folds the hook away) or the tensors are
whole for the moment (:func:`summon_full_params`, FSDP's name for the same thing).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Iterator

import torch
import torch.nn as nn

from .sharding import full_tensor, get_tag

_GUARDED = "_dynshard_eager_guard"
_WHOLE = {"depth": 0}


class EagerCallOnShardsError(RuntimeError):
    """A module holding this rank's shards was called outside a dynshard program."""


def _split_here(module: nn.Module) -> list[str]:
    return [name for name, t in itertools.chain(module._parameters.items(), module._buffers.items())
            if t is not None and (tag := get_tag(t)) is not None and tag.is_split]


def _refuse_eager(module: nn.Module, args) -> None:
    if torch.compiler.is_compiling() or _WHOLE["depth"]:
        return
    split = _split_here(module)
    if split:
        raise EagerCallOnShardsError(
            f"dynshard: {type(module).__name__} was called outside its compiled program, but its "
            f"{', '.join(split)} hold only this rank's shards, so it would compute on shards. Call the "
            "compiled model; to run the module eagerly (model.generate(...), evaluation code), gather its "
            "tensors for the duration: `with dynshard.summon_full_params(model): model.generate(...)` on "
            "every rank. If Dynamo fell back to eager (recompile_limit hit: TORCH_LOGS=recompiles says "
            "why), raise torch._dynamo.config.recompile_limit or keep input shapes fixed")


def guard_modules(roots: list[nn.Module]) -> None:
    """Hook every module under ``roots`` that directly holds a split tensor (once per module)."""
    for root in roots:
        for module in root.modules():
            if not getattr(module, _GUARDED, False) and _split_here(module):
                module.register_forward_pre_hook(_refuse_eager)
                setattr(module, _GUARDED, True)


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
        if id(tensor) in seen or tag is None or not tag.is_split:
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

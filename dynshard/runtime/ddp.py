"""DistributedDataParallel around a dynshard model: DDP leaves dynshard's parameters to dynshard.

dynshard averages its parameters' gradients over the data-parallel units inside its own programs and
shards them over the plan unit, so a DDP that also reduced them would reduce every gradient twice (dp)
or average pieces of different ranks (tp: "CompiledFunctionBackward returned an invalid gradient"). Yet
DDPs get built around whole models without the user asking: transformers' Trainer (through accelerate)
wraps the model it is given. DDP reads its list of ignored parameters once, in its constructor, and
refuses one with nothing left to reduce, so a list set in advance cannot help there; instead:

- **Released** (:func:`leave_to_dynshard`): when a dynshard frame is compiled inside the forward of a DDP
  (``DistributedDataParallel._get_active_ddp_module()``) whose reducer averages only dynshard's parameters
  (those of submodules compiled with dynshard, or tagged by it), DDP becomes a pass-through at once,
  before Dynamo traces (Dynamo's start-of-compile callback): no reducer, no logger (they held every
  parameter's gradient accumulator with its whole shape, and a gradient bucket as big as the model), its
  forward only calls the module, nothing in the backward; its ``no_sync()`` (Trainer's gradient
  accumulation) becomes ``dynshard.no_sync``. Any dynshard frame compiled inside a DDP's forward also goes
  to dynshard whole: Dynamo's DDPOptimizer would cut it into DDP-bucket-sized pieces, which dynshard
  cannot compile (:func:`~dynshard.compat.ddp.keep_graph_whole`).
  What DDP's constructor did before is harmless: it checked shapes and broadcast rank 0's values, which
  are every rank's before dynshard's first step (dynshard broadcasts them again when it shards).
- **Refused** (:class:`DDPWrapError`, the same on every rank, before anything runs): a DDP that averages
  dynshard's parameters together with others (only a submodule is compiled with dynshard, and
  ``register_ddp_parameters_to_ignore`` was not called before DDP was built), or one built around
  parameters dynshard had already sharded (its constructor broadcast rank 0's pieces over the others').

The check runs at the start of every Dynamo compile of a dynshard frame (:func:`watch`: registered when
dynshard is imported, and again by each backend call after ``torch._dynamo.reset()``) and, when the
program calls :func:`check_active_ddp`, at every run (a DDP built after the model was compiled).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Iterator

import torch

from .. import compat
from ..compat import ddp as compat_ddp
from .accumulation import no_sync
from .backend_identity import compiled_with_dynshard, compiling_for_dynshard
from .sharding import get_tag

log = logging.getLogger("dynshard")

# DDPs found to reduce none of dynshard's parameters (a submodule registered as ignored): not checked again
_UNCONCERNED: "weakref.WeakSet" = weakref.WeakSet()


class DDPWrapError(RuntimeError):
    """A DistributedDataParallel around a dynshard model that dynshard cannot leave as a pass-through."""


def watch() -> None:
    """Check, at the start of each Dynamo compile, whether the frame is dynshard's and runs inside a DDP
    (idempotent; ``torch._dynamo.reset()`` drops the callback, and the next call registers it again)."""
    compat.register_compile_start(_on_compile_start)


def _on_compile_start(args) -> None:
    if not compat.starts_frame_compile(args):
        return
    ddp = compat_ddp.active_ddp()
    if ddp is None or not compiling_for_dynshard():
        return
    frame = compat.compiling_frame()
    compat_ddp.keep_graph_whole(frame.get("compiler_fn") if frame is not None else None)
    if ddp not in _UNCONCERNED and not compat_ddp.is_pass_through(ddp):
        leave_to_dynshard(ddp)


def check_active_ddp() -> None:
    """At a dynshard program's call: leave an enclosing DDP to dynshard (or refuse it). A dictionary read
    when no DDP forward is running, or once its DDP has been released."""
    ddp = compat_ddp.active_ddp()
    if ddp is None or ddp in _UNCONCERNED or compat_ddp.is_pass_through(ddp):
        return
    leave_to_dynshard(ddp)


def leave_to_dynshard(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """Release ``ddp`` (a pass-through from now on) when its reducer averages only dynshard's parameters;
    raise :class:`DDPWrapError` when it averages them with others, or pieces dynshard has already cut."""
    reduced = compat_ddp.reduced_parameters(ddp)
    owned = dynshard_tensors(ddp.module)
    ours = [(name, p) for name, p in reduced if id(p) in owned]
    if not ours:
        _UNCONCERNED.add(ddp)
        return
    split = [name for name, p in ours if getattr(get_tag(p), "is_split", False)]
    if split:
        raise DDPWrapError(
            f"dynshard: DistributedDataParallel was built around parameters dynshard had already cut into this "
            f"rank's pieces ({_some(split)}): its constructor broadcast rank 0's pieces over the other ranks' "
            f"and it would average pieces of different ranks. Build it before the model's first call (dynshard "
            f"then leaves it as a pass-through; with transformers' Trainer: train() before evaluate()), or do "
            f"not wrap a dynshard model: dynshard averages gradients over data-parallel ranks itself.")
    others = [name for name, p in reduced if id(p) not in owned]
    if others:
        raise DDPWrapError(
            f"dynshard: DistributedDataParallel would average the gradients of dynshard's parameters "
            f"({_some([n for n, _ in ours])}), which dynshard averages itself, together with others "
            f"({_some(others)}). Call dynshard.register_ddp_parameters_to_ignore(model) before "
            f"DistributedDataParallel(model): DDP then reduces only the others.")
    names = [name for name, _ in ours]
    compat_ddp.pass_through(ddp, names)
    ddp.no_sync = functools.partial(no_sync, ddp.module)   # DDP's accumulation (Trainer's) becomes dynshard's
    for _, param in ours:
        compat_ddp.mark_ignored(param)
    log.info("dynshard: DistributedDataParallel around a dynshard model (%d parameters) released: dynshard "
             "reduces their gradients itself, DDP's forward now only calls the model", len(names))


def dynshard_tensors(module: torch.nn.Module) -> dict[int, str]:
    """id -> a name of every parameter and buffer of ``module`` that is dynshard's: under a submodule
    compiled with dynshard (found before its first run, when nothing is tagged yet), or tagged by it."""
    owned = [prefix for prefix, sub in module.named_modules(remove_duplicate=False) if compiled_with_dynshard(sub)]
    return {id(t): name for name, t in named_tensors(module)
            if any(_under(name, prefix) for prefix in owned) or get_tag(t) is not None}


def named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every name of every parameter and buffer (a tensor shared between modules has several)."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _under(name: str, prefix: str) -> bool:
    return prefix == "" or name.startswith(prefix + ".")


def _some(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(repr(n) for n in names[:shown]) + more


watch()     # before the first compile: a Trainer's DDP is built before the model's first call

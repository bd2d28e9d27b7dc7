"""Gradient accumulation without communication: ``with dynshard.no_sync(model): loss.backward()``.

Collectives inside a compiled graph always run, and reducing only the last micro-batch's gradient in
the graph would be wrong (``sum_k g_k`` needs every ``g_k`` reduced). So a program has a second,
lazily compiled variant that communicates nothing across data-parallel units: ZeRO parameters enter it
as whole replicas (gathered once per accumulation window, outside the graph) and every gradient stays
local, accumulating in ``param.grad`` (replicated parameters) or ``replica.grad`` (ZeRO parameters).
The first synchronising call after the window (a program call outside ``no_sync``), the optimizer's
step (a global step pre-hook, so a plain ``torch.optim`` optimizer stays correct), or
``optimizer.sync_shard_grad()`` reduces what was accumulated, once, in buckets (:mod:`.reducer`).

Memory while accumulating is ZeRO-1's at every level: whole (tp-local) parameters and gradients, as
FSDP2 documents for ``set_requires_gradient_sync(False)``; it returns to the level's own at the flush.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .job import current_job
from .reducer import PendingGrad, Reducer
from .sharding import get_tag
from .zero import gather_rows, zero_groups


class TensorSet:
    """Tensors by identity, held weakly (a WeakSet compares tensors with ``==``, elementwise)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def add(self, tensor: torch.Tensor) -> None:
        self._refs[id(tensor)] = weakref.ref(tensor, lambda _ref, key=id(tensor): self._refs.pop(key, None))

    def discard(self, tensor: torch.Tensor) -> None:
        self._refs.pop(id(tensor), None)

    def __contains__(self, tensor: torch.Tensor) -> bool:
        ref = self._refs.get(id(tensor))
        return ref is not None and ref() is tensor

    def __bool__(self) -> bool:
        return bool(self._refs)


class Accumulation:
    """Which parameters accumulate locally, their replicas, and what is waiting to be reduced: a part of the
    job (:func:`job_accumulation`), whose groups reduce it; one flush reduces every model's gradients, in
    the same order on every rank, as the optimizer's step needs them all."""

    def __init__(self) -> None:
        self.no_sync = TensorSet()
        self.replicas: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}    # id(param) -> (param, replica)
        self.local: dict[int, torch.Tensor] = {}                           # replicated, grads unreduced
        self.always = TensorSet()                                          # reduced outside the graph
        self.reducers: dict[int, Reducer] = {}                             # id(param) -> its reducer
        self.reducer = Reducer()
        self._step_hook = None

    # -- what programs ask ---------------------------------------------------------------------------
    def wants_no_sync(self, params) -> bool:
        """Whether any of ``params`` (an iterable, read only when accumulation is in use) skips sync."""
        if not (self.no_sync or self.always):       # the common step: nothing to look up
            return False
        return any(p in self.no_sync or p in self.always for p in params)

    def reduce_outside_graphs(self, params: list[torch.Tensor], reducer: Reducer) -> None:
        """Every backward of these parameters accumulates locally and ``reducer`` reduces it at the
        flush: how reducer hooks see each gradient bucket once per step."""
        self.install_step_hook()
        for param in params:
            self.always.add(param)
            self.reducers[id(param)] = reducer

    @property
    def pending(self) -> bool:
        return bool(self.replicas or self.local)

    def replica(self, param: torch.Tensor) -> torch.Tensor:
        """The whole (tp-local) replica of a ZeRO parameter for this window; gathered on first use."""
        entry = self.replicas.get(id(param))
        if entry is None:
            tag = get_tag(param)
            with torch.no_grad():
                whole = gather_rows(param.detach(), tag.zero, zero_groups(tag.layout, tag.zero.ngroups)).clone()
            entry = (param, whole.requires_grad_(param.requires_grad))
            self.replicas[id(param)] = entry
        return entry[1]

    def accumulates(self, param: torch.Tensor) -> None:
        """``param.grad`` will hold an unreduced local gradient."""
        self.local.setdefault(id(param), param)

    # -- reducing ------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Reduce every accumulated gradient into ``param.grad`` (every rank must call it)."""
        if not self.pending:
            return
        pending = []
        for param in self.local.values():
            if param.grad is None:
                continue
            local, param.grad = param.grad, None    # all-reduce(R + L) / n = R + mean(L): R was reduced
            pending.append(self._pending(param, local))
        for param, replica in self.replicas.values():
            if replica.grad is not None:
                pending.append(self._pending(param, replica.grad))
        self.replicas.clear()
        self.local.clear()
        by_reducer: dict[int, tuple[Reducer, list[PendingGrad]]] = {}
        for item in pending:
            reducer = self.reducers.get(id(item.param), self.reducer) if item.param in self.always else self.reducer
            by_reducer.setdefault(id(reducer), (reducer, []))[1].append(item)
        for reducer, items in by_reducer.values():
            reducer.reduce(items)

    def discard(self, params: list[torch.Tensor]) -> None:
        """Forget what these parameters accumulated (``zero_grad`` without a step)."""
        for param in params:
            self.local.pop(id(param), None)
            self.replicas.pop(id(param), None)

    @staticmethod
    def _pending(param: torch.Tensor, local: torch.Tensor) -> PendingGrad:
        tag = get_tag(param)
        layout = tag.layout
        if tag.zero is None:
            return PendingGrad(param, local, layout.dp_group, layout.dp_size)
        groups = zero_groups(layout, tag.zero.ngroups)
        return PendingGrad(param, local, groups.dp, layout.dp_size, zero=tag.zero, zero_groups=groups)

    def install_step_hook(self) -> None:
        """Flush before any optimizer steps: plain optimizers see reduced gradients too."""
        if self._step_hook is None:
            self._step_hook = register_optimizer_step_pre_hook(
                lambda _optimizer, _args, _kwargs: self.flush())

    def end_job(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None


def job_accumulation() -> Accumulation:
    """The current job's accumulation."""
    return current_job().part(Accumulation)


@contextlib.contextmanager
def no_sync(model: torch.nn.Module) -> Iterator[None]:
    """Backward passes inside send nothing across data-parallel units; gradients accumulate locally and
    are reduced once, by the first synchronising call or the optimizer's step."""
    accumulation = job_accumulation()
    added = [p for p in model.parameters() if p not in accumulation.no_sync]
    accumulation.install_step_hook()
    for param in added:
        accumulation.no_sync.add(param)
    try:
        yield
    finally:
        for param in added:
            accumulation.no_sync.discard(param)

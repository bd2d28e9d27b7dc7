"""Run one rank's part of a pipeline schedule: its stages' compiled programs and the transfers between them.

Every action of the rank's list (:mod:`.schedules`) is executed in order:

- ``RECV_F`` / ``RECV_B`` post a non-blocking ``irecv`` into a fresh buffer per boundary tensor (shapes are
  static, known from the plan: no metadata is ever exchanged);
- ``F`` waits for its inputs (or takes them from a stage of the same rank), runs the stage's compiled
  forward with autograd recording, and keeps what its backward needs;
- ``B`` waits for the gradients of the stage's outputs and runs ``torch.autograd.backward`` through the
  compiled program; parameter gradients accumulate in ``.grad`` (summed over micro-batches), the
  gradients of the received tensors are what the previous stage gets;
- ``SEND_F`` / ``SEND_B`` post a non-blocking ``isend``; sends are waited for at the end of the step;
- ``BCAST_B`` (1f1b_plus) broadcasts the gradients of the all-device stage's outputs from the rank of
  stage 1 to the unit's pipeline ranks (every rank runs it at the same place in its list). The all-device
  stage's outputs need no transfer: every rank computed them, drawing from one shared generator
  (:mod:`.shared_generator`).

Transfers stay outside the compiled graphs (Inductor may reorder a compiled recv before a send, and a
gloo send completes only when its receiver has posted the recv). Each message has its own tag
(direction, receiving stage, micro-batch, tensor), so the order in which messages meet does not matter;
the schedule was checked deadlock-free under exactly these rules before anything ran.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist

from .deferred import DeferredWeightGradients
from .shared_generator import SharedGenerator
from .actions import ALL
from .trace import StepTrace


class StepRun:
    """The state of one pipeline step on this rank: what each micro-batch's stages keep between actions."""

    def __init__(self, plan, schedule, programs: dict[int, Callable], metas: dict[str, Any], args: list[list[Any]],
                 train: bool, seed_fn: Callable | None = None):
        self.plan, self.schedule, self.staged, self.programs, self.metas = plan, schedule, plan.staged, programs, metas
        self.args, self.train, self.seed_fn = args, train, seed_fn
        self.nstages = len(self.staged.stages)
        self.width = 1 + max([len(b) for b in self.staged.boundaries] + [0])
        self.recv_f: dict[tuple[int, int], list] = {}
        self.recv_b: dict[tuple[int, int], list] = {}
        self.outgoing: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.leaves: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.grads_out: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.broadcast: dict[tuple[int, int], list[torch.Tensor]] = {}   # BCAST_B's gradients, by (stage, mb)
        self.outputs: dict[int, list[Any]] = {}
        self.sends: list = []
        self.trace = StepTrace(plan.steps)
        self.sent_bytes = 0
        self.deferred = DeferredWeightGradients()
        self._compute_begin = 0.0

    # -- helpers -------------------------------------------------------------------------------------
    def _tag(self, backward: bool, stage: int, mb: int, i: int) -> int:
        return ((int(backward) * self.nstages + stage) * len(self.args) + mb) * self.width + i

    def _peer(self, pp_rank: int) -> int:
        return self.plan.groups.global_rank(pp_rank)

    def _local(self, stage: int, mb: int) -> bool:
        return self.schedule.rank_of(stage, mb) in (self.plan.groups.pp_rank, ALL)

    def _grad_names(self, boundary: int) -> list[str]:
        return [n for n in self.staged.boundaries[boundary] if self.metas[n].requires_grad]

    def _empty(self, name: str) -> torch.Tensor:
        meta = self.metas[name]
        return torch.empty(meta.shape, dtype=meta.dtype, device=self.plan.device)

    # -- actions -------------------------------------------------------------------------------------
    def run(self, actions) -> None:
        for action in actions:
            self._compute_begin = self.trace.now()
            getattr(self, "_" + action.kind.lower())(action)
            if action.kind in ("F", "B", "I", "W"):     # from the end of its receive wait, if any
                self.trace.span("forward" if action.kind == "F" else "backward", str(action), self._compute_begin)

    def _wait(self, works, name: str) -> None:
        begin = self.trace.now()
        for work in works:
            work.wait()
        self.trace.span("recv", name, begin)
        self._compute_begin = self.trace.now()

    def _recv_f(self, action) -> None:
        names = self.staged.boundaries[action.stage - 1]
        buffers = [self._empty(n) for n in names]
        works = [dist.irecv(b, src=self._peer(action.peer), tag=self._tag(False, action.stage, action.mb, i))
                 for i, b in enumerate(buffers)]
        self.recv_f[(action.stage, action.mb)] = [works, buffers]

    def _send_f(self, action) -> None:
        key = (action.stage, action.mb)
        for i, tensor in enumerate(self.outgoing[key] if self.train else self.outgoing.pop(key)):
            buffer = tensor.detach().contiguous()
            self.sent_bytes += buffer.numel() * buffer.element_size()
            self.sends.append((dist.isend(buffer, dst=self._peer(action.peer),
                                          tag=self._tag(False, action.stage + 1, action.mb, i)), buffer))

    def _recv_b(self, action) -> None:
        names = self._grad_names(action.stage)
        buffers = [self._empty(n) for n in names]
        works = [dist.irecv(b, src=self._peer(action.peer), tag=self._tag(True, action.stage, action.mb, i))
                 for i, b in enumerate(buffers)]
        self.recv_b[(action.stage, action.mb)] = [works, buffers]

    def _send_b(self, action) -> None:
        for i, grad in enumerate(self.grads_out.pop((action.stage, action.mb))):
            buffer = grad.contiguous()
            self.sent_bytes += buffer.numel() * buffer.element_size()
            self.sends.append((dist.isend(buffer, dst=self._peer(action.peer),
                                          tag=self._tag(True, action.stage - 1, action.mb, i)), buffer))

    def _bcast_b(self, action) -> None:
        """From stage ``action.stage + 1``'s rank (``action.peer``) to every pipeline rank of the unit: the
        gradients of the all-device stage's outputs. A collective: every rank is here in the same order."""
        key = (action.stage, action.mb)
        if action.peer == self.plan.groups.pp_rank:
            tensors = [g.contiguous() for g in self.grads_out.pop((action.stage + 1, action.mb))]
            self.sent_bytes += sum(t.numel() * t.element_size() for t in tensors) * (self.plan.groups.pp_size - 1)
        else:
            tensors = [self._empty(n) for n in self._grad_names(action.stage)]
        group = self.plan.groups.pp_group
        if group is not None:
            begin = self.trace.now()
            for tensor in tensors:
                dist.broadcast(tensor, src=self._peer(action.peer), group=group)
            self.trace.span("recv", f"broadcast B{action.stage} mb{action.mb}", begin)
        self.broadcast[key] = tensors

    def _incoming(self, stage: int, mb: int) -> dict[str, torch.Tensor]:
        if stage == 0:
            return {}
        names = self.staged.boundaries[stage - 1]
        if self._local(stage - 1, mb):
            key = (stage - 1, mb)
            values = self.outgoing[key] if self.train else self.outgoing.pop(key)
        else:
            works, values = self.recv_f.pop((stage, mb))
            self._wait(works, f"recv F{stage} mb{mb}")
        return {n: v.detach().requires_grad_(self.train and self.metas[n].requires_grad)
                for n, v in zip(names, values)}

    def _f(self, action) -> None:
        s, mb = action.stage, action.mb
        stage = self.staged.stages[s]
        incoming = self._incoming(s, mb)
        inputs = [self.args[mb][i] for i in stage.graph_inputs] + [incoming[n] for n in stage.received]
        with torch.set_grad_enabled(self.train), self._drawing(s, mb):
            produced = self.programs[s](*inputs)
        env = {**incoming, **dict(zip(stage.produced, produced))}
        if s < self.nstages - 1:
            self.outgoing[(s, mb)] = [env[n] for n in self.staged.boundaries[s]]
        else:
            self.outputs[mb] = [_resolve(ref, env, self.args[mb]) for ref in self.staged.outputs]
        if self.train:
            self.leaves[(s, mb)] = incoming

    def _drawing(self, stage: int, mb: int):
        """The all-device stage draws from the unit's shared generator (:mod:`.shared_generator`)."""
        if self.schedule.rank_of(stage, mb) != ALL:
            return contextlib.nullcontext()
        if self.plan.all_device_generator is None:
            groups = self.plan.groups
            self.plan.all_device_generator = SharedGenerator(self.plan.device, groups.pp_group, groups.global_rank(0))
        return self.plan.all_device_generator.drawing()

    def _output_grads(self, stage: int, mb: int) -> list[torch.Tensor]:
        if self.schedule.rank_of(stage, mb) == ALL:
            return self.broadcast.pop((stage, mb))
        if self._local(stage + 1, mb):
            return self.grads_out.pop((stage + 1, mb))
        works, grads = self.recv_b.pop((stage, mb))
        self._wait(works, f"recv B{stage} mb{mb}")
        return grads

    def _b(self, action) -> None:
        s, mb = action.stage, action.mb
        if s == self.nstages - 1:
            tensors, grads = self.seed_fn(mb, self.outputs[mb])
        else:
            values = dict(zip(self.staged.boundaries[s], self.outgoing.pop((s, mb))))
            names = self._grad_names(s)
            pairs = [(values[n], g) for n, g in zip(names, self._output_grads(s, mb)) if values[n].requires_grad]
            tensors, grads = [t for t, _ in pairs], [g for _, g in pairs]
        if tensors:
            torch.autograd.backward(tensors, grads)
        leaves = self.leaves.pop((s, mb))
        if s > 0:
            self.grads_out[(s, mb)] = [leaves[n].grad if leaves[n].grad is not None else torch.zeros_like(leaves[n])
                                       for n in self._grad_names(s - 1)]

    def _i(self, action) -> None:
        """Zero bubble: the input gradients now (the previous stage waits for them), the weights' later."""
        with self.deferred.collecting((action.stage, action.mb)):
            self._b(action)

    def _w(self, action) -> None:
        stage = self.staged.stages[action.stage]
        with torch.no_grad():
            for position, grad in self.deferred.run((action.stage, action.mb)).items():
                param = self.args[action.mb][stage.graph_inputs[position]]
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)

    def finish(self) -> None:
        """Wait for this rank's sends (their receivers have posted, or will post, the matching recvs)."""
        begin = self.trace.now()
        for work, _ in self.sends:
            work.wait()
        if self.sends:
            self.trace.span("send", "wait for sends", begin)
        self.sends.clear()


def _resolve(ref, env: dict[str, Any], args: list[Any]) -> Any:
    kind, value = ref
    if kind == "value":
        return env[value]
    if kind == "input":
        return args[value]
    return value

"""While :func:`dynshard.train_step` / :func:`dynshard.infer_step` call the model once per sample, the
compiled program only records the call's inputs (:class:`Recorder`) and returns empty outputs of the
right shapes; the step runs the schedule over every recorded micro-batch and then fills those outputs in
place, so the step returns whatever the model's code built around them (a loss, a dict, a tuple)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator

import torch

_ACTIVE: contextvars.ContextVar["Recorder | None"] = contextvars.ContextVar("dynshard_pipeline_recorder",
                                                                           default=None)


@dataclasses.dataclass
class Recorded:
    program: Any
    args: list[Any]
    outputs: list[Any]     # what the call returned: empty tensors filled after the schedule ran


@dataclasses.dataclass
class Recorder:
    calls: list[Recorded] = dataclasses.field(default_factory=list)

    def record(self, program, args) -> list[Any]:
        plan = program.plan
        # the stages are compiled for contiguous micro-batches (a sample may be a strided slice of a batch)
        args = [a.contiguous() if inp.kind == "input" and isinstance(a, torch.Tensor) else a
                for inp, a in zip(plan.inputs, args)]
        outputs = []
        for ref, meta in zip(plan.staged.outputs, plan.outputs_at([args], whole=False)):
            if ref[0] == "constant":
                outputs.append(ref[1])
            elif ref[0] == "input":
                outputs.append(args[ref[1]])
            else:
                outputs.append(torch.empty(meta.shape, dtype=meta.dtype, device=plan.device))
        self.calls.append(Recorded(program, list(args), outputs))
        return outputs


def active_recorder() -> Recorder | None:
    return _ACTIVE.get()


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    recorder = Recorder()
    token = _ACTIVE.set(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.reset(token)

"""What one rank holds at its peak during a block of work (a training step): ``dynshard.peak_memory``.

    with dynshard.peak_memory(model, optimizer) as measured:
        model(*batch).backward(); optimizer.step(); optimizer.zero_grad()
    print(measured.peak)        # bytes: held at the start + the most allocated at once inside

- CUDA: the caching allocator's own figures (``torch.cuda.memory_allocated`` at the start, and
  ``max_memory_allocated`` after its peak statistics were reset there).
- CPU, which has no allocator statistics: at the start, the unique storages of the model's parameters,
  buffers and gradients and the optimizer's state (what a plan holds at rest); inside, every CPU
  allocation and free torch makes, as the profiler records them (:mod:`dynshard.compat.memory_events`),
  whose running sum's maximum is what the block added at its worst moment. Memory outside torch (Python
  objects, gloo's own buffers) is not counted, nor other tensors alive at the start: measure a step whose
  inputs are small beside the model, or add them.

This is what autodist's ``mem_constraint`` bounds (parameters, gradients, optimizer state, activations,
temporaries); the tests hold a chosen plan's measured peak under it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch

from ..compat import local_storage
from ..compat.memory_events import cpu_allocations


@dataclasses.dataclass
class PeakMemory:
    """A block's peak on one rank: ``at_start`` + ``during`` bytes."""

    device: str
    at_start: int = 0       # held when the block started (CPU: the model's and optimizer's tensors)
    during: int = 0         # the most bytes allocated at once inside the block, beyond those

    @property
    def peak(self) -> int:
        return self.at_start + self.during

    def __str__(self) -> str:
        return (f"peak {self.peak} bytes on {self.device}: {self.at_start} held at the start, up to {self.during} "
                "more inside")


@contextlib.contextmanager
def peak_memory(model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
                ) -> Iterator[PeakMemory]:
    """Measure the block's peak on this rank's device (the model's parameters' device; CPU without one)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu")) if model is not None else \
        torch.device("cpu")
    measured = PeakMemory(str(device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        measured.at_start = torch.cuda.memory_allocated(device)
        yield measured
        torch.cuda.synchronize(device)
        measured.during = torch.cuda.max_memory_allocated(device) - measured.at_start
        return
    measured.at_start = held_bytes(model, optimizer)
    with cpu_allocations() as events:
        yield measured
    running = most = 0
    for _, size in events:
        running += size
        most = max(most, running)
    measured.during = most


def held_bytes(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> int:
    """The bytes of the unique storages of ``model``'s parameters, buffers and gradients and ``optimizer``'s
    state tensors."""
    tensors = []
    if model is not None:
        tensors += list(model.parameters()) + list(model.buffers())
        tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {}
    for t in tensors:
        storage = local_storage(t)
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())

"""The generator 1f1b_plus's all-device stage draws from: one state for the whole unit.

Every rank runs the all-device stage for every micro-batch, tensor parallel over the unit, so a random op
there must draw the same numbers on every rank. But each rank also runs its own pipeline stages, which draw
from its generator: by the all-device stage's next micro-batch the ranks' generators differ (seeded alike or
not), and a dropout on the embeddings dropped different positions on each rank. The replicas of the stage's
output then differed (stage 1 read its own rank's), and each rank's shard of the embedding took its gradient
through its own mask: silently not the gradient of what the pipeline ran.

So the stage draws from a state of its own: the first pipeline rank's generator at the stage's first forward,
broadcast over the unit's pipeline ranks (the stage's forwards are at the same place in every rank's list:
a collective is safe there), then advanced by the stage alone, the ranks' own generators left as they were.
Under hybrid each tp coordinate broadcasts from its first pipeline rank, whose generators the unit's input
check compared at the first call.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from ..unit_inputs import generator_state


class SharedGenerator:
    def __init__(self, device: torch.device, group, src: int):
        self.device, self.group, self.src = device, group, src
        self.state: torch.Tensor | None = None
        self._get = generator_state(device.type)      # (the current device's: the stage runs on it)

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        """Run the all-device stage's forward drawing from the shared state, and keep what it left."""
        cuda = self.device.type == "cuda"
        with torch.random.fork_rng(devices=[self.device.index or 0] if cuda else []):
            if self.state is None:
                self.state = self._agreed(self._get())
            self._set(self.state)
            yield
            self.state = self._get()

    def _agreed(self, state: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return state
        carried = state.to(self.device)         # (NCCL moves device tensors only)
        dist.broadcast(carried, src=self.src, group=self.group)
        return carried.cpu()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

"""The weight-gradient halves (W) of split backwards, held until a zero-bubble schedule's W action runs them
(the split itself is compiled in ``backend.split_backward``)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator

import torch

DEFERRING: contextvars.ContextVar["tuple[DeferredWeightGradients, Any] | None"] = contextvars.ContextVar(
    "dynshard_deferred_weight_gradients", default=None)


@dataclasses.dataclass
class DeferredWeightGradients:
    """The W parts left by I actions, by (stage, micro-batch), until their W action runs them."""

    pending: dict[Any, Callable[[], list[torch.Tensor]]] = dataclasses.field(default_factory=dict)

    @contextlib.contextmanager
    def collecting(self, key) -> Iterator[None]:
        token = DEFERRING.set((self, key))
        try:
            yield
        finally:
            DEFERRING.reset(token)

    def run(self, key) -> dict[int, torch.Tensor]:
        """The weight gradients of (stage, micro-batch) ``key``, by forward input position."""
        return self.pending.pop(key)()

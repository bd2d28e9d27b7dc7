"""torch's private ``torch.nn.utils.clip_grad._get_total_norm``, checked before it counts.

dynshard routes the public names of torch's clipping to its global norm (:mod:`dynshard.runtime.grad_norm`).
A reference taken before dynshard was imported (``from torch.nn.utils import clip_grad_norm_`` at the top of
a script) still reaches torch's own code, which looks ``_get_total_norm`` up at call time: wrapped, it
refuses gradients of split dynshard parameters instead of returning a wrong norm.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

_CHECKED = "_dynshard_checked"


def check_total_norm(check: Callable[[list], None]) -> None:
    """``clip_grad._get_total_norm(tensors, ...)`` calls ``check(grads)`` (which raises to refuse them) before it
    counts (idempotent)."""
    import torch.nn.utils.clip_grad as clip_grad

    total_norm = clip_grad._get_total_norm
    if getattr(total_norm, _CHECKED, False):
        return

    @functools.wraps(total_norm)
    def _get_total_norm(tensors, *args: Any, **kwargs: Any):
        grads = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        check(grads)
        return total_norm(grads, *args, **kwargs)

    setattr(_get_total_norm, _CHECKED, True)
    clip_grad._get_total_norm = _get_total_norm

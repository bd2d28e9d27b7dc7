"""``torch.nn.utils.clip_grad_norm_`` made right for dynshard's parameters, process-wide.

Every common recipe (transformers' Trainer through accelerate, nanoGPT) clips with torch's function,
which sees only this rank's shards. dynshard replaces the two names the function is reached by
(``torch.nn.utils.clip_grad_norm_`` and ``torch.nn.utils.clip_grad.clip_grad_norm_``) with a router that
sends a call on dynshard's parameters to dynshard's global norm and any other call to torch's own code.
A reference taken before dynshard was imported (``from torch.nn.utils import clip_grad_norm_`` at the top
of a script) still reaches torch's code: torch's private ``_get_total_norm``, which that code looks up at
call time, is wrapped to raise on gradients of split dynshard parameters instead of returning a wrong
norm. The public ``torch.nn.utils.get_total_norm`` (accelerate's clipping since 1.16: the norm, then
``clip_grads_with_norm_``) is routed the same way: on dynshard's gradients it returns the global norm.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

_ROUTED = "_dynshard_routed"


def route_clip_grad_norm(owns: Callable[[list], bool], clip: Callable[..., torch.Tensor],
                         is_split_grad: Callable[[list], bool], message: str,
                         grads_norm: Callable[[list, float], torch.Tensor | None]) -> None:
    """Install the router (idempotent). ``owns(params)``: whether dynshard clips these parameters
    (``clip`` has torch's signature); ``is_split_grad(grads)``: whether torch's own norm would be wrong;
    ``grads_norm(grads, norm_type)``: the global norm of dynshard's gradients (None for others), what the
    public ``torch.nn.utils.get_total_norm`` returns for them (accelerate >= 1.16 clips with it and
    ``clip_grads_with_norm_``, which scales by the norm it is given)."""
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    if getattr(clip_grad.clip_grad_norm_, _ROUTED, False):
        return
    original = clip_grad.clip_grad_norm_

    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if owns(params):
            return clip(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return original(params, max_norm, norm_type, error_if_nonfinite, foreach)

    setattr(clip_grad_norm_, _ROUTED, True)
    total_norm = clip_grad._get_total_norm

    @functools.wraps(total_norm)
    def _get_total_norm(tensors, *args: Any, **kwargs: Any):
        grads = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if is_split_grad(grads):
            raise RuntimeError(message)
        return total_norm(grads, *args, **kwargs)

    public_total_norm = utils.get_total_norm

    @functools.wraps(public_total_norm)
    def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        grads = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        total = grads_norm(grads, norm_type)
        if total is None:
            return public_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"dynshard: the total norm of order {norm_type} of the gradients is non-finite "
                               f"({total.item()}); set error_if_nonfinite=False to skip this check")
        return total

    clip_grad._get_total_norm = _get_total_norm
    clip_grad.clip_grad_norm_ = clip_grad_norm_
    utils.clip_grad_norm_ = clip_grad_norm_
    utils.get_total_norm = get_total_norm

"""TorchShard's state helpers: full tensors from shards, and shards from full tensors."""

from __future__ import annotations

from typing import Mapping

import torch

from .sharding import full_tensor, get_tag, stored_piece

_COMPILED_PREFIX = "_orig_mod."


def unwrap_compiled(module: torch.nn.Module) -> torch.nn.Module:
    """The user's module behind ``torch.compile``'s wrapper (or the module itself)."""
    return getattr(module, "_orig_mod", module)


def _strip(key: str) -> str:
    return key.replace(_COMPILED_PREFIX, "")


def collect_state_dict(module: torch.nn.Module, state_dict: Mapping[str, torch.Tensor] | None = None,
                       prefix: str = "") -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors on every rank, keyed as the original module's ``state_dict()``.

    ``state_dict`` defaults to ``module.state_dict(prefix=prefix, keep_vars=True)``; a state dict taken
    earlier from the same module works too (its tensors carry their shard tags). Every rank must call
    this: sharded tensors are gathered with collectives.
    """
    module = unwrap_compiled(module)
    source = module.state_dict(prefix=prefix, keep_vars=True) if state_dict is None else state_dict
    return {_strip(key): full_tensor(value) if isinstance(value, torch.Tensor) else value
            for key, value in source.items()}


def relocate_state_dict(module: torch.nn.Module, full_state_dict: Mapping[str, torch.Tensor],
                        prefix: str = "") -> dict[str, torch.Tensor]:
    """This rank's shards of ``full_state_dict``, ready for ``module.load_state_dict``.

    Keys are those of the original module (a ``_orig_mod.`` prefix is accepted and removed).
    """
    module = unwrap_compiled(module)
    own = {_strip(k): v for k, v in module.state_dict(prefix=prefix, keep_vars=True).items()}
    relocated = {}
    for key, value in full_state_dict.items():
        key = _strip(key)
        target = own.get(key)
        tag = get_tag(target) if isinstance(target, torch.Tensor) else None
        if tag is not None and isinstance(value, torch.Tensor):
            if tuple(value.shape) != tuple(tag.global_shape):
                raise ValueError(f"dynshard: {key} has shape {tuple(value.shape)} but the model's full "
                                 f"tensor is {tuple(tag.global_shape)}")
            value = stored_piece(value, tag)
        relocated[key] = value
    return relocated

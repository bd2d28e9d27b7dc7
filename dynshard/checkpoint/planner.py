"""DCP's default planners, taught to look up :class:`~.state.Pieces` (DCP only asks tensors for shards)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from .state import Pieces


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` alone in its storage (``torch.save`` of a view writes the whole storage)."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone()


class SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Pieces):
            return _compact(obj.__get_tensor_shard__(index))
        return super().lookup_object(index)


_TOKEN = "\0dynshard.checkpoint.pieces:"


def _swap(tree: Any, swap) -> Any:
    """``tree`` (dicts and lists) with each leaf passed through ``swap``, in place for dicts."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            tree[key] = _swap(value, swap)
        return tree
    if isinstance(tree, list):
        return [_swap(v, swap) for v in tree]
    return swap(tree)


class LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner first runs ``_init_state_dict``, which replaces every object it does not
        # know (our pieces) with None: hide them behind strings meanwhile
        hidden: dict[str, Pieces] = {}

        def hide(value: Any) -> Any:
            if isinstance(value, Pieces):
                token = f"{_TOKEN}{len(hidden)}"
                hidden[token] = value
                return token
            return value

        def show(value: Any) -> Any:
            return hidden[value] if isinstance(value, str) and value in hidden else value

        _swap(state_dict, hide)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        _swap(state_dict, show)
        _swap(self.state_dict, show)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Pieces):
            return obj.__get_tensor_shard__(index)     # a view: DCP copies into this rank's storage
        return super().lookup_tensor(index)

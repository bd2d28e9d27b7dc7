"""DCP's default planners, taught to look up :class:`~.state.Pieces` (DCP only asks tensors for shards)
and to write a tensor that two state-dict keys hold (a tied embedding and LM head) once.

An alias key keeps its own entry in the checkpoint's metadata (so ``dcp_to_torch_save`` and any DCP load
still find both keys, as ``model.state_dict()`` has them) but no data of its own: its storage entries
point at its target's bytes. Without this, a tied GPT's checkpoint held its embedding twice (8% of the
benchmark GPT's full state).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint import FileSystemWriter as _FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from .state import Pieces


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` alone in its storage (``torch.save`` of a view writes the whole storage)."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone()


class SavePlanner(DefaultSavePlanner):
    def __init__(self, aliases: dict[str, str] | None = None) -> None:
        super().__init__()
        self.aliases = aliases or {}           # flattened key -> the key whose tensor it is

    def create_local_plan(self):
        plan = super().create_local_plan()
        if self.aliases:
            self.plan = plan = dataclasses.replace(
                plan, items=[item for item in plan.items if item.index.fqn not in self.aliases])
        return plan

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        for alias, target in self.aliases.items():
            metadata.state_dict_metadata[alias] = metadata.state_dict_metadata[target]
        return plans, metadata

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


class FileSystemWriter(_FileSystemWriter):
    """DCP's writer; an alias key's storage entries are its target's (see the module docstring)."""

    def __init__(self, path: str, aliases: dict[str, str] | None = None) -> None:
        super().__init__(path)
        self.aliases = aliases or {}

    def finish(self, metadata, results) -> None:
        by_target: dict[str, list[str]] = {}
        for alias, target in self.aliases.items():
            by_target.setdefault(target, []).append(alias)
        shared = [WriteResult(index=dataclasses.replace(result.index, fqn=alias), size_in_bytes=result.size_in_bytes,
                              storage_data=result.storage_data)
                  for rank_results in results for result in rank_results
                  for alias in by_target.get(result.index.fqn, ())]
        super().finish(metadata, [*results, shared] if shared else results)

"""Split values crossing a graph break: DTensors that one program returns (``Config(gather_outputs=False)``)
and another takes as inputs.

The program that receives one was planned with the DTensor's placements fixed (``GraphInput.placements``)
and runs on its local tensor: :func:`local_arguments` hands it ``to_local()``, whose backward gives the
DTensor its gradient as a DTensor of the same placements, which the producing program's ``from_local``
turns back into the local gradient its backward expects. No communication on either side.

Such a program often has no parameters of its own (the loss after a graph break), so ``explain(model)``,
which finds programs through the model's parameters, would not list it: :func:`mark_split_outputs` records
on each split output the parameters' tags of the program that returned it, and :func:`adopt_split_inputs`
registers the receiving program with those tags.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from .. import compat

# split output -> the ShardTags of the parameters of the programs it comes from
_PRODUCERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def split_input_indices(inputs: Sequence[Any]) -> tuple[int, ...]:
    """Positions of a program's DTensor inputs (``GraphInput.is_split_value``)."""
    return tuple(inp.index for inp in inputs if inp.is_split_value)


def local_arguments(args: Sequence[Any], indices: Sequence[int]) -> list[Any]:
    """The arguments a program runs on: the local tensor of each DTensor at ``indices``."""
    args = list(args)
    for index in indices:
        if isinstance(args[index], DTensor):
            args[index] = compat.dtensor_local(args[index])
    return args


def mark_split_outputs(outputs: Sequence[Any], positions, tags: Sequence[Any]) -> None:
    """The DTensors at ``positions`` of ``outputs`` come from a program whose parameters carry ``tags``."""
    if tags:
        for position in positions:
            _PRODUCERS[outputs[position]] = tuple(tags)


def adopt_split_inputs(plan: Any, args: Sequence[Any], indices: Sequence[int]) -> list[Any]:
    """Register ``plan`` with the tags of the programs its DTensor arguments come from (``explain`` then
    lists it with them); returns those tags."""
    adopted: dict[int, Any] = {}
    for index in indices:
        for tag in _PRODUCERS.get(args[index], ()):
            adopted.setdefault(id(tag), tag)
    for tag in adopted.values():
        tag.add_plan(plan)
    return list(adopted.values())

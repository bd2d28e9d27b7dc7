"""Every sharding strategy DTensor has for one ATen op on a 1-D mesh, enumerated rather than chosen.

DTensor's dispatcher picks one strategy for the placements its inputs arrive with; a search over placements
needs all of them. DTensor's strategy function is asked through :func:`dynshard.compat.op_strategies.
dtensor_strategies`; here a function that refuses what it is offered is asked again per combination.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement

from ..compat.op_strategies import dtensor_strategies, has_strategy_function


@dataclasses.dataclass(frozen=True)
class OpStrategyChoice:
    """One way to run an op: the placement each tensor argument must arrive with (in the order of
    :func:`tensor_arguments`) and each output's placement (None for an output that is not a tensor)."""
    inputs: tuple[Placement, ...]
    outputs: tuple[Placement | None, ...]


def tensor_arguments(node: fx.Node) -> list[fx.Node]:
    """The node's tensor arguments in DTensor's schema order (positional, lists flattened, then keywords)."""
    found = []
    for value in (*node.args, *node.kwargs.values()):
        for leaf in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(leaf, fx.Node) and isinstance(leaf.meta.get("val"), torch.Tensor):
                found.append(leaf)
    return found


def op_strategies(node: fx.Node, mesh, options: dict[fx.Node, list[Placement]]) -> list[OpStrategyChoice] | None:
    """DTensor's strategies for ``node`` on the 1-D ``mesh`` when each tensor argument may arrive in any of
    ``options[argument]``; None when DTensor has no strategy function for the op (or its function refuses
    these arguments). A function that refuses one of the placements offered (``nll_loss_forward`` over
    log-probabilities split on their classes) is asked again for each combination of one placement per
    argument, and what it accepts is kept."""
    if not has_strategy_function(node.target):
        return None
    found = _asked(node, mesh, options)
    arguments = list(dict.fromkeys(tensor_arguments(node)))
    combinations = math.prod(len(options[a]) for a in arguments)
    if found is None and 1 < combinations <= _MOST_COMBINATIONS:
        found = []
        for chosen in itertools.product(*(options[a] for a in arguments)):
            for choice in _asked(node, mesh, {a: [p] for a, p in zip(arguments, chosen)}) or ():
                if choice not in found:
                    found.append(choice)
    return found or None


_MOST_COMBINATIONS = 64


def _asked(node: fx.Node, mesh, options: dict[fx.Node, list[Placement]]) -> list[OpStrategyChoice] | None:
    """DTensor's strategy function asked once: its strategies with one placement per tensor argument."""
    strategies = dtensor_strategies(node, mesh, options)
    if strategies is None:
        return None
    arguments = len(tensor_arguments(node))
    choices = []
    for inputs, outputs in strategies:
        choice = OpStrategyChoice(inputs, outputs)
        if len(inputs) == arguments and choice not in choices:
            choices.append(choice)
    return choices or None

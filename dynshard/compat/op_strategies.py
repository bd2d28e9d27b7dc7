"""Every sharding strategy DTensor has for one ATen op on a 1-D mesh, enumerated rather than chosen.

DTensor's dispatcher picks one strategy for the placements its inputs arrive with; a search over placements
needs all of them. Private API: ``ShardingPropagator.op_strategy_funcs`` (an ``OpStrategy`` per op from the
``OpStrategy`` of its inputs), ``op_single_dim_strategy_funcs`` expanded to the mesh as the propagator does
(``_insert_single_dim_replication_strategy``, ``expand_to_full_mesh_op_strategy``), ``OpSchema``,
``DTensorSpec`` and ``TensorMeta``, as meta-pytorch/autoparallel enumerates them
(``shardings/dtensor_sharding_helpers.get_op_strategy``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from torch._ops import OpOverload


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
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    if not isinstance(node.target, OpOverload) or (node.target not in propagator.op_strategy_funcs and node.target
                                                   not in getattr(propagator, "op_single_dim_strategy_funcs", {})):
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
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
    from torch.distributed.tensor._ops.single_dim_strategy import (_insert_single_dim_replication_strategy,
                                                                   _ShardingPlaceholder)
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    op = node.target
    propagator = DTensor._op_dispatcher.sharding_propagator

    def meta(value):
        return TensorMeta(value.shape, value.stride(), value.dtype)

    def strategy(arg: fx.Node):
        return OpStrategy([OpSpec(DTensorSpec(mesh, (p,), tensor_meta=meta(arg.meta["val"]))) for p in options[arg]])

    def schema_arg(value):
        if isinstance(value, fx.Node):
            return strategy(value) if isinstance(value.meta.get("val"), torch.Tensor) else value.meta.get("val")
        if isinstance(value, (list, tuple)) and any(isinstance(v, fx.Node) for v in value):
            return TupleStrategy([strategy(v) for v in value])
        return value

    schema = OpSchema(op, tuple(schema_arg(a) for a in node.args), {k: schema_arg(v) for k, v in node.kwargs.items()})
    try:
        if op in propagator.op_strategy_funcs:
            found = propagator.op_strategy_funcs[op](schema)
        elif op in getattr(propagator, "op_single_dim_strategy_funcs", {}):
            info = propagator.op_single_dim_strategy_funcs[op]
            first = OpSchema(op, tuple(a.strategies[0].output_spec if isinstance(a, OpStrategy) else a
                                       for a in schema.args_schema), schema.kwargs_schema)
            out_meta = propagator._propagate_tensor_meta_non_cached(first)
            n_out = 0 if out_meta is None else 1 if isinstance(out_meta, TensorMeta) else len(out_meta)
            single = _insert_single_dim_replication_strategy(
                info.func(op, schema.args_meta, schema.kwargs_meta), n_out, len(schema.args_strategy))
            single = [[Shard(p.dim) if isinstance(p, _ShardingPlaceholder) else p for p in s] for s in single]
            found = expand_to_full_mesh_op_strategy(mesh, schema, single, input_index=n_out,
                                                    output_tensor_meta=out_meta,
                                                    allow_unbacked_sharding=info.allow_unbacked_sharding,
                                                    allow_uneven_sharding=info.allow_uneven_sharding)
        else:
            return None
    except (NotImplementedError, RuntimeError, AssertionError, ValueError, IndexError, TypeError):
        return None
    if not isinstance(found, OpStrategy):
        return None
    arguments = len(tensor_arguments(node))
    choices = []
    for spec in found.strategies:
        inputs = tuple(s.placements[0] if s is not None else Replicate() for s in (spec.input_specs or ()))
        outputs = spec.output_specs if isinstance(spec.output_specs, (list, tuple)) else (spec.output_specs,)
        if len(inputs) != arguments:
            continue
        choice = OpStrategyChoice(inputs, tuple(None if o is None else o.placements[0] for o in outputs))
        if choice not in choices:
            choices.append(choice)
    return choices or None

"""DTensor's sharding strategy function for one ATen op on a 1-D mesh, asked directly (what
:mod:`dynshard.autodist.op_strategies` enumerates).

Private API: ``ShardingPropagator.op_strategy_funcs`` (an ``OpStrategy`` per op from the ``OpStrategy`` of its
inputs), ``op_single_dim_strategy_funcs`` expanded to the mesh as the propagator does
(``_insert_single_dim_replication_strategy``, ``expand_to_full_mesh_op_strategy``), ``OpSchema``,
``DTensorSpec`` and ``TensorMeta``, as meta-pytorch/autoparallel enumerates them
(``shardings/dtensor_sharding_helpers.get_op_strategy``).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from torch._ops import OpOverload


def has_strategy_function(op) -> bool:
    """Whether DTensor has a strategy function for ``op`` (a single-dimension one included)."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    return isinstance(op, OpOverload) and (op in propagator.op_strategy_funcs
                                           or op in getattr(propagator, "op_single_dim_strategy_funcs", {}))


def dtensor_strategies(node: fx.Node, mesh, options: dict[fx.Node, list[Placement]]
                       ) -> list[tuple[tuple[Placement, ...], tuple[Placement | None, ...]]] | None:
    """What DTensor's strategy function for ``node``'s op answers on the 1-D ``mesh`` when each tensor argument
    may arrive in any of ``options[argument]``: per strategy, the placement of each tensor input it reads
    and of each output (None for one that is not a tensor); None when the function refuses the arguments or
    the op has none."""
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
    strategies = []
    for spec in found.strategies:
        inputs = tuple(s.placements[0] if s is not None else Replicate() for s in (spec.input_specs or ()))
        outputs = spec.output_specs if isinstance(spec.output_specs, (list, tuple)) else (spec.output_specs,)
        strategies.append((inputs, tuple(None if o is None else o.placements[0] for o in outputs)))
    return strategies

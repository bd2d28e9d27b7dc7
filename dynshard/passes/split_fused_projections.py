"""Split fused projections (``q, k, v = c_attn(x).split(C, dim=-1)``) into one matmul per block.

The projection is matched as ``mm``, reshapes and a bias added before or after them (``lower_to_aten``
adds a linear's bias after the reshape that follows it).

A fused weight cannot be column-split as one tensor: each rank needs its share of q, of k and of v, and
DTensor gathers a strided shard before ``split``. So each block of the fused weight (and bias) becomes a
:func:`param_block` of the parameter, with its own matmul; the policy can then split the blocks like any
other projection, and the parameter itself is stored as ``_StridedShard(dim, split_factor=blocks)``:
this rank's rows of every block, in order ([q_r, k_r, v_r]).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..compat import StridedShard
from .context import PassContext
from .op_sets import CASTS, RESHAPES, aten



def param_block(tensor: torch.Tensor, index: int, count: int, dim: int) -> torch.Tensor:
    """Block ``index`` of ``count`` equal blocks of ``tensor`` along ``dim``, without communication when
    the tensor is whole or stored as ``_StridedShard(dim, count)``."""
    if not isinstance(tensor, DTensor):
        return tensor.chunk(count, dim)[index]
    placement = tensor.placements[0]
    if isinstance(placement, StridedShard) and placement.dim == dim and placement.split_factor == count:
        block_placement = Shard(dim)
    elif placement == Replicate():
        block_placement = Replicate()
    else:
        tensor = tensor.redistribute(tensor.device_mesh, [Replicate()])
        block_placement = Replicate()
    local = tensor.to_local().chunk(count, dim)[index]
    shape = list(tensor.shape)
    shape[dim] //= count
    return DTensor.from_local(local, tensor.device_mesh, [block_placement], run_check=False,
                              shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())


def split_fused_projections(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.layout.tp_mesh is None:      # nothing is split inside a unit of one rank
        return gm
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for split in [n for n in gm.graph.nodes if n.target in (aten.split.Tensor, aten.split_with_sizes.default)]:
        match = _match(split)
        if match is None:
            continue
        weight, weight_dim, bias, product, reshapes, count, size = match
        ctx.blocked[placeholders.index(_parameter_of(weight))] = (count, weight_dim)
        if bias is not None:
            ctx.blocked[placeholders.index(_parameter_of(bias))] = (count, 0)
        _rewrite(gm.graph, split, weight, weight_dim, bias, product, reshapes, count, size)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _single_user(node: fx.Node) -> bool:
    return len(node.users) == 1


def _match(split: fx.Node):
    """(weight, weight block dim, bias, the mm, reshapes, blocks, block size) or None."""
    source, sizes, dim = split.args[0], split.args[1], split.args[2] if len(split.args) > 2 else 0
    out = source.meta.get("val") if isinstance(source, fx.Node) else None
    if out is None or dim not in (-1, out.dim() - 1):
        return None
    total = out.shape[-1]
    if isinstance(sizes, int):
        size = sizes
    elif len(set(sizes)) == 1:
        size = sizes[0]
    else:
        return None
    if total % size or total // size < 2 or not all(u.target is operator.getitem for u in split.users):
        return None
    node, bias = source, None       # mm -> reshapes -> (+ bias) -> reshapes -> split
    if node.target is aten.add.Tensor and _single_user(node):
        product, candidate = node.args
        if _parameter_of(candidate) is not None and candidate.meta["val"].dim() == 1:
            bias, node = candidate, product
    reshapes = []
    while node.target in RESHAPES and _single_user(node):
        reshapes.append(node)
        node = node.args[0]
    if bias is None and node.target is aten.add.Tensor and _single_user(node):
        product, candidate = node.args
        if _parameter_of(candidate) is not None and candidate.meta["val"].dim() == 1:
            bias, node = candidate, product
    if node.target is not aten.mm.default or not _single_user(node):
        return None
    activation, operand = node.args
    weight, weight_dim = operand, 1
    if operand.target is aten.t.default and _single_user(operand):
        weight, weight_dim = operand.args[0], 0
    if _parameter_of(weight) is None:
        return None
    return weight, weight_dim, bias, node, list(reversed(reshapes)), total // size, size


def _parameter_of(node) -> fx.Node | None:
    """The placeholder ``node`` is, or is a dtype cast of (mixed precision), if nothing else reads it."""
    if isinstance(node, fx.Node) and node.target in CASTS and _single_user(node):
        node = node.args[0]
    if isinstance(node, fx.Node) and node.op == "placeholder" and _single_user(node):
        return node
    return None


def _rewrite(graph: fx.Graph, split, weight, weight_dim, bias, product, reshapes, count, size) -> None:
    users = {u.args[1]: u for u in split.users}
    activation = product.args[0]
    with graph.inserting_before(split):
        for index in range(count):
            block = call_like(graph, param_block, (weight, index, count, weight_dim), product)
            operand = call_like(graph, aten.t.default, (block,), product) if weight_dim == 0 else block
            value = call_like(graph, aten.mm.default, (activation, operand), product)
            for reshape in reshapes:
                shape = list(reshape.args[1])
                shape[-1] = size
                value = call_like(graph, aten.reshape.default, (value, shape), reshape)
            if bias is not None:
                value = call_like(graph, aten.add.Tensor, (value, call_like(
                    graph, param_block, (bias, index, count, 0), product)), product)
            if index in users:
                users[index].replace_all_uses_with(value)


def call_like(graph: fx.Graph, target, args: tuple, like: fx.Node, kwargs: dict | None = None) -> fx.Node:
    """A new node ``target(*args, **kwargs)`` with its value on FakeTensors (what the cost model and the per-op
    placement ILP read) and the module path of the node ``like`` it stands for."""
    node = graph.call_function(target, args, kwargs or {})
    values, kwarg_values = fx.node.map_arg((args, kwargs or {}), lambda a: a.meta["val"])
    node.meta["val"] = target(*values, **kwarg_values)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node

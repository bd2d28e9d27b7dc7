"""Split the fused gate|up weight of mixture-of-experts layers into one expert matmul per block.

transformers' experts (Mixtral, Qwen3-MoE, ...) keep every expert's gate and up projections as one 3-D
parameter ``gate_up_proj`` [E, 2I, H], run over the tokens' experts in one static-shape graph and cut
in two afterwards (``gate, up = out.chunk(2, dim=-1)``)::

    batched_mm:  index(W, [ids]) -> bmm(., x[..., None]) -> squeeze(-1) -> split(I, -1)
    grouped_mm:  transpose(W, -2, -1) -> grouped_mm(x, ., offs) -> split(I, -1)

Megatron's expert tensor parallelism splits each expert's intermediate dimension: rank r holds its rows
of the gate block and of the up block. As with a fused attention projection
(:mod:`.split_fused_projections`), the weight cannot be split as one tensor (DTensor gathers a strided
shard before ``split``), so each block becomes a :func:`~.split_fused_projections.param_block` of the
parameter with its own copy of the ops from the weight to the split; the policy can then split the
blocks along the intermediate dimension, and the parameter is stored as
``_StridedShard(1, split_factor=2)`` ([gate_r, up_r] of every expert). Its gradient stays local: the
blocks are views of this rank's shard.

Nothing changes the math: each block's ops are the fused op's restricted to that block's output rows
(the same tokens, the same experts, the same order of accumulation per output element).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .context import PassContext
from .op_sets import CASTS, RESHAPES, TRANSPOSE_OPS, aten
from .split_fused_projections import call_like, param_block


def expert_matmuls() -> dict:
    """Expert matmul ops -> (weight operand position, {output dim: weight dim}) for a 3-D weight
    [E, K, N] (after transposes): ``bmm`` reads the indexed weight [S, M, K] first (output [S, M, 1]),
    the grouped matmuls read the stacked weight [E, K, N] second (output [S, N])."""
    table = {aten.bmm.default: (0, {1: 1}), aten._grouped_mm.default: (1, {1: 2})}
    fallback = grouped_mm_fallback()
    if fallback is not None:
        table[fallback] = (1, {1: 2})
    return table


def grouped_mm_fallback():
    """transformers' opaque grouped matmul (``experts_implementation="grouped_mm"`` with weights other
    than bf16 under torch.compile), once transformers has registered it."""
    try:
        return torch.ops.transformers.grouped_mm_fallback.default
    except (AttributeError, RuntimeError):
        return None


def split_fused_experts(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.layout.tp_mesh is None:      # nothing is split inside a unit of one rank
        return gm
    from .grouped_mm_strategies import register_grouped_mm_strategies

    matmuls = expert_matmuls()
    if any(n.target in matmuls and n.target is not aten.bmm.default for n in gm.graph.nodes):
        register_grouped_mm_strategies()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    changed = False
    for split in [n for n in gm.graph.nodes if n.target in (aten.split.Tensor, aten.split_with_sizes.default)]:
        match = match_fused_experts(split, matmuls)
        if match is None:
            continue
        weight, weight_dim, chain, count, size = match
        ctx.blocked[placeholders.index(weight)] = (count, weight_dim)
        _rewrite(gm.graph, ctx, split, weight, weight_dim, chain, count, size)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def match_fused_experts(split: fx.Node, matmuls: dict):
    """(weight placeholder, its block dim, the ops from it to the split's input in graph order, blocks,
    block size) when ``split`` cuts an expert matmul's output along the dimension that one 3-D
    parameter's rows give it, else None."""
    source, sizes = split.args[0], split.args[1]
    dim = split.args[2] if len(split.args) > 2 else 0
    out = _val(source)
    if out is None or not all(u.target is operator.getitem for u in split.users):
        return None
    dim %= out.dim()
    total = out.shape[dim]
    size = sizes if isinstance(sizes, int) else sizes[0] if len(set(sizes)) == 1 else None
    if not size or total % size or total // size < 2:
        return None
    chain, node = [], source
    while node.target not in matmuls:       # back through views that keep the split dimension
        if len(node.users) != 1 or not isinstance(node.args[0], fx.Node):
            return None
        before = _val(node.args[0])
        if node.target is aten.squeeze.dim:
            squeezed = node.args[1] % before.dim()
            dim = dim + (dim >= squeezed)
        elif node.target in RESHAPES and dim == out.dim() - 1 and before.shape[-1] == total:
            dim = before.dim() - 1
        else:
            return None
        chain.append(node)
        node, out = node.args[0], before
    matmul = node
    if len(matmul.users) != 1:
        return None
    position, out_to_weight = matmuls[matmul.target]
    if dim not in out_to_weight:
        return None
    chain.append(matmul)
    operand, operand_dim = matmul.args[position], out_to_weight[dim]
    while isinstance(operand, fx.Node) and operand.op == "call_function":   # back to the parameter
        if len(operand.users) != 1:
            return None
        if operand.target in TRANSPOSE_OPS:
            operand_dim = _before_transpose(operand, operand_dim)
        elif operand.target is aten.index.Tensor and _indexes_experts_only(operand):
            pass                            # [E, A, B][ids] -> [S, A, B]: dims 1 and 2 stay
        elif operand.target not in CASTS:
            return None
        chain.append(operand)
        operand = operand.args[0]
    weight = operand
    value = _val(weight)
    if not isinstance(weight, fx.Node) or weight.op != "placeholder" or value is None or value.dim() != 3 \
            or len(weight.users) != 1 or operand_dim == 0 or value.shape[operand_dim] != total:
        return None
    return weight, operand_dim, list(reversed(chain)), total // size, size


def _indexes_experts_only(node: fx.Node) -> bool:
    indices = node.args[1]
    return len(indices) == 1 and isinstance(indices[0], fx.Node) and _val(indices[0]) is not None \
        and _val(indices[0]).dim() == 1


def _before_transpose(node: fx.Node, dim: int) -> int:
    """The input dimension that becomes output dimension ``dim`` of a transpose."""
    rank = _val(node).dim()
    if node.target is aten.permute.default:
        return list(node.args[1])[dim] % rank
    if node.target is aten.t.default:
        return 1 - dim
    a, b = node.args[1] % rank, node.args[2] % rank
    return b if dim == a else a if dim == b else dim


def _val(node):
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _rewrite(graph: fx.Graph, ctx: PassContext, split: fx.Node, weight: fx.Node, weight_dim: int,
             chain: list[fx.Node], count: int, size: int) -> None:
    """One copy of ``chain`` (weight -> split input) per block, each reading its block of the weight."""
    users = {u.args[1]: u for u in split.users}
    with graph.inserting_before(split), ctx.fake_mode:
        for index in range(count):
            block = call_like(graph, param_block, (weight, index, count, weight_dim), weight)
            value, previous = block, weight
            for node in chain:
                args, kwargs = fx.node.map_arg((node.args, dict(node.kwargs)), lambda a: value if a is previous else a)
                if node.target in RESHAPES:     # (only reshapes that keep the split, last, dimension)
                    shape = list(args[1])
                    shape[-1] = size
                    args = (args[0], shape)
                value, previous = call_like(graph, node.target, args, node, kwargs), node
            if index in users:
                users[index].replace_all_uses_with(value)

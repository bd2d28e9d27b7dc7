"""Lower the planned ATen graph to the per-rank program.

Graph inputs (local tensors on this rank) become DTensors on the plan unit's mesh with their planned
placements, and graph outputs become local tensors again, whole inside the unit. Between the two, every
op runs on DTensors, so tracing the program (aot_autograd) records each op on its local shard plus the
functional collectives (``_c10d_functional.*`` + ``wait_tensor``) that the propagated plan needs, in the
forward graph and, through DTensor's autograd rules, in the backward graph. Ops that fell back to
replication get their inputs gathered and their outputs replicated explicitly; random ops on split
values draw the whole tensor and keep this rank's shard (:mod:`.random_draws`).

The backward mirror of "reduce a partial sum where it is produced": a replicated activation that feeds
matmuls gets an identity whose backward reduces a partial gradient (Megatron's ``f``), after autograd
has summed the gradients of all its uses; left to DTensor, a partial gradient would flow on into the
previous layer's matmuls and be gathered there.

A whole operand that propagation sliced like the other operand of its batched matmul (``MatchedSlice``:
multi-query attention's repeated k/v) is sliced for that one reader by :class:`SliceKeepingGradient`,
whose gradient stays sliced rather than being gathered.

Across units (mesh dimension "dp") each trainable parameter first passes through
:class:`~.grad_sync.SyncOverDP`, so the graphs themselves do what DDP's reducer and ZeRO do: gather a
ZeRO-split parameter, average (and reduce-scatter) the gradient.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate

from .. import compat
from ..compat import pytree
from ..runtime.mesh import Layout
from ..runtime.sharding import SHARDS
from ..runtime.zero import zero_groups
from .context import PassContext
from .context_parallel_attention import ATTENTION_OPS, attention_fn, sequence_split_dims
from .grad_sync import GradSync, sync_over_dp
from .op_sets import MATMUL_OPERANDS, as_view, view_root
from .propagate_sharding import RESHAPE, reduced_placements
from .random_draws import draw_whole_fn
from .vocab_parallel_loss import fuse_vocab_parallel_losses


class ReduceGradPartials(torch.autograd.Function):
    """Identity forward; backward all-reduces any Partial placement of the gradient."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor) and tuple(reduced_placements(grad.placements)) != tuple(grad.placements):
            if _transposed(grad):
                # a weight's gradient that autograd computed as the transpose of a matmul: the collective
                # would first copy it to row-major, element by element; reduce the product as it lies
                flipped = grad.t()
                return flipped.redistribute(grad.device_mesh, reduced_placements(flipped.placements)).t()
            grad = grad.redistribute(grad.device_mesh, reduced_placements(grad.placements))
        return grad


def _transposed(grad: DTensor) -> bool:
    local = grad.to_local()
    return local.dim() == 2 and not local.is_contiguous() and local.t().is_contiguous()


class SliceKeepingGradient(torch.autograd.Function):
    """A whole (replicated) DTensor sliced to ``placements``, locally. The gradient keeps the slice's
    placements: it is the same global value, and DTensor's own backward of the slice would gather it."""

    @staticmethod
    def forward(ctx, tensor, mesh, placements):
        return tensor.redistribute(mesh, placements)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def slice_fn(layout: Layout, placements):
    """A whole value sliced like the other operand of the matmul that reads it (``MatchedSlice``)."""
    mesh = layout.tp_mesh

    def slice_like_partner(value):
        return SliceKeepingGradient.apply(value, mesh, placements) if isinstance(value, DTensor) else value
    return slice_like_partner


def reduce_grad_partials(tensor):
    return ReduceGradPartials.apply(tensor) if torch.is_grad_enabled() and tensor.requires_grad else tensor


def _named(fn, name: str):
    fn.__name__ = fn.__qualname__ = name
    return fn


def grad_sync_for(inp, ctx: PassContext) -> GradSync | None:
    """What a graph input needs across data-parallel units; None for user inputs and buffers, and for
    parameters without gradients that are whole on every unit."""
    layout, config, zero = ctx.layout, ctx.config, ctx.zero_of(inp)
    trainable = inp.kind == "parameter" and inp.requires_grad and not config.inference_only
    if layout.dp_group is None or (zero is None and not trainable):
        return None
    policy = ctx.mixed_precision
    compute = policy.param_dtype if policy is not None and inp.dtype.is_floating_point else None
    sync = GradSync(dp_group=layout.dp_group.group_name, communicate=ctx.sync_grads,
                    compute_dtype=compute, reduce_dtype=(policy.reduce_dtype or compute) if policy else None)
    if zero is None:
        return sync
    groups = zero_groups(layout, zero.ngroups)
    # the rank only where the program reads it (ZeRO-1's slice of the all-reduced gradient): ranks whose
    # programs are the same share aot_autograd's cache entry (backend/compiler/cache_names.py digests what it captures)
    return dataclasses.replace(
        sync, zero=zero, shard_group=groups.shard_name, rank=0 if zero.reduce_scatter else groups.rank,
        replica_group=groups.replicas.group_name if groups.replicas is not None else None)


def wrap_input_fn(layout: Layout, arrival, planned, shape, stride, sync: GradSync | None):
    mesh = layout.tp_mesh

    def wrap_input(local: torch.Tensor):
        if sync is not None:
            local = sync_over_dp(local, sync)
        if mesh is None:
            return local
        tensor = compat.dtensor_from_local(local, mesh, arrival, *((local.shape, local.stride()) if shape is None
                                                                   else (shape, stride)))
        return tensor if tuple(arrival) == tuple(planned) else tensor.redistribute(mesh, planned)
    return wrap_input


def replicate_fn(layout: Layout):
    mesh, whole = layout.tp_mesh, [Replicate()] * len(layout.placement_dims)

    def replicate(value):
        return pytree.tree_map_only(
            torch.Tensor,
            lambda t: t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, whole, run_check=False),
            value)
    return replicate


def gather_fn(layout: Layout):
    """Whole local tensors from DTensors: the inputs of a replicated fallback, and every tensor leaving
    the program (tensors crossing a graph boundary are whole inside the plan unit)."""
    mesh, whole = layout.tp_mesh, [Replicate()] * len(layout.placement_dims)

    def gather_whole(value):
        return value.redistribute(mesh, whole).to_local() if isinstance(value, DTensor) else value
    return gather_whole


def place_fn(layout: Layout, placements):
    """Redistribute a value to the placements a policy gave it (``ctx.constraints``)."""
    mesh = layout.tp_mesh

    def place(value):
        return pytree.tree_map_only(DTensor, lambda t: t.redistribute(mesh, placements), value)
    return place


def split_output_fn(layout: Layout, position: int, split: dict):
    """``Config(gather_outputs=False)``: an output split inside the unit leaves the program as this
    rank's shard, and ``split[position]`` records its DTensor spec, so that the runtime hands the user a
    DTensor (:meth:`~dynshard.runtime.program.ShardedProgram.__call__`), outside the compiled graph.
    Whole outputs (partial sums reduced) leave as they are."""
    mesh = layout.tp_mesh

    def split_output(value):
        if not isinstance(value, DTensor):
            return value
        value = value.redistribute(mesh, reduced_placements(value.placements))
        if any(p != Replicate() for p in value.placements):
            split[position] = (tuple(value.placements), value.shape, value.stride())
        return value.to_local().clone()     # (not a view: see leave_fn)
    return split_output


def leave_fn(layout: Layout):
    """Every tensor leaving the program, whole inside the plan unit. A copy, not ``to_local()``'s view: an
    output that aliases an intermediate is rebuilt as a view by aot_autograd, and an in-place change of it
    (transformers' Trainer scales the loss in place: ``loss *= world``) is refused by autograd."""
    gather_whole = gather_fn(layout)

    def leave(value):
        return gather_whole(value).clone() if isinstance(value, DTensor) else value
    return leave


def reduce_partials_fn(layout: Layout):
    mesh = layout.tp_mesh

    def reduce_partials(value):
        return pytree.tree_map_only(
            DTensor, lambda t: t.redistribute(mesh, reduced_placements(t.placements)), value)
    return reduce_partials


def insert_collectives(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph, layout, propagation = gm.graph, ctx.layout, ctx.propagation
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]

    wrapped = []
    with graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before():
        for inp, node in reversed(list(zip(ctx.inputs, placeholders))):
            sync = grad_sync_for(inp, ctx)
            if (layout.tp_mesh is None and sync is None) or inp.kind == "size":   # (a size stays a number)
                continue
            # a symbolic input's sizes are Dynamo's symbols, which the program's tracer never saw: its global
            # shape is read from the local tensor (a user input arrives whole)
            shape, stride = (None, None) if ctx.on_symbols and inp.is_symbolic else (inp.shape, inp.stride)
            fn = wrap_input_fn(layout, ctx.arrival(inp), ctx.placements[inp.index], shape, stride, sync)
            wrapper = graph.call_function(_named(fn, f"wrap_{inp.kind}"), (node,))
            wrapper.meta["wraps"] = inp.kind       # (outline_repeated_blocks moves a block's own into it)
            wrapped.append((node, wrapper))
    for node, new in wrapped:
        node.replace_all_uses_with(new, delete_user_cb=lambda user, new=new: user is not new)

    if layout.tp_mesh is not None:
        fuse_vocab_parallel_losses(graph, propagation.vocab_parallel_losses)
        _rewrite_nodes(graph, layout, propagation, ctx.constraints)
        output = next(n for n in graph.nodes if n.op == "output")
        to_boundary = _named(leave_fn(layout), "to_boundary")
        positions = itertools.count()
        with graph.inserting_before(output):
            output.args = fx.node.map_arg(output.args, lambda a: graph.call_function(
                to_boundary if ctx.config.gather_outputs else
                _named(split_output_fn(layout, next(positions), ctx.split_outputs), "to_boundary"), (a,)))
    graph.lint()
    gm.recompile()
    return gm


def matmul_input_roots(graph: fx.Graph, propagation) -> list[fx.Node]:
    """Computed, replicated activations (partial sums reduced where produced included: the lookup of a
    row-split embedding feeding an LM head) that reach a matmul operand through views only, and stay whole
    on the way (a value sliced like the other operand, ``MatchedSlice``, is not one)."""
    roots: dict[fx.Node, None] = {}
    for node in graph.nodes:
        if node.target not in MATMUL_OPERANDS:
            continue
        first = MATMUL_OPERANDS[node.target]
        for arg in node.args[first:first + 2]:
            sliced = False
            while isinstance(arg, fx.Node) and view_root(arg) is not arg:
                sliced = sliced or any(isinstance(p, SHARDS) for p in propagation.placements.get(arg.name, ()))
                arg = arg.args[0]
            placements = propagation.placements.get(arg.name) if isinstance(arg, fx.Node) else None
            if placements is not None and arg.name in propagation.reduced_partials:
                placements = reduced_placements(placements)      # (reduced where produced)
            if arg is not None and arg.op == "call_function" and placements is not None and not sliced and \
                    all(p == Replicate() for p in placements):
                roots[arg] = None
    return list(roots)


def _only_output_read(node: fx.Node) -> None:
    """Context parallelism's attention returns the output alone (its log-sum-exp is the backward's, which
    aot_autograd derives)."""
    read = [user for user in node.users if not (user.target is operator.getitem and user.args[1] == 0)]
    if read:
        raise NotImplementedError(f"dynshard: context parallelism takes attention whose output alone is read; "
                                  f"{node.name}'s other outputs are read by {[user.name for user in read]}")


def _rewrite_nodes(graph: fx.Graph, layout: Layout, propagation, constraints: dict) -> None:
    replicate = _named(replicate_fn(layout), "replicate")
    gather = _named(gather_fn(layout), "gather_whole")
    reduce_partials = _named(reduce_partials_fn(layout), "reduce_partials")
    gathered = {c.node for c in propagation.collectives if c.kind == "all_gather" and c.node in constraints}
    for node in matmul_input_roots(graph, propagation):
        if node.name in gathered:   # the backward of its gather reduce-scatters the partial gradient instead
            continue
        with graph.inserting_after(node):
            new = graph.call_function(reduce_grad_partials, (node,))
        node.replace_all_uses_with(new, delete_user_cb=lambda user, new=new: user is not new)
    for node in list(graph.nodes):
        if node.name in constraints:
            constraint = constraints[node.name]
            with graph.inserting_after(node):
                new = graph.call_function(_named(place_fn(layout, constraint.placements), "place"), (node,))
            node.replace_all_uses_with(new, delete_user_cb=lambda user, new=new, readers=constraint.readers: (
                user is not new and (readers is None or user.name in readers)))
        elif node.name in propagation.reduced_partials:
            with graph.inserting_after(node):
                new = graph.call_function(reduce_partials, (node,))
            node.replace_all_uses_with(new, delete_user_cb=lambda user, new=new: user is not new)
        if node.name in propagation.drawn_whole:
            node.target = draw_whole_fn(node.target, layout.tp_mesh)
            continue
        source = node.args[0] if node.args else None
        if node.target is RESHAPE and isinstance(source, fx.Node) and \
                any(p != Replicate() for p in propagation.placements.get(source.name, ())):
            shape = fx.node.map_arg(node.args[1], lambda size: size.meta.get("val"))
            node.target = as_view(node.target, source.meta.get("val"), shape)
        if node.target in ATTENTION_OPS and sequence_split_dims(propagation.placements.get(node.args[0].name, ())):
            _only_output_read(node)
            node.target = _named(attention_fn(layout, node.target), "context_parallel_attention")
            continue
        fallback = node.name in propagation.fallbacks
        if not fallback and node.name not in propagation.replicated_constants:
            continue
        if fallback:
            with graph.inserting_before(node):
                node.args, node.kwargs = fx.node.map_arg(
                    (node.args, node.kwargs), lambda a: graph.call_function(gather, (a,)))
        with graph.inserting_after(node):
            new = graph.call_function(replicate, (node,))
        node.replace_all_uses_with(new, delete_user_cb=lambda user, new=new: user is not new)
    nodes = {node.name: node for node in graph.nodes}
    for reader_name, matched in propagation.matched_slices.items():
        reader = nodes[reader_name]
        value = reader.args[0]      # the source, or what the steps above put after it
        with graph.inserting_before(reader):
            sliced = graph.call_function(_named(slice_fn(layout, matched.placements), "slice_like_partner"),
                                         (value,))
        reader.replace_input_with(value, sliced)

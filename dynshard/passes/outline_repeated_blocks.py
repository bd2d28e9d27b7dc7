"""Regional compilation: a block that repeats is compiled once and called once per repetition.

Why. dynshard compiles one unrolled program per rank, so the Python-side work of compiling it (aot
autograd's trace and partition, Inductor's lowering, scheduling and code generation) grows with the
model's depth; Inductor already reuses identical kernels, so it is that work, not C++ compilation, that
makes a deep model's first step slow. FSDP2 + torch.compile gets the same effect from graph breaks
around each block. Here the graph stays whole: each repetition of a block becomes a call of one shared
``invoke_subgraph`` (torch's higher-order op for ``nested_compile_region``), which aot_autograd traces and
partitions once per subgraph and Inductor emits once (a forward and a backward function, called N times).

What a block is. The outermost module in a node's ``nn_module_stack`` whose path ends in ``.<int>`` (an
entry of a ``ModuleList`` or ``Sequential``: ``blocks.3``). Blocks share one subgraph when they are of one
class and traced alike: the same op sequence with the same non-tensor arguments, reading inputs of the
same shapes, strides, dtypes and ``requires_grad``. A block's parameters (and buffers) enter its
subgraph as they are stored, and dynshard's wrapper of each one (its ZeRO gather and gradient
reduce-scatter, DDP's all-reduce, its DTensor placement) moves into the block that alone reads it. So the
communication of one block is compiled once, with the block, and Inductor buckets it per block: FSDP2's
per-block grouping, made in the graph. ZeRO-3's recompute tags on the gathers (``backend/reshard.py``)
reach the subgraph because they are set right before every partitioner call, the block's included.
A parameter read by two blocks or outside any (a tied embedding, a final norm) keeps its wrapper at the
top of the program.

When it applies (anything else compiles unrolled, as before):
  - ``Config.regional_compile`` (the default) and at least two blocks alike (with the same planned
    placements);
  - each block is convex (no path leaves it and comes back) and everything it passes on is a tensor.
``recompute_modules`` and a user's ``torch.utils.checkpoint`` compose with it: their tags reach the
block's subgraph (invoke_subgraph traces it from the tagged nodes), and dynshard's own communication,
left untagged, is saved by the block's partitioner (``force_save_collectives``) as on an unrolled
program. (An earlier reading, that the block's partitioner recomputed a collective, compared an
outlined program with an unrolled one: under aot_eager the unrolled one is partitioned by min-cut only
when it carries tags, and then saves the cross-entropy's all-reduce that the outlined program's
untagged top level recomputes.)

Inside a tensor-parallel unit the values between ops are DTensors, which ``invoke_subgraph`` does not
take: they cross each call as local tensors (:class:`_Boundary`). A redistribution dynshard inserted
inside a block (Megatron's all-reduces, a placement constraint) belongs to the block and is compiled with
it, as do the wrappers of the block's own parameters.

Two torch 2.13 bugs this works around (both silent: wrong gradients, exact loss), each guarded by a test
that fails without its workaround (``tests/test_regional_compile.py``):
  - A partitioned block's forward returns its own input (or a view of it) as saved for backward.
    :func:`unalias_subgraph_outputs` reads such outputs from the input instead, on the joint graph (so
    that ZeRO-3's recompute tags on a parameter's gather reach the backward, which otherwise kept every
    gathered parameter) and on every graph handed to Inductor.
  - Inductor reuses, for later buffers, storage that is still live across an ``invoke_subgraph`` call (an
    LM head's or embedding's gradient overwritten): programs with outlined blocks are compiled with
    ``allow_buffer_reuse=False`` (:func:`dynshard.backend.compiler.compile_per_rank`). Freed buffers still
    go back to the allocator; only Inductor's own reuse of a dead buffer's storage by name is off.
"""

from __future__ import annotations

import logging
import operator
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx

from .. import compat
from .context import PassContext
from .repeated_blocks import Block, find_blocks, value_of

log = logging.getLogger("dynshard")
_KEPT_META = ("val", "example_value", "tensor_meta", "stack_trace", "nn_module_stack")


def outline_repeated_blocks(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not ctx.config.regional_compile:
        return gm
    placements = ctx.propagation.placements if ctx.propagation is not None else {}
    outlined = outline_blocks(gm, split_values=ctx.layout.tp_mesh is not None, placements=placements)
    if outlined:
        ctx.outlined = outlined
        log.debug("compiled once: %s", ", ".join(f"{cls} x{count}" for cls, count in outlined))
    return gm


def outline_blocks(gm: fx.GraphModule, split_values: bool = False,
                   placements: dict[str, Any] | None = None) -> list[tuple[str, int]]:
    """Rewrites ``gm`` in place; returns (block class, repetitions) for every subgraph made.
    ``split_values``: values may be DTensors (a tp unit); they cross each call as local tensors.
    ``placements``: each node's planned placements (by name), part of what makes blocks alike."""
    groups: dict[Any, list[Block]] = defaultdict(list)
    for block in find_blocks(gm.graph, placements):
        groups[(block.cls, block.signature)].append(block)
    graph, outlined = gm.graph, []
    replaced: dict[fx.Node, fx.Node] = {}     # a block's output -> the getitem of its call
    for members in groups.values():
        if len(members) < 2 or not all(b.outlinable for b in members):
            continue
        outputs = sorted(set().union(*(b.used_outside for b in members)))
        if not all(isinstance(value_of(members[0].nodes[i]), torch.Tensor) for i in outputs):
            continue
        name = f"dynshard_block_{len(outlined)}"
        boundary = _Boundary(name) if split_values else None
        gm.add_submodule(name, _subgraph(members[0], outputs, boundary))
        with graph.inserting_after(list(graph.find_nodes(op="placeholder"))[-1]):
            subgraph = graph.get_attr(name)
        for block in members:
            _replace_with_call(graph, block, subgraph, name, outputs, replaced, boundary)
        outlined.append((members[0].cls, len(members)))
    if outlined:
        _topological_order(graph)
        graph.lint()
        gm.recompile()
    return outlined


class _Boundary:
    """DTensors cross an ``invoke_subgraph`` call as their local tensors (the op takes plain tensors only).
    Each side records the spec of what it hands over while the program is traced (the caller's side runs
    first for inputs, the block's side for outputs) and the other side rebuilds the DTensor from it. Every
    call must hand over the same specs (the blocks were grouped by their placements), which is checked.

    Gradients stay right whatever placement they take inside the block: ``from_local``'s backward
    redistributes a gradient to the placements ``to_local``'s backward assumes (a Partial value's
    gradient is Replicate), as DTensor guarantees for any pair of them."""

    def __init__(self, name: str):
        self.name = name
        self.specs: dict[tuple[str, int], Any] = {}

    def __dynshard_cache_state__(self) -> str:
        # (the specs are what tracing the program records: the rest of the program decides them)
        return self.name

    def localize(self, side: str):
        def to_local(value, index: int):
            spec = compat.dtensor_spec(value)
            known = self.specs.setdefault((side, index), spec)
            if (known is None) != (spec is None) or (spec is not None and (
                    known.placements != spec.placements or known.shape != spec.shape)):
                raise RuntimeError(f"dynshard: {self.name} {side} {index} arrives as {spec}, not {known} as "
                                   "in the first call; set regional_compile=False and report this")
            return compat.dtensor_local(value) if spec is not None else value
        to_local.__name__ = f"local_{side}"
        return to_local

    def rebuild(self, side: str):
        def from_local(local, index: int):
            spec = self.specs[(side, index)]
            return local if spec is None else compat.dtensor_from_spec(local, spec)
        from_local.__name__ = f"dtensor_{side}"
        return from_local


def _subgraph(block: Block, outputs: list[int], boundary: _Boundary | None) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, inp in enumerate(block.inputs):
        env[inp] = graph.placeholder(f"arg{i}")
        if boundary is not None:    # (recorded values are global DTensor shapes: the block gets local ones)
            env[inp] = graph.call_function(boundary.rebuild("input"), (env[inp], i))
        else:
            env[inp].meta = {k: v for k, v in inp.meta.items() if k in ("val", "example_value", "tensor_meta")}
    for node in block.nodes:
        env[node] = graph.node_copy(node, lambda a: env[a])
    results = tuple(env[block.nodes[i]] for i in outputs)
    for result in results:
        # invoke_subgraph's autograd reads requires_grad of the outputs from their recorded values; an
        # ATen graph's values were traced below autograd (requires_grad=False), which would drop the
        # block's gradients. Without them it runs the subgraph on fakes to find out.
        result.meta = {k: v for k, v in result.meta.items() if k not in ("val", "example_value")}
    if boundary is not None:
        results = tuple(graph.call_function(boundary.localize("output"), (r, k)) for k, r in enumerate(results))
    graph.output(results)
    return fx.GraphModule(torch.nn.Module(), graph)


def _replace_with_call(graph: fx.Graph, block: Block, subgraph: fx.Node, name: str, outputs: list[int],
                       replaced: dict[fx.Node, fx.Node], boundary: _Boundary | None) -> None:
    operands = [replaced.get(i, i) for i in block.inputs]
    with graph.inserting_after(block.nodes[-1]):
        if boundary is not None:
            operands = [graph.call_function(boundary.localize("input"), (o, i)) for i, o in enumerate(operands)]
        call = graph.call_function(compat.invoke_subgraph, (subgraph, name, *operands))
    values = []
    members = set(block.nodes)
    with graph.inserting_after(call):
        results = [graph.call_function(operator.getitem, (call, k)) for k in range(len(outputs))]
        if boundary is not None:
            results = [graph.call_function(boundary.rebuild("output"), (r, k)) for k, r in enumerate(results)]
    for position, result in zip(outputs, results):
        source = block.nodes[position]
        result.meta = {k: v for k, v in source.meta.items() if k in _KEPT_META}
        values.append(value_of(source))
        source.replace_all_uses_with(result, delete_user_cb=lambda user: user not in members)
        replaced[source] = result
    if boundary is None:
        call.meta["example_value"] = tuple(values)
        if all("val" in block.nodes[p].meta for p in outputs):
            call.meta["val"] = tuple(values)
    for node in reversed(block.nodes):
        graph.erase_node(node)


def _topological_order(graph: fx.Graph) -> None:
    """A reader of a block's output that sat before the block's last node now precedes the call that
    produces it: reorder stably (graph order wherever dependencies allow)."""
    import heapq

    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    pending = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(order[n], n) for n in nodes if pending[n] == 0]
    heapq.heapify(ready)
    ordered = []
    while ready:
        _, node = heapq.heappop(ready)
        ordered.append(node)
        for user in node.users:
            pending[user] -= 1
            if pending[user] == 0:
                heapq.heappush(ready, (order[user], user))
    if len(ordered) != len(nodes):
        raise RuntimeError("dynshard: outlining repeated blocks made a cycle (a block was not convex)")
    previous = ordered[0]
    if nodes[0] is not previous:
        nodes[0].prepend(previous)
    for node in ordered[1:]:
        previous.append(node)
        previous = node


def unalias_subgraph_outputs(gm: fx.GraphModule) -> int:
    """The torch 2.13 workaround (module docstring): an output of a partitioned block that is one of its
    inputs, or a view of one, is read from that input in the calling graph instead (the view re-applied
    there), so that Inductor sees the input's real lifetime. Returns the number of outputs rewired."""
    count = 0
    graph = gm.graph
    for node in list(graph.find_nodes(op="call_function", target=compat.invoke_subgraph)):
        body = getattr(gm, node.args[0].target)
        placeholders = list(body.graph.find_nodes(op="placeholder"))
        results = next(iter(body.graph.find_nodes(op="output"))).args[0]
        for k, result in enumerate(results):
            views, source = [], result
            while isinstance(source, fx.Node) and source.op == "call_function" and \
                    isinstance(source.target, compat.OpOverload) and source.target.is_view and \
                    isinstance(source.args[0], fx.Node):
                views.append(source)
                source = source.args[0]
            if not (isinstance(source, fx.Node) and source.op == "placeholder"):
                continue
            # the body's inputs as the calling graph passes them (a view on symbolic sizes reads size inputs too);
            # a view that reads a value computed inside the block stays there
            outer_of = {p: node.args[2 + i] for i, p in enumerate(placeholders)}
            if any(a not in outer_of and a not in views for view in views for a in view.all_input_nodes):
                continue
            outer = outer_of[source]
            for user in [u for u in node.users if u.target is operator.getitem and u.args[1] == k]:
                with graph.inserting_before(user):
                    env, value = dict(outer_of), outer
                    for view in reversed(views):
                        value = env[view] = graph.node_copy(view, lambda a: env.get(a, a))
                user.replace_all_uses_with(value)
                graph.erase_node(user)
                count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count

"""Sharding propagation: the placement of every node, and the communication it implies.

The graph is run abstractly on DTensors whose local tensors are FakeTensors, so the answer comes from
DTensor's own sharding strategies (~1100 ATen overloads) and its redistribution choices; for each op
dynshard asks DTensor's dispatcher which inputs it will redistribute, and records the collective that
the redistribution costs.

One rule is dynshard's own: a partial sum is reduced where it is produced. DTensor would happily carry
a Partial through the residual stream (Replicate + Partial -> Partial) and then reduce it again before
every LayerNorm that reads it; reducing at the producer costs one all-reduce, Megatron's placement.
Views of a partial sum are free, so a partial read only by views (``mm`` -> ``view(B, T, C)``) is
reduced after them, where the value has the shape the model gave it.

A matmul over a folded batch (attention's ``bmm`` over ``[B*H, T, D]``) whose one operand is split by
heads while the other is whole (multi-query attention: every query head reads the one k/v head, repeated)
would gather the split operand; DTensor cannot even do that on fake data, since folding B with a split H
leaves a ``_StridedShard``. dynshard slices the whole operand instead, locally, before the fold (where the
heads are still their own dimension), so that both fold the same way (:class:`MatchedSlice`): each rank
runs its query heads against the whole k/v, Megatron's and vLLM's way. The slice's gradient keeps its
placement (no gather); it becomes a partial sum where the repeat sums it over the heads.

A policy may also place activations (``ctx.constraints``): the value of a constrained node is
redistributed to its placements where it is produced (a partial sum reduce-scattered along the
sequence, a sequence shard gathered before the matmuls that read it: sequence parallelism).

Ops with no strategy fall back to replicated execution (inputs made whole, output replicated) with a
warning that names the op and its source line.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from .. import compat
from ..compat import pytree
from ..config.errors import SymbolicShapesError
from ..runtime.mesh import Layout
from ..runtime.sharding import SHARDS, local_shape
from .context import PassContext
from .context_parallel_attention import abstract_attention, splits_sequence
from .propagation import Collective, LocalReshard, MatchedSlice, Propagation
from .layer_memo import LayerMemo, repeated_layers
from .op_memo import OpMemo, op_key
from .propagation_reuse import Rejoin, reusable_prefix
from .random_draws import DRAWN_BY_SHAPE, draw_whole_fn, is_random, on_split_values
from .op_sets import BATCHED_MATMULS, RESHAPES, SLICE_COMMUTING, as_view
from .vocab_parallel_loss import abstract_log_softmax, abstract_nll_loss, loss_pairs, rows, split_on_classes


RESHAPE = torch.ops.aten.reshape.default


def transition_kind(src: Placement, dst: Placement) -> str | None:
    """The collective that moves one mesh dimension from ``src`` to ``dst`` (None: local or nothing)."""
    if src == dst:
        return None
    if isinstance(src, Partial):
        return "all_reduce" if isinstance(dst, Replicate) else "reduce_scatter" if isinstance(dst, SHARDS) else None
    if isinstance(src, SHARDS):
        return "all_gather" if isinstance(dst, Replicate) else "all_to_all" if isinstance(dst, SHARDS) else "all_gather"
    return None


def redistribution_collectives(node: str, layout: Layout, shape: Sequence[int], itemsize: int,
                               src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> list[Collective]:
    found = []
    for dim, s, d in zip(layout.placement_dims, src, dst):
        kind = transition_kind(s, d)
        if kind is not None:
            shape = [compat.size_hint(size) for size in shape]     # (a symbolic size: at its hint)
            numel = max(math.prod(local_shape(torch.Size(shape), layout, src)),
                        math.prod(local_shape(torch.Size(shape), layout, dst)))
            found.append(Collective(node, kind, dim, numel * itemsize, mirrored=len(shape) > 0))
    return found


def reduced_placements(placements) -> tuple[Placement, ...]:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def source_line(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{lines[i]}: {code}"
    return "source line unknown"


class ShardingInterpreter(fx.Interpreter):
    """Runs the ATen graph on fake DTensors and records placements and implied communication."""

    def __init__(self, gm: fx.GraphModule, layout: Layout, input_placements: Sequence[tuple[Placement, ...]],
                 input_meta: Sequence[Any], warn: bool, constraints: dict, memo: OpMemo, layers: dict | None = None,
                 symbolic_sizes: dict[int, torch.SymInt] | None = None):
        # every value is kept: a later trial of the policy reuses those before its first change
        super().__init__(gm, garbage_collect_values=False)
        self.layout = layout
        self.constraints = constraints
        self.memo = memo
        self.rejoin: Rejoin | None = None
        self.placed: dict[fx.Node, DTensor] = {}     # values placed for some of their readers only
        self.input_placements = list(input_placements)
        self.input_meta = list(input_meta)
        self.symbolic_sizes = symbolic_sizes or {}    # size inputs of a program on symbolic sizes, by index
        self.warn = warn
        self.result = Propagation({}, [], [], {}, set(), set(), tuple(input_placements))
        self._placeholder_index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
        self._loss_pairs = loss_pairs(gm.graph)
        self._paired_log_softmax = set(self._loss_pairs.values())
        self._slice_candidates = slice_candidates(gm.graph)
        self._slice_sources = {source for by_operand in self._slice_candidates.values()
                               for source, _ in by_operand.values()}
        self.kept: dict[fx.Node, Any] = {}     # values of slice sources (the interpreter frees values)
        self.layer_memo = LayerMemo(layers, set(self._loss_pairs) | self._paired_log_softmax) if layers else None

    def run(self, *args, initial_env=None, **kwargs):
        self.kept = {n: v for n, v in (initial_env or {}).items() if n in self._slice_sources}
        return super().run(*args, initial_env=initial_env, **kwargs)

    # -- node kinds ---------------------------------------------------------------------------------
    def placeholder(self, target, args, kwargs):
        index = self._placeholder_index[self._current]
        if index in self.symbolic_sizes:        # (the ops that compute sizes read it as a number)
            return self.symbolic_sizes[index]
        return self.memo.input(self.layout.tp_mesh, self.input_meta[index], tuple(self.input_placements[index]),
                               self.make_input)

    def make_input(self, meta, placements: tuple[Placement, ...]) -> DTensor:
        shape, stride, dtype, device, requires_grad = meta
        local = torch.empty(local_shape(shape, self.layout, placements), dtype=dtype, device=device)
        local.requires_grad_(requires_grad)
        return DTensor.from_local(local, self.layout.tp_mesh, placements, run_check=False,
                                  shape=shape, stride=stride)

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            self.result.replicated_constants.add(self._current.name)
            return self.replicate(torch.empty_like(value))
        return value

    def run_node(self, n: fx.Node):
        if self.layer_memo is not None and self.layer_memo.replays(n, self):
            return self.env[n]
        self._current = n
        out = super().run_node(n)
        constraint = self.constraints.get(n.name)
        if constraint is not None and isinstance(out, DTensor) and constraint.readers is not None:
            self.placed[n] = self.place(n, out, constraint.placements)
        elif constraint is not None and isinstance(out, DTensor):
            out = self.place(n, out, constraint.placements)
        elif n.op == "call_function" and any(
                isinstance(leaf, DTensor) and any(isinstance(p, Partial) for p in leaf.placements)
                and not (_only_viewed(n) and not any(compat.is_mask_partial(p) for p in leaf.placements))
                for leaf in pytree.tree_leaves(out)):
            self.result.reduced_partials.add(n.name)
            out = pytree.tree_map_only(DTensor, lambda t: self.reduce_partial(n, t), out)
        spec = _first_dtensor(out)
        if spec is not None:
            self.result.placements[n.name] = spec.placements
        if n in self._slice_sources:
            self.kept[n] = out
        if self.rejoin is not None and self.rejoin.after(n, out):
            self.take_the_rest(n)
        if self.layer_memo is not None:
            self.layer_memo.ran(n, self)
        return out

    def take_the_rest(self, node: fx.Node) -> None:
        """From after ``node`` on, the base's values and records (it computed them from the same values)."""
        base, rest = self.rejoin.base, self.rejoin.rest(node)
        self.rejoin = None
        for later in rest:
            self.env[later] = base.env[later]
        self.placed.update({n: v for n, v in base.placed.items() if n in set(rest)})
        self.result = self.result.followed_by(base.prefix({n.name for n in rest}))

    def map_nodes_to_values(self, args, n: fx.Node):
        placed = {source: value for source, value in self.placed.items()
                  if n.name in self.constraints[source.name].readers}
        if not placed:
            return super().map_nodes_to_values(args, n)
        return fx.node.map_arg(args, lambda a: placed[a] if a in placed else self.env[a])

    def call_function(self, target, args, kwargs):
        node = self._current
        if not isinstance(target, compat.OpOverload):
            return target(*args, **kwargs)
        if target is RESHAPE and isinstance(args[0], DTensor) and not _all_replicated(args[0]):
            target = as_view(target, args[0], args[1])
        if node in self._paired_log_softmax and split_on_classes(args[0]):
            return abstract_log_softmax(args[0], args[2])   # its collectives are counted with its nll_loss
        if node in self._loss_pairs and split_on_classes(args[0]):
            return self.vocab_parallel_loss(node, args)
        flat = pytree.arg_tree_leaves(*args, **kwargs)
        if not any(isinstance(a, DTensor) for a in flat):
            return self.replicated_constant(node, target, args, kwargs)
        if is_random(target) and on_split_values(args, kwargs):
            return self.random_on_split_values(node, target, args, kwargs)
        if splits_sequence(target, args, kwargs):
            out, collectives = abstract_attention(node.name, target, args, kwargs, self.layout, source_line(node))
            self.result.collectives.extend(collectives)
            return out
        if not compat.has_sharding_strategy(target):
            return self.fallback(node, target, args, kwargs, f"DTensor has no sharding strategy for {target}")
        key = op_key(target, args, kwargs)
        if key in self.memo.answers:
            redistributions, out = self.memo.answers[key]
            self.record_redistributions(node, args, redistributions)
            return out
        try:
            redistributions = compat.dtensor_redistributions(target, args, kwargs)
            if target in BATCHED_MATMULS and _gathers(redistributions):
                key = None          # (whether a slice matches depends on the node's own producers)
                matched = self.slice_to_partner(node, args)
                if matched is not None:
                    args = matched
                    redistributions = compat.dtensor_redistributions(target, args, kwargs)
        except NotImplementedError as error:
            return self.fallback(node, target, args, kwargs, str(error).splitlines()[0])
        self.record_redistributions(node, args, redistributions)
        out = target(*args, **kwargs)
        self.memo.keep(key, redistributions, out)
        return out

    def random_on_split_values(self, node: fx.Node, target, args, kwargs):
        """Each shard holds the one process's random values (:mod:`.random_draws`): drawn whole and sliced
        where they depend on the shape only, else a replicated fallback."""
        if target not in DRAWN_BY_SHAPE:
            return self.fallback(node, target, args, kwargs, "a random op on split values runs whole, so that "
                                                             "each shard holds the values one process draws")
        self.result.drawn_whole.add(node.name)
        return draw_whole_fn(target, self.layout.tp_mesh)(*args, **kwargs)

    def replicated_constant(self, node: fx.Node, target, args, kwargs):
        """An op on plain values (``arange``, ``full``, a mask): its tensors, whole on every rank."""
        key = op_key(target, args, kwargs)
        key = key and ("constant", *key)
        if key in self.memo.answers:
            out, tensors = self.memo.answers[key]
        else:
            out = target(*args, **kwargs)
            tensors = any(isinstance(o, torch.Tensor) for o in pytree.tree_leaves(out))
            if tensors:
                out = pytree.tree_map_only(torch.Tensor, self.replicate, out)
            if key is not None:
                self.memo.answers[key] = out, tensors
        if tensors:
            self.result.replicated_constants.add(node.name)
        return out

    def record_redistributions(self, node: fx.Node, args, redistributions) -> None:
        sources = [arg_node for arg_node, value in zip(pytree.arg_tree_leaves(*node.args),
                                                       pytree.arg_tree_leaves(*args))
                   if isinstance(value, DTensor)]
        for source, (current, needed) in zip(sources, redistributions):
            if current.placements == needed.placements:
                continue
            name = source.name if isinstance(source, fx.Node) else ""
            self.record(node, name, current.tensor_meta, current.placements, needed.placements)

    def vocab_parallel_loss(self, node: fx.Node, args):
        """log_softmax + nll_loss over logits split along the vocabulary: three all-reduces of one value
        per row (:mod:`.vocab_parallel_loss`)."""
        self.result.vocab_parallel_losses.update({node.name, self._loss_pairs[node].name})
        row_bytes = rows(args[0]) * args[0].dtype.itemsize
        for _ in range(3):
            self.result.collectives.append(Collective(node.name, "all_reduce", self.layout.placement_dims[0],
                                                      row_bytes, mirrored=False))
        return abstract_nll_loss(*args)

    def slice_to_partner(self, node: fx.Node, args: tuple) -> tuple | None:
        """The arguments of a batched matmul with its whole operand sliced like its split one (both
        fold the same leading dimensions of values that split one of them), or None."""
        for whole, (source, chain) in self._slice_candidates.get(node, {}).items():
            split_node, value = node.args[1 - whole], self.kept.get(source)
            if value is None or source in self.placed or not _all_replicated(args[whole]) \
                    or not isinstance(args[1 - whole], DTensor) or _all_replicated(args[1 - whole]) \
                    or split_node.target not in RESHAPES:
                continue
            unfolded = split_node.args[0]
            placements = self.result.placements.get(unfolded.name) if isinstance(unfolded, fx.Node) else None
            shape, own_shape = _shape(unfolded), _shape(source)
            if placements is None or shape is None or own_shape is None or len(shape) != len(own_shape) \
                    or shape[:-2] != own_shape[:-2]:
                continue
            folded = len(shape) - 2     # the leading dimensions that the matmul's batch folds
            if not all(p == Replicate() or (type(p) is Shard and p.dim % len(shape) < folded) for p in placements):
                continue
            value = value.redistribute(self.layout.tp_mesh, placements)
            for link in chain:
                value = link.target(value, *link.args[1:], **link.kwargs)
            sliced = tuple(value if i == whole else a for i, a in enumerate(args))
            if _gathers(compat.dtensor_redistributions(node.target, sliced, {})):
                continue
            self.result.matched_slices[chain[0].name] = MatchedSlice(
                source.name, tuple(placements), tuple(c.name for c in chain), node.name)
            for link in chain:      # what the program will hold there (explain, matmul_input_roots)
                self.result.placements[link.name] = value.placements if link is chain[-1] else tuple(placements)
            return sliced
        return None

    # -- helpers ------------------------------------------------------------------------------------
    def replicate(self, tensor: torch.Tensor) -> DTensor:
        return DTensor.from_local(tensor, self.layout.tp_mesh, [Replicate()] * len(self.layout.placement_dims),
                                  run_check=False)

    def place(self, node: fx.Node, tensor: DTensor, placements: tuple[Placement, ...]) -> DTensor:
        if tuple(placements) != tuple(tensor.placements):
            self.record(node, node.name, compat.dtensor_spec(tensor).tensor_meta, tensor.placements, placements)
        return self.memo.redistribute(tensor, self.layout.tp_mesh, placements)

    def reduce_partial(self, node: fx.Node, tensor: DTensor) -> DTensor:
        target = reduced_placements(tensor.placements)
        if tuple(target) != tuple(tensor.placements):
            self.record(node, node.name, compat.dtensor_spec(tensor).tensor_meta, tensor.placements, target)
        return self.memo.redistribute(tensor, self.layout.tp_mesh, target)

    def record(self, node: fx.Node, source: str, meta, src, dst) -> None:
        self.result.collectives.extend(redistribution_collectives(
            node.name, self.layout, meta.shape, meta.dtype.itemsize, src, dst))
        if any(isinstance(d, SHARDS) and isinstance(s, Replicate) for s, d in zip(src, dst)):
            self.result.local_reshards.append(LocalReshard(node.name, source, tuple(dst)))

    def fallback(self, node: fx.Node, target, args, kwargs, reason: str):
        """Run ``target`` on whole inputs. Over inputs that are whole already (constants such as
        ``torch.tensor([])`` lifted by ``lift_fresh_copy``) nothing is gathered: no warning."""
        self.result.fallbacks[node.name] = reason
        gathers = any(isinstance(a, DTensor) and any(p != Replicate() for p in a.placements)
                      for a in pytree.arg_tree_leaves(*args, **kwargs))
        if self.warn and gathers:
            warnings.warn(f"dynshard: {target} runs replicated (inputs gathered) at {source_line(node)}: {reason}",
                          stacklevel=2)
        whole = [Replicate()] * len(self.layout.placement_dims)

        def gather(value):
            if isinstance(value, DTensor):
                if tuple(value.placements) != tuple(whole):
                    self.record(node, "", compat.dtensor_spec(value).tensor_meta, value.placements, whole)
                return value.redistribute(self.layout.tp_mesh, whole).to_local()
            return value

        local_args, local_kwargs = pytree.tree_map(gather, (args, kwargs))
        out = target(*local_args, **local_kwargs)
        return pytree.tree_map_only(torch.Tensor, self.replicate, out)


def slice_candidates(graph: fx.Graph) -> dict[fx.Node, dict[int, tuple[fx.Node, list[fx.Node]]]]:
    """For each batched matmul, the operands that could be sliced like the other one: operand index ->
    (the value to slice, the ops from it to the operand). The operand must fold the batch dimensions
    (a reshape) of a value reached through ops that commute with a slice; each op on the way is read by
    the next one only, since the slice changes what it holds."""
    candidates: dict[fx.Node, dict[int, tuple[fx.Node, list[fx.Node]]]] = {}
    for node in graph.nodes:
        if node.target not in BATCHED_MATMULS:
            continue
        for index, operand in enumerate(node.args[:2]):
            if not isinstance(operand, fx.Node) or operand.target not in RESHAPES or len(operand.users) != 1 \
                    or not isinstance(operand.args[0], fx.Node):
                continue
            chain, source = [operand], operand.args[0]
            while source.target in SLICE_COMMUTING and len(source.users) == 1 and isinstance(source.args[0], fx.Node) \
                    and _shape(source) == _shape(source.args[0]) \
                    and not any(isinstance(a, fx.Node) for a in (*source.args[1:], *source.kwargs.values())):
                chain.insert(0, source)
                source = source.args[0]
            if _shape(source) is not None:
                candidates.setdefault(node, {})[index] = (source, chain)
    return candidates


def _shape(node) -> tuple | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _all_replicated(value) -> bool:
    return isinstance(value, DTensor) and all(p == Replicate() for p in value.placements)


def _gathers(redistributions) -> bool:
    """Whether DTensor would make a split operand whole (or less split) on some mesh dimension."""
    return any(isinstance(s, SHARDS) and not isinstance(d, SHARDS)
               for current, needed in redistributions for s, d in zip(current.placements, needed.placements))


def _only_viewed(node: fx.Node) -> bool:
    """Whether every reader of ``node`` is a reshape (its partial sum is reduced after them; not a masked one,
    whose mask has the shape of the lookup's indices)."""
    return bool(node.users) and all(user.target in RESHAPES for user in node.users)


def _first_dtensor(out):
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, DTensor):
            return compat.dtensor_spec(leaf)
    return None


def propagate(gm: fx.GraphModule, ctx: PassContext, input_placements: Sequence[tuple[Placement, ...]],
              warn: bool = False, reuse: Propagation | None = None, replay_layers: bool = True) -> Propagation:
    """Propagate from the inputs' placements. With ``reuse`` (an earlier propagation of the same graph),
    only the nodes between the first that reads a change and the point where the values rejoin the
    earlier ones run again (:mod:`.propagation_reuse`). ``replay_layers``: a repeated layer whose inputs
    arrive as an earlier one's did takes its records (:mod:`.layer_memo`); False runs every op."""
    if ctx.layout.tp_mesh is None:      # units of one rank: every tensor is whole, nothing to propagate
        return Propagation({}, [], [], {}, set(), set(), tuple(input_placements))
    meta = [(inp.shape, inp.stride, inp.dtype, inp.device if ctx.config.trace_strategy == "fake"
             else torch.device("meta"), inp.requires_grad) for inp in ctx.inputs]
    initial_env, known = reusable_prefix(gm, tuple(input_placements), ctx.constraints, reuse)
    with compat.isolated_tracing(ctx.fake_mode), ctx.fake_mode, compat.on_symbols(ctx.on_symbols):
        ctx.op_memo = ctx.op_memo.for_mode(ctx.fake_mode) if ctx.op_memo is not None else OpMemo(ctx.fake_mode)
        interpreter = ShardingInterpreter(gm, ctx.layout, input_placements, meta, warn, dict(ctx.constraints),
                                          ctx.op_memo, repeated_layers(gm) if replay_layers else None,
                                          {inp.index: inp.value for inp in ctx.inputs
                                           if inp.kind == "size" and isinstance(inp.value, torch.SymInt)})
        if known is not None:
            interpreter.result = dataclasses.replace(known, input_placements=tuple(input_placements))
            interpreter.placed = {n: v for n, v in reuse.placed.items() if n in initial_env}
            interpreter.rejoin = Rejoin(gm, reuse, ctx.constraints)
        interpreter.run(*([None] * len(ctx.inputs)), initial_env=initial_env)
    interpreter.result.env = interpreter.env
    if interpreter.layer_memo is not None:
        interpreter.result.replayed_layers = interpreter.layer_memo.replayed
    interpreter.result.placed = interpreter.placed
    interpreter.result.constraints = dict(ctx.constraints)
    return interpreter.result


def propagate_sharding(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Pass: each node's placements and the plan's cost, in ``ctx.propagation``. The graph is left as it is:
    planning (``backend.plan_graph.place_graph``) places one lowered graph for every candidate."""
    placements = [ctx.placements[inp.index] for inp in ctx.inputs]
    ctx.propagation = propagate(gm, ctx, placements, warn=True)
    if any(inp.is_symbolic for inp in ctx.inputs) and not ctx.on_symbols:   # a new size meets an old plan
        check_even_splits(ctx.propagation, ctx)       # (a program on the symbols: checked at their hints)
    # (the plan outlives the compile; the fake value of every node need not)
    ctx.propagation.env, ctx.propagation.placed = {}, {}
    return gm



def check_even_splits(propagation: Propagation, ctx: PassContext) -> None:
    """A symbolic graph's plan is made at its first sizes and runs at others: every value it splits along a
    mesh dimension must divide evenly at these sizes (a mean over uneven shards is not the mean), or
    :class:`~dynshard.config.errors.SymbolicShapesError`, before anything is compiled or run."""
    layout = ctx.layout
    sizes = ", ".join(f"{inp.name}{list(inp.shape)}" if inp.kind != "size" else f"{inp.symbols[0]}={inp.value}"
                      for inp in ctx.inputs if inp.is_symbolic)
    for node, value in propagation.env.items():
        placements = propagation.placements.get(getattr(node, "name", None))
        if not isinstance(value, torch.Tensor) or not placements:
            continue
        for dim_name, placement in zip(layout.placement_dims, placements):
            if not isinstance(placement, SHARDS) or value.dim() <= placement.dim:
                continue
            size, parts = int(value.shape[placement.dim]), layout.size(dim_name)
            if size % parts:
                raise SymbolicShapesError(
                    f"dynshard: at the sizes {sizes}, {node.name} ({source_line(node)}) is split along dimension "
                    f"{placement.dim} over {parts} ranks, and its size there, {size}, does not divide by {parts}. "
                    f"Pad the batch so that this dimension is a multiple of {parts} (a collator's "
                    f"pad_to_multiple_of={parts} or a multiple of it)")

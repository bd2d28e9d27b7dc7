"""Per-op placements on a plan unit's tensor-parallel ranks: an ILP over DTensor's sharding strategies, the
formulation of meta-pytorch/autoparallel's ``optimize_sharding`` on dynshard's forward ATen graph, each
forward choice priced with what it implies in the backward (the backward is autograd of the forward: a
redistribution's gradient is its transpose).

Nodes. Every tensor value of the forward graph whose placement is chosen:
- a parameter, buffer or input (a placeholder): whole, or split along a dimension the unit's size divides,
  or, a fused projection's weight or bias read only as blocks (``passes/split_fused_projections``), this
  rank's rows of every block (``_StridedShard``, the tp policy's placement of it), each ``param_block`` then
  this rank's rows of its block (user inputs and tensors the builder fixed, e.g. pins, keep their placement);
- an op: each of DTensor's strategies for it (:func:`.op_strategies.op_strategies`) whose
  inputs are whole or split (a partial input only from a whole value that needs no gradient: the
  vocabulary's indices under a split table), its partial output reduced where it is made, as dynshard's
  propagation does, to whole (all-reduce) or to a split (reduce-scatter), a later partial output (a loss's
  total weight) to whole; plus dynshard's own
  vocabulary-parallel cross-entropy (log_softmax and nll_loss over logits split on their classes: three
  all-reduces of one value per row). An op DTensor cannot shard has one option: whole, its inputs gathered.
  A ``getitem`` is not a node: its readers read the producer's output of that index.

Variables (:func:`placement_problem`): ``x[v,k]`` in {0, 1}, node ``v`` takes option ``k``; ``z[e,p,q]`` >= 0
for each edge ``e`` (a value ``u`` read as argument ``a`` of node ``v``, or as a graph output), ``u`` made as
``p`` and read as ``q`` (the placement ``v``'s option needs, with whether that option splits its work).

    minimise   sum_{v,k} c[v,k] x[v,k] + sum_{e,p,q} r[e,p,q] z[e,p,q]
    subject to sum_k x[v,k] = 1                                 for every node v
               sum_q z[e,p,q] = sum_{k: out(u,k) = p} x[u,k]     for every edge e and each p
               sum_p z[e,p,q] = sum_{k: in(v,k,a) = q} x[v,k]    for every edge e and each q
               sum_{v,k} h[v,k] x[v,k] <= budget                 (with a memory budget)
               (no z[e,p,q] where p cannot become q: a partial read from anything but a whole value;
               a placeholder read otherwise than it is held, since a plan places a tensor for every
               reader (a parameter held split and used whole is gathered from a view of it, e.g. its
               transpose); one split read along another dimension, an all-to-all; a strided shard read
               otherwise than it is)

Costs, in seconds a step (the device profile's; a micro-batch's terms times ``nmicros``):
- ``c``: the op's forward and backward (3x the forward: its FLOPs at the device's rate, else the bytes it
  reads and writes at its bandwidth, op by op: not the unit's fused traffic, see ``compute``), a 1/t share
  when the option splits anything; a reduced partial's collective and, for a reduce-scatter, its gradient's all-gather; a trainable parameter's gradient all-reduce over the
  data-parallel units (its shard's bytes), and a vanishing 1e-15 s per byte it holds, so that among equally
  fast options the one that holds less wins;
- ``r``: the redistribution ``p -> q`` (an all-gather; a slice is free) and its transpose in the backward:
  the gradient arrives as ``q``, or partial when ``v``'s option reads a whole value but splits its work (a
  column-parallel matmul's input), and goes back to ``p`` (a parameter's, in buckets: no latency of its own).
Each forward collective also waits for the slowest rank (``wait`` seconds, :func:`per_op_problem`).
Collectives are priced by ``DeviceProfile.collective_seconds`` over the unit's ranks; ``h``: the bytes a rank
holds for the node at the peak (a trainable parameter's shard 4x: with its gradient and Adam's moments; the
bytes autograd saves of an op's output, split when the option's output is), times its tied copies.

Repeated layers are tied (:func:`placement_problem`'s ``blocks``): a later instance's nodes take the first one's
variables, so the ILP's size is one layer's whatever the depth.

The chosen placements are a :class:`~dynshard.planning.Plan` (:func:`as_plan`): each placeholder's, and each
value redistributed for the readers whose option needs it otherwise (``Plan.activations``), so that sharding
propagation, given the plan, runs each op on the inputs its option reads. Not yet: several placements of
one value for different readers, all-to-all redistributions and gathers of a strided shard (sharding
propagation on the planning mesh cannot trace them: DTensor asks the fake group for the rank's coordinate).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections import defaultdict

import numpy as np
import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..compat import StridedShard
from ..passes.propagate_sharding import transition_kind
from ..passes.split_fused_projections import param_block
from ..passes.vocab_parallel_loss import loss_pairs
from ..config.pins import pin_of
from ..planning import ActivationChoice, Plan, decode_placement, encode_placement
from ..planning.prediction import EMPTY
from .device_profile import DeviceProfile
from .op_strategies import OpStrategyChoice, op_strategies, tensor_arguments
from .cost_model import BUCKET_BYTES, UnitCosts, forward_seconds, tp_calls
from .solver import NANOSECONDS, Solution, solve
from ..runtime.sharding import SHARDS

MEMORY_TIE = 1e-15          # seconds per byte held: among equally fast options, the smaller
BACKWARD = 2                # the backward's work, in forwards


@dataclasses.dataclass(frozen=True)
class Option:
    inputs: tuple[Placement, ...]             # per tensor argument (op_strategies.tensor_arguments)
    outputs: tuple[Placement | None, ...]     # per output, a partial already reduced
    split: bool                               # does 1/t of the op's work
    seconds: float                            # the op's own: compute, its partial's reduction, dp gradients
    reduced_to: Placement | None = None       # where a partial output is reduced to a split (not dynshard's default)


@dataclasses.dataclass(frozen=True)
class OpPlacements:
    """The ILP's choice: each node's option, and what the step is predicted to take under its costs."""
    options: dict[str, Option]              # node name -> its option
    values: dict[str, Placement]            # value node name (getitems included) -> its placement
    reads: dict[tuple[str, str], Placement]  # (value, reader) -> the placement the reader needs, where it differs
    solution: Solution
    nodes: int
    edges: int
    held: float                             # bytes a rank holds at the peak, as the ILP counts them


def placement_problem(graph: fx.Graph, inputs, ops, tp: int, mesh, profile: DeviceProfile, nmicros: int, dp: int,
                      fixed: dict[str, Placement], blocks: dict[str, list[str]] | None = None,
                      wait: float = 0.0) -> "PlacementProblem":
    """The ILP (solved by :meth:`PlacementProblem.solve`, with a memory budget or without) for the per-op
    placements of ``graph`` (its placeholders are ``inputs``, its ops' costs ``ops`` from
    ``graph_costs.op_costs``) on a unit of ``tp`` ranks over ``mesh`` that the ILP predicts fastest;
    ``fixed``: placeholder names whose placement is given; ``blocks``: the instances of a repeated module
    (path -> node names, ``graph_costs.repeated_blocks``), tied: each instance takes the first one's options,
    its parameters too (one variable per node of one instance, its costs counted once per instance; the edge
    from one instance's output to the next one's input is an edge of the first instance to itself); ``wait``:
    seconds each forward collective waits for the slowest rank of the unit."""
    return PlacementProblem(graph, inputs, {op.name: op for op in ops}, tp, mesh, profile, nmicros, dp, fixed,
                            _tied(graph, blocks or {}, fixed), wait)


class PlacementProblem:
    """The nodes, their options and the costs of the per-op placement ILP."""

    def __init__(self, graph, inputs, ops, tp, mesh, profile, nmicros, dp, fixed, tied, wait=0.0):
        self.graph, self.ops, self.tp, self.mesh, self.profile = graph, ops, tp, mesh, profile
        self.nmicros, self.dp, self.wait = nmicros, dp, wait
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.input_of = dict(zip(placeholders, inputs))
        self.needs_grad = _needs_grad(graph, self.input_of)
        self.pairs = loss_pairs(graph)
        self.tied = tied                # a node -> the node of the first instance whose options it takes
        self.options: dict[fx.Node, list[Option]] = {}
        self.memo: dict = {}
        self.moves: dict = {}
        for node in graph.nodes:
            if node in tied:
                continue
            if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
                self.options[node] = self.placeholder_options(node, fixed.get(node.name))
            elif node.op == "call_function" and node.target is not operator.getitem:
                if isinstance(node.meta.get("val"), (torch.Tensor, list, tuple)):
                    self.options[node] = self.op_options(node)

    # -- options ----------------------------------------------------------------------------------------
    def placements(self, value: torch.Tensor) -> list[Placement]:
        return [Replicate()] + [Shard(d) for d in range(value.dim()) if value.shape[d] % self.tp == 0
                                and value.shape[d] >= self.tp]

    def placeholder_options(self, node: fx.Node, given: Placement | None) -> list[Option]:
        value, inp = node.meta["val"], self.input_of[node]
        trainable = inp.is_state and inp.requires_grad
        options = []
        for placement in ([given] if given is not None else self.placements(value) + _blocked(node, self.tp)):
            held = _local_bytes(value, placement, self.tp)
            seconds = MEMORY_TIE * held * (4 if trainable else 1)
            if trainable and self.dp > 1:
                seconds += held * self.profile.collective_seconds("all_reduce", BUCKET_BYTES, self.dp) / BUCKET_BYTES
            options.append(Option((), (placement,), False, seconds))
        return options

    def source(self, arg: fx.Node) -> tuple[fx.Node, int]:
        """The node whose option places ``arg``, and which of its outputs ``arg`` is."""
        if arg.op == "call_function" and arg.target is operator.getitem:
            return arg.args[0], arg.args[1]
        return arg, 0

    def options_of(self, node: fx.Node) -> list[Option]:
        return self.options.get(self.tied.get(node, node), [])

    def made_as(self, arg: fx.Node) -> list[Placement]:
        node, index = self.source(arg)
        found = []
        for option in self.options_of(node):
            placement = option.outputs[index] if index < len(option.outputs) else None
            if placement is not None and placement not in found:
                found.append(placement)
        return found or [Replicate()]

    def op_options(self, node: fx.Node) -> list[Option]:
        arguments = tensor_arguments(node)
        if node.target is param_block:
            return _block_options(node, self.made_as(arguments[0]))
        if not arguments:
            return [Option((), _whole_outputs(node), False, self.compute(node, False))]
        arriving = {a: self.made_as(a) for a in arguments}
        key = (node.target, _structure(node.args), _structure(node.kwargs),
               tuple(tuple(map(str, arriving[a])) for a in arguments))
        if key not in self.memo:        # (a repeated layer's ops ask the same questions)
            self.memo[key] = op_strategies(node, self.mesh, arriving)
        strategies = self.memo[key] or [OpStrategyChoice((Replicate(),) * len(arguments), _whole_outputs(node))]
        options = []
        for strategy in strategies:
            options.extend(self.expanded(node, arguments, strategy))
        if node in self.pairs or node in self.pairs.values():
            options.append(self.vocabulary_parallel(node, arguments))
        if not options:     # (every strategy reads a partial input: run it whole)
            options.append(self.expanded(node, arguments, OpStrategyChoice(
                (Replicate(),) * len(arguments), _whole_outputs(node)))[0])
        return options

    def expanded(self, node: fx.Node, arguments, strategy: OpStrategyChoice) -> list[Option]:
        """The options of one strategy: a partial output reduced to whole or to each split."""
        for arg, placement in zip(arguments, strategy.inputs):
            if isinstance(placement, Partial) and self.needs_grad.get(arg, False):
                return []
        split = any(not isinstance(p, Replicate) for p in (*strategy.inputs, *strategy.outputs) if p is not None)
        compute = self.compute(node, split)
        rest = []       # a later partial output (nll_loss's total weight over batch shards) is made whole
        for placement, value in zip(strategy.outputs[1:], _output_values(node)[1:]):
            if isinstance(placement, Partial):
                compute += self.micro(self.collective("all_reduce", _local_bytes(value, Replicate(), 1), forward=True))
            rest.append(Replicate() if isinstance(placement, Partial) else placement)
        first = strategy.outputs[0] if strategy.outputs else None
        if not isinstance(first, Partial):
            return [Option(strategy.inputs, (*strategy.outputs[:1], *rest), split, compute)]
        value = _first_value(node)
        whole = _local_bytes(value, Replicate(), 1)
        grad = self.needs_grad.get(node, False)
        options = [Option(strategy.inputs, (Replicate(), *rest), split,
                          compute + self.micro(self.collective("all_reduce", whole, forward=True)))]
        if type(first) is Partial:      # (a masked partial, the split table's, is only ever made whole)
            for target in self.placements(value)[1:]:
                back = self.collective("all_gather", whole) if grad else 0.0
                reduced = self.collective("reduce_scatter", whole, forward=True)
                options.append(Option(strategy.inputs, (target, *rest), split,
                                      compute + self.micro(reduced + back), reduced_to=target))
        return options

    def vocabulary_parallel(self, node: fx.Node, arguments) -> Option:
        """dynshard's cross-entropy over logits split on their classes (``passes/vocab_parallel_loss``)."""
        softmax = self.pairs.get(node, node)
        logits = softmax.args[0].meta["val"]
        classes = Shard(1 if logits.dim() >= 2 else 0)
        if node is softmax:
            return Option((classes,), (classes,), True, self.compute(node, True))
        rows = logits.numel() // logits.shape[classes.dim] * logits.element_size()
        inputs = (classes,) + (Replicate(),) * (len(arguments) - 1)
        return Option(inputs, _whole_outputs(node), True,
                      self.compute(node, True) + self.micro(3 * self.collective("all_reduce", rows, forward=True)))

    # -- costs ----------------------------------------------------------------------------------------
    def micro(self, seconds: float) -> float:
        return self.nmicros * seconds

    def compute(self, node: fx.Node, split: bool) -> float:
        op = self.ops.get(node.name)
        if op is None:
            return 0.0
        # (memory-bound ops by the bytes they touch op by op, views too, not by what they move once fused, as the
        # cost model prices a unit: a view's placement decides where the ops around it run, and priced at what
        # it moves, nothing, its placements tie; the plans the ILP then chose included ones the runtime cannot
        # run, docs/design.md "Cost model")
        seconds = self.profile.flop_seconds(op.flops, op.rate) if op.flops else op.touched / self.profile.bytes_per_s
        return self.micro((1 + BACKWARD) * seconds / (self.tp if split else 1))

    def collective(self, kind: str | None, whole_bytes: float, forward: bool = False) -> float:
        """A collective over the unit, and (``forward``) its wait for the slowest rank."""
        if kind is None:
            return 0.0
        return self.profile.collective_seconds(kind, whole_bytes, self.tp) + (self.wait if forward else 0.0)

    def read_seconds(self, arg: fx.Node, made: Placement, read: tuple[Placement, bool]) -> float | None:
        """What reading ``arg`` made as ``made`` costs a reader's option (``read``: the placement it reads, and
        whether it splits its work), forward and backward."""
        if arg.op == "placeholder" and read[0] != made and not isinstance(read[0], Partial):
            return None     # (a plan places a parameter or input where it is held, for every reader)
        parameter = arg.op == "placeholder" and self.input_of[arg].is_state
        return self.redistribution(arg.meta["val"], made, read[0], read[1], self.needs_grad.get(arg, False), parameter)

    def redistribution(self, value: torch.Tensor, made: Placement, read: Placement, split: bool, grad: bool,
                       parameter: bool) -> float | None:
        """Seconds a step to read ``value`` made as ``made`` as ``read`` by an option that splits its work or not,
        and to send its gradient back (None: not possible). A parameter's gradient is reduced in buckets, as
        the gradients of the data-parallel units are: bandwidth, no latency of its own."""
        key = (tuple(value.shape), value.dtype, made, read, split, grad, parameter)
        if key not in self.moves:
            self.moves[key] = self._redistribution(value, made, read, split, grad, parameter)
        return self.moves[key]

    def _redistribution(self, value, made, read, split, grad, parameter) -> float | None:
        if isinstance(read, Partial):
            return 0.0 if isinstance(made, Replicate) and not grad else None
        if isinstance(made, SHARDS) and isinstance(read, SHARDS) and made != read:
            return None     # (an all-to-all: not yet planned, see the module's docstring)
        if isinstance(made, StridedShard) and made != read:
            return None     # (gathering a strided shard asks the planning mesh's fake group for a coordinate)
        seconds = self.collective(transition_kind(made, read), _moved_bytes(value, made, read, self.tp), forward=True)
        if grad:
            arrives = Partial() if isinstance(read, Replicate) and split else read
            kind, moved = transition_kind(arrives, made), _moved_bytes(value, arrives, made, self.tp)
            if parameter and kind is not None:
                seconds += moved * self.collective(kind, BUCKET_BYTES) / BUCKET_BYTES
            else:
                seconds += self.collective(kind, moved)
        return self.micro(seconds)

    # -- the ILP --------------------------------------------------------------------------------------
    def edges(self):
        """(value node, reader node or None for a graph output, argument index) for every read."""
        for node in self.graph.nodes:
            if node.op == "call_function" and self.options_of(node):
                for index, arg in enumerate(tensor_arguments(node)):
                    yield arg, node, index
            elif node.op == "output":
                for arg in tensor_arguments(node):
                    yield arg, None, 0

    def grouped_edges(self) -> dict[tuple, tuple[int, fx.Node]]:
        """(value's producer, its output, reader or None, argument) with tied nodes read as the first instance's
        -> (how many reads it stands for, one of them)."""
        edges = {}
        for arg, reader, index in self.edges():
            producer, out = self.source(arg)
            if self.options_of(producer):
                key = (self.tied.get(producer, producer), out, self.tied.get(reader, reader), index)
                count, _ = edges.get(key, (0, arg))
                edges[key] = (count + 1, arg)
        return edges

    def copies(self) -> dict[fx.Node, int]:
        """How many nodes take each node's option (itself and the nodes tied to it)."""
        copies = {node: 1 for node in self.options}
        for node in self.tied.values():
            if node in copies:
                copies[node] += 1
        return copies

    def held(self, node: fx.Node, option: Option) -> float:
        """What a rank holds at the peak for this node: a trainable parameter's shard with its gradient and
        Adam's two moments (4x), another placeholder's shard, the bytes autograd saves of an op's output
        (split when the option's first output is)."""
        if node.op == "placeholder":
            inp = self.input_of[node]
            held = _local_bytes(node.meta["val"], option.outputs[0], self.tp)
            return held * (4 if inp.is_state and inp.requires_grad else 1)
        op = self.ops.get(node.name)
        saved = op.saved_bytes if op is not None else 0
        return saved / self.tp if isinstance(option.outputs[0] if option.outputs else None, SHARDS) else saved

    def objective(self, chosen: dict[fx.Node, Option]) -> float | None:
        """The ILP's objective for an option of each node (of ``self.options``; None: a read it cannot make)."""
        copies, total = self.copies(), 0.0
        for node, option in chosen.items():
            total += copies[node] * option.seconds
        for (producer, out, reader, index), (count, arg) in self.grouped_edges().items():
            made = chosen[producer].outputs[out] if out < len(chosen[producer].outputs) else Replicate()
            read = (Replicate(), False) if reader is None else (chosen[reader].inputs[index], chosen[reader].split)
            seconds = self.read_seconds(arg, made, read)
            if seconds is None:
                return None
            total += count * seconds
        return total

    def solve(self, time_limit: float, budget: float | None = None) -> OpPlacements:
        from scipy.sparse import csr_matrix

        nodes = list(self.options)
        copies = self.copies()
        offset, cost = {}, []
        for node in nodes:
            offset[node] = len(cost)
            cost.extend(copies[node] * option.seconds for option in self.options[node])
        binaries = len(cost)
        rows = _Rows()
        for node in nodes:
            rows.add({offset[node] + k: 1.0 for k in range(len(self.options[node]))}, 1.0)
        edges = self.grouped_edges()
        for (producer, out, reader, index), (count, arg) in edges.items():
            made = defaultdict(list)
            for k, option in enumerate(self.options[producer]):
                made[option.outputs[out] if out < len(option.outputs) else Replicate()].append(offset[producer] + k)
            read = defaultdict(list)
            if reader is None:          # a graph output: read whole, whatever it is made as
                read[Replicate(), False] = []
            for k, option in enumerate(self.options[reader]) if reader is not None else ():
                read[option.inputs[index], option.split].append(offset[reader] + k)
            by_made, by_read = defaultdict(dict), defaultdict(dict)
            for p in made:
                for q in read:
                    seconds = self.read_seconds(arg, p, q)
                    if seconds is not None:
                        by_made[p][len(cost)] = by_read[q][len(cost)] = 1.0
                        cost.append(count * seconds)
            for p, members in made.items():
                rows.add({**by_made[p], **{m: -1.0 for m in members}}, 0.0)
            for q, members in read.items() if reader is not None else ():
                rows.add({**by_read[q], **{m: -1.0 for m in members}}, 0.0)
        integer = np.array([1] * binaries + [0] * (len(cost) - binaries))
        equal = csr_matrix((rows.values, (rows.rows, rows.cols)), shape=(len(rows.rhs), len(cost)))
        memory = np.zeros((0, len(cost)))
        if budget is not None:
            memory = np.zeros((1, len(cost)))
            for node in nodes:
                for k, option in enumerate(self.options[node]):
                    memory[0, offset[node] + k] = copies[node] * self.held(node, option)
        solution = solve(NANOSECONDS * np.array(cost), memory, np.full(len(memory), budget or 0.0), integer,
                         time_limit, equal=(equal, np.array(rows.rhs)))
        if solution.x != () and solution.objective is not None:     # (in seconds)
            solution = dataclasses.replace(solution, objective=solution.objective / NANOSECONDS,
                                           bound=(solution.bound or 0.0) / NANOSECONDS)
        if solution.x == ():
            raise ValueError(f"dynshard: the per-op placement ILP found no solution ({solution.status}"
                             f"{'' if budget is None else f', a rank holding at most {budget:.4g} bytes'})")
        x = np.array(solution.x)
        chosen = {n: self.options[n][int(np.argmax(x[offset[n]:offset[n] + len(self.options[n])]))] for n in nodes}
        held = sum(copies[n] * self.held(n, chosen[n]) for n in nodes)
        chosen.update({node: chosen[first] for node, first in self.tied.items() if first in chosen})
        return self.result(chosen, solution, len(edges), held)

    def result(self, chosen: dict[fx.Node, Option], solution: Solution, edges: int, held: float) -> OpPlacements:
        values, reads = {}, {}
        for node in self.graph.nodes:
            producer, out = self.source(node) if node.op == "call_function" else (node, 0)
            if producer in chosen and out < len(chosen[producer].outputs) and chosen[producer].outputs[out] is not None:
                values[node.name] = chosen[producer].outputs[out]
        for node, option in chosen.items():
            if node.op != "call_function":
                continue
            for arg, placement in zip(tensor_arguments(node), option.inputs):
                if arg.name in values and placement != values[arg.name] and not isinstance(placement, Partial):
                    reads[arg.name, node.name] = placement
        return OpPlacements({n.name: o for n, o in chosen.items()}, values, reads, solution, len(chosen), edges, held)


def per_op_problem(graph: fx.Graph, inputs, ops, blocks: dict[str, list[str]], tp: Plan, unit: UnitCosts, layout,
                   profile: DeviceProfile, nmicros: int, pins) -> PlacementProblem:
    """The ILP for ``graph`` on the unit ``tp`` (the tp policy's plan of it, ``unit`` its costs) was made for:
    user inputs, tensors an earlier program placed and pinned ones keep ``tp``'s placement.

    Each forward collective waits for the slowest rank: the cost model's wait, ``skew * sqrt(calls * 3 *
    forward)`` a micro-batch, is not linear in the calls, so the ILP charges each call its derivative at tp's
    plan's calls."""
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    fixed = {name: decode_placement(tp.tensors[inp.name].tp) for name, inp in zip(placeholders, inputs)
             if not inp.is_state or inp.tag is not None or inp.is_split_value or pin_of(inp.name, pins) is not None}
    calls, forward = tp_calls(tp, unit), forward_seconds(unit, profile)
    wait = profile.skew * math.sqrt(3 * forward / calls) / 2 if calls else 0.0
    return placement_problem(graph, inputs, ops, layout.tp_size, layout.tp_mesh, profile, nmicros,
                             layout.world_size // layout.plan_ngpus, fixed, blocks, wait)


def per_op_plan(graph: fx.Graph, inputs, ops, blocks: dict[str, list[str]], tp: Plan, unit: UnitCosts,
                keys: dict[str, str], layout, profile: DeviceProfile, nmicros: int, pins, budget: float | None = None
                ) -> tuple[Plan, OpPlacements, list[str]]:
    """:func:`per_op_problem` solved (``budget``: bytes a rank may hold, as :meth:`PlacementProblem.held`
    counts them) as a plan of ``tp``'s unit (node ``keys`` by name), and what the plan cannot say."""
    placed = per_op_problem(graph, inputs, ops, blocks, tp, unit, layout, profile, nmicros, pins).solve(30.0, budget)
    plan, unsaid = as_plan(tp, placed, graph, inputs, keys)
    return plan, placed, unsaid


def as_plan(base: Plan, placed: OpPlacements, graph: fx.Graph, inputs, keys: dict[str, str]) -> tuple[Plan, list[str]]:
    """``base`` (a plan of the same graph and unit) with ``placed``'s placements: its tensors', and each value
    redistributed where it is made (a partial reduced to a split) or for the readers whose option reads it
    otherwise; and what the plan cannot say (a value two readers need in two other placements)."""
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    tensors = dict(base.tensors)
    for name, inp in zip(placeholders, inputs):
        if name in placed.values:
            tensors[inp.name] = dataclasses.replace(tensors[inp.name], tp=encode_placement(placed.values[name]))
    activations, unsaid = {}, []
    for name, option in placed.options.items():
        if option.reduced_to is not None:
            activations[name] = ActivationChoice(encode_placement(option.reduced_to))
    wanted = defaultdict(lambda: defaultdict(list))
    for (value, reader), placement in placed.reads.items():
        wanted[value][placement].append(reader)
    for value, by_placement in wanted.items():
        if value in activations or len(by_placement) > 1:
            unsaid.append(f"{value} read as {', '.join(sorted(map(str, by_placement)))}")
            continue
        (placement, readers), = by_placement.items()
        activations[value] = ActivationChoice(encode_placement(placement), tuple(keys[r] for r in sorted(readers)))
    order = {name: i for i, name in enumerate(n.name for n in graph.nodes)}
    activations = {keys[name]: choice for name, choice in sorted(activations.items(), key=lambda item: order[item[0]])}
    return dataclasses.replace(base, tensors=tensors, activations=activations, predicted=EMPTY), unsaid


def _tied(graph: fx.Graph, blocks: dict[str, list[str]], fixed: dict[str, Placement]) -> dict[fx.Node, fx.Node]:
    """Each node of a later instance of the repeated module -> the same node of the first instance, and each
    parameter read only there -> the first instance's (an instance whose ops do not line up with the
    first's, same targets and shapes, stays untied)."""
    by_name = {n.name: n for n in graph.nodes}
    instances = [[by_name[name] for name in names] for names in blocks.values()]
    tied = {}
    for instance in instances[1:]:
        first = instances[0]
        if len(instance) != len(first) or any(
                a.target != b.target or _shapes(a) != _shapes(b) for a, b in zip(instance, first)):
            continue
        inside = set(instance)
        pairs = dict(zip(instance, first))
        for node, same in pairs.items():
            tied[node] = same
            for arg, other in zip(node.all_input_nodes, same.all_input_nodes):
                if (arg.op == "placeholder" and other.op == "placeholder" and arg is not other
                        and all(user in inside for user in arg.users) and _shapes(arg) == _shapes(other)
                        and fixed.get(arg.name) == fixed.get(other.name)):
                    tied[arg] = other
    return tied


def _shapes(node: fx.Node):
    return tuple((tuple(v.shape), v.dtype) for v in (node.meta.get("val"),) if isinstance(v, torch.Tensor))


class _Rows:
    """Equality rows of a sparse matrix, a row at a time."""

    def __init__(self):
        self.rows, self.cols, self.values, self.rhs = [], [], [], []

    def add(self, coefficients: dict[int, float], rhs: float) -> None:
        self.rows.extend([len(self.rhs)] * len(coefficients))
        self.cols.extend(coefficients)
        self.values.extend(coefficients.values())
        self.rhs.append(rhs)


def _needs_grad(graph: fx.Graph, input_of) -> dict[fx.Node, bool]:
    needs = {}
    for node in graph.nodes:
        value = node.meta.get("val")
        floating = isinstance(value, torch.Tensor) and value.is_floating_point()
        if node.op == "placeholder":
            needs[node] = floating and bool(getattr(input_of.get(node), "requires_grad", False))
        elif node.op == "call_function":
            needs[node] = floating and any(needs.get(a, False) for a in node.all_input_nodes)
    return needs


def _structure(value) -> str:
    """Arguments with each node replaced by what a strategy depends on (shape, stride, dtype)."""
    def of(v):
        if isinstance(v, fx.Node):
            val = v.meta.get("val")
            return ("tensor", tuple(val.shape), val.stride(), val.dtype) if isinstance(val, torch.Tensor) else val
        return v
    return repr(fx.node.map_aggregate(value, of))


def _first_value(node: fx.Node) -> torch.Tensor:
    value = node.meta["val"]
    return value if isinstance(value, torch.Tensor) else next(v for v in value if isinstance(v, torch.Tensor))


def _output_values(node: fx.Node) -> tuple:
    value = node.meta.get("val")
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _whole_outputs(node: fx.Node) -> tuple[Placement | None, ...]:
    value = node.meta.get("val")
    values = value if isinstance(value, (list, tuple)) else (value,)
    return tuple(Replicate() if isinstance(v, torch.Tensor) else None for v in values)


def _blocked(node: fx.Node, tp: int) -> list[Placement]:
    """A fused projection's weight or bias, read only as blocks (``passes/split_fused_projections``): this rank's
    rows of every block (``_StridedShard(dim, blocks)``), as the tp policy holds it, when each block splits."""
    readers = {(u.args[2], u.args[3]) if u.target is param_block else None for u in node.users}
    if len(readers) != 1 or None in readers:
        return []
    (count, dim), = readers
    size = node.meta["val"].shape[dim] // count
    return [StridedShard(dim, split_factor=count)] if size % tp == 0 and size >= tp else []


def _block_options(node: fx.Node, held: list[Placement]) -> list[Option]:
    """A block of a fused parameter: of a whole one, whole; of its strided shard, this rank's rows of the block,
    no communication (``param_block``)."""
    strided = StridedShard(node.args[3], split_factor=node.args[2])
    options = [Option((Replicate(),), (Replicate(),), False, 0.0)]
    if strided in held:
        options.append(Option((strided,), (Shard(node.args[3]),), False, 0.0))
    return options


def _local_bytes(value: torch.Tensor, placement: Placement, tp: int) -> int:
    whole = value.numel() * value.element_size()
    return whole // tp if isinstance(placement, SHARDS) else whole


def _moved_bytes(value: torch.Tensor, src: Placement, dst: Placement, tp: int) -> int:
    """The collective's bytes as sharding propagation counts them: the larger of the two local sizes."""
    return max(_local_bytes(value, src, tp), _local_bytes(value, dst, tp))


"""Cut the captured graph into pipeline stages (``policy="pp"``).

Where the cuts go, in order of precedence:

1. ``torch.distributed.pipelining.pipe_split()`` calls in the user's code (Dynamo keeps them as
   ``pippy._pipe_split`` nodes): exactly ``nstages - 1`` of them, else an error;
2. before instances of the ``pipeline_pivots`` module classes;
3. before instances of the model's repeated layer (the module class with the most instances held in a
   ``ModuleList``/``Sequential``: a transformer's blocks), else between any two ops;

choosing among the candidates of 2 and 3 the cut whose heaviest stage has the fewest forward FLOPs, and
among those the closest to equal parts (exact: :mod:`dynshard.planning.stage_cuts`; FLOPs measured with
``FlopCounterMode`` on FakeTensors; ops without FLOPs count one each when the graph has no matmul).

The result is one GraphModule per stage. A stage's placeholders are the captured graph's inputs it
reads (parameters, buffers, the user's batch: every rank of a unit holds them) followed by the values
it receives from earlier stages; it returns the values later stages (or the graph's outputs) need.
Boundary ``s`` carries every value produced at a stage <= s and read at a stage > s, so a skip
connection over several stages is relayed through the stages in between and every transfer is
between neighbours. A parameter read by two stages (a tied embedding and LM head) is an input of both.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator
import re
from collections import Counter
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

from .. import compat
from ..planning import PlanFileError
from ..planning.node_keys import find_position, module_paths, node_keys
from ..planning.stage_cuts import balanced_cuts
from .context import PassContext
from .stages import Stage, StageCut, StagedGraph

_PIPE_SPLIT = "pippy._pipe_split"
_LIST_CHILD = re.compile(r"\.\d+$|\[\d+\]$")


def _is_pipe_split(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target) == _PIPE_SPLIT


def _compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


_MEASURED: dict[tuple, tuple[int, ...]] = {}     # (graph code, input shapes) -> FLOPs per node, in graph order
_MEASURED_KEPT = 8


def _node_flops(gm: fx.GraphModule, ctx: PassContext) -> dict[fx.Node, int]:
    """Each node's forward FLOPs, measured once per graph and input shapes (a search cuts the same graph into
    several pipelines: their cuts read the same measurement)."""
    key = (tuple((n.op, n.name, n.target, repr(n.args), repr(n.kwargs)) for n in gm.graph.nodes),
           tuple((tuple(i.shape), i.dtype) for i in ctx.inputs))     # (not gm.code: generating it costs more)
    if key not in _MEASURED:
        if len(_MEASURED) >= _MEASURED_KEPT:
            _MEASURED.pop(next(iter(_MEASURED)))
        measured = _measure_flops(gm, ctx)
        _MEASURED[key] = tuple(measured[node] for node in gm.graph.nodes)
    return dict(zip(gm.graph.nodes, _MEASURED[key]))


def _measure_flops(gm: fx.GraphModule, ctx: PassContext) -> dict[fx.Node, int]:
    """Each node's forward FLOPs: the nodes of a repeated layer run the same calls on the same shapes, so a
    node whose call (target, argument shapes, layouts and values) was measured takes that count, and each
    distinct call runs once, alone, on the values Dynamo recorded for its arguments (``example_value``);
    the graph runs whole when a node has none or a call mutates its arguments."""
    signatures = {node: _signature(node) for node in gm.graph.nodes}
    if any(s is False for s in signatures.values()):
        return _measure_every_node(gm, ctx)
    counter = FlopCounterMode(display=False)
    measured: dict[Any, int] = {}

    def fresh(arg: fx.Node):        # (a value of this fake mode like the one Dynamo recorded, at its hints)
        value = arg.meta["example_value"]
        if isinstance(value, torch.SymInt):
            return compat.size_hint(value)
        if not isinstance(value, torch.Tensor):
            return value
        device = ctx.layout.device_type if value.device.type == "meta" else value.device
        return torch.empty_strided([compat.size_hint(d) for d in value.shape],
                                   [compat.size_hint(d) for d in value.stride()], dtype=value.dtype, device=device)

    with ctx.fake_mode, counter, torch.no_grad():
        for node, signature in signatures.items():
            if signature is not None and signature not in measured:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), fresh)
                before = counter.get_total_flops()
                if node.op == "call_function":
                    node.target(*args, **kwargs)
                else:
                    getattr(args[0], node.target)(*args[1:], **kwargs)
                measured[signature] = counter.get_total_flops() - before
    return {node: 0 if signature is None else measured[signature] for node, signature in signatures.items()}


def _signature(node: fx.Node):
    """What a node's FLOPs depend on (None: it has none; False: it cannot be measured alone)."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return None
    if node.op == "call_module" or _mutates(node):      # (a module's state, or an in-place call)
        return False

    def described(arg):
        value = arg.meta.get("example_value", _MISSING)
        if value is _MISSING:
            raise LookupError
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.requires_grad)
        return repr(value)

    try:
        return node.op, node.target, repr(fx.node.map_arg((node.args, node.kwargs), described))
    except LookupError:
        return False


def _mutates(node: fx.Node) -> bool:
    if node.kwargs.get("inplace") or node.target in _OPERATOR_IN_PLACE:
        return True
    if getattr(node.target, "__module__", None) == "_operator":     # (operator.and_ is not in place)
        return False
    name = getattr(node.target, "__name__", str(node.target))
    return name.endswith("_") and not name.endswith("__")


_OPERATOR_IN_PLACE = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift}
_MISSING = object()


def _measure_every_node(gm: fx.GraphModule, ctx: PassContext) -> dict[fx.Node, int]:
    flops: dict[fx.Node, int] = {node: 0 for node in gm.graph.nodes}

    counter = FlopCounterMode(display=False)      # (one counter, read before and after each node)

    class Counting(fx.Interpreter):
        def run_node(self, node):
            before = counter.get_total_flops()
            value = super().run_node(node)
            flops[node] = counter.get_total_flops() - before
            return value

    with ctx.fake_mode, torch.no_grad():
        args = [torch.empty(i.shape, dtype=i.dtype, device=ctx.layout.device_type if i.device.type == "meta"
                            else i.device) for i in ctx.inputs]
        with counter:
            Counting(gm).run(*args)
    return flops


def _instance_starts(nodes: list[fx.Node], wanted) -> tuple[list[int], str | None]:
    """Positions (in ``nodes``) of the first op of each instance of a module class ``wanted(cls)`` accepts."""
    starts, seen, names = [], set(), set()
    for position, node in enumerate(nodes):
        for path, cls in node.meta.get("nn_module_stack", {}).values():
            if wanted(path, cls):
                if path not in seen:
                    seen.add(path)
                    starts.append(position)
                    names.add(cls.__name__)
                break
    return starts, ", ".join(sorted(names)) or None


def _repeated_layer(nodes: list[fx.Node]):
    """The module class with the most instances held in a ModuleList or Sequential (a model's layers)."""
    instances: Counter = Counter()
    seen = set()
    for node in nodes:
        for path, cls in node.meta.get("nn_module_stack", {}).values():
            if _LIST_CHILD.search(path) and path not in seen:
                seen.add(path)
                instances[cls] += 1
    if not instances:
        return None
    return instances.most_common(1)[0][0]


def assign_stages(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Give every op a stage (``node.meta["pipeline_stage"]``) and drop the ``pipe_split`` markers.

    The cut is the pipeline's plan (``ctx.stage_info``: the positions among the compute nodes where stages
    start, how they were found, each stage's FLOPs). A cut installed before this pass (rank 0's, or one
    read from ``cache_dir``) is used as it is: nothing is measured.
    """
    nodes = _compute_nodes(gm)
    keys = node_keys(gm.graph)
    given = ctx.given.pipeline if ctx.given is not None else None
    if ctx.stage_info is None:
        ctx.stage_info = _cuts_of(given, nodes, keys, gm, ctx) if given is not None else _choose_cuts(gm, nodes, ctx)
    cuts = ctx.stage_info.cuts
    nstages = ctx.outline.pipeline.nsegments
    if len(cuts) != nstages - 1 or cuts != sorted(cuts) or not all(0 < c < len(nodes) for c in cuts) \
            or len(set(cuts)) != len(cuts):
        raise PlanFileError(f"dynshard: the plan's pipeline stages start at {ctx.stage_info.starts}, which "
                            f"does not cut this graph ({len(nodes)} ops) into {nstages} stages in graph order")
    ctx.stage_info.starts = [_start_name(nodes, cut, keys) for cut in cuts]
    ctx.stage_info.input_stages = _input_stages(gm, cuts)
    stage = 0
    for position, node in enumerate(nodes):
        while stage < len(cuts) and position >= cuts[stage]:
            stage += 1
        node.meta["pipeline_stage"] = stage
    for node in [n for n in nodes if _is_pipe_split(n)]:
        gm.graph.erase_node(node)
    gm.recompile()
    return gm


def _cuts_of(given, nodes: list[fx.Node], keys: dict, gm: fx.GraphModule, ctx: PassContext) -> dict[str, Any]:
    """A plan's stage starts (node keys or module paths) as positions; FLOPs measured again when edited."""
    cuts = []
    for start in given.starts:
        position = find_position(nodes, start, keys)
        if position is None:
            raise PlanFileError(f"dynshard: the plan starts a pipeline stage at {start!r}, which this graph does not "
                                "run (a module path such as 'layers.4', or a node key '<module path>:<op>:<n>')")
        cuts.append(position)
    flops = list(given.flops)
    if len(flops) != len(cuts) + 1 or [_start_name(nodes, c, keys) for c in cuts] != list(given.starts):
        node_flops = _node_flops(gm, ctx)
        bounds = [0, *cuts, len(nodes)]
        flops = [sum(node_flops.get(n, 0) for n in nodes[a:b]) for a, b in zip(bounds, bounds[1:])]
    return StageCut(cuts, given.how or "as the plan says", flops, list(given.starts))


def _input_stages(gm: fx.GraphModule, cuts: list[int]) -> list[list[int]]:
    """Per graph input, the stages that read it (the last stage returns what the graph outputs)."""
    return [sorted({bisect.bisect_right(cuts, p) for p in positions}) for positions in input_read_positions(gm)]


def _start_name(nodes: list[fx.Node], cut: int, keys: dict) -> str:
    """The module whose instance the stage starts with (``layers.4``), else the first op's node key."""
    previous = set(module_paths(nodes[cut - 1])) if cut > 0 else set()
    for path in module_paths(nodes[cut]):
        if path and path not in previous and find_position(nodes, path, keys) == cut:
            return path
    return keys[nodes[cut]]


@dataclasses.dataclass(frozen=True)
class CutSpace:
    """Where the pp policy may start a stage in a graph (positions among its ops), each op's weight (forward
    FLOPs, or one each when the graph has no matmul), and how the positions were found."""
    weights: list[int]
    candidates: list[int]
    how: str
    markers: bool                   # the user's pipe_split() calls: the cut is theirs


def cut_space(gm: fx.GraphModule, ctx: PassContext, nodes: list[fx.Node] | None = None) -> CutSpace:
    """At pipe_split() markers, else before pivots, else before the repeated layers, else any op."""
    nodes = _compute_nodes(gm) if nodes is None else nodes
    options = ctx.config.pipeline      # (pivots: the pp policy's option)
    nstages, all_device_first = ctx.outline.pipeline.nsegments, ctx.outline.pipeline.all_device_first
    markers = [i for i, n in enumerate(nodes) if _is_pipe_split(n)]
    flops = _node_flops(gm, ctx)
    weights = [flops.get(n, 0) for n in nodes]
    if not any(weights):
        weights = [1] * len(nodes)
    if markers:
        if len(markers) != nstages - 1:
            extra = " (1f1b_plus: one more, ending the all-device segment)" if all_device_first else ""
            raise ValueError(f"dynshard: the model calls pipe_split() {len(markers)} time(s), which cuts it into "
                             f"{len(markers) + 1} segments, but {nstages} are needed{extra}; call it "
                             f"{nstages - 1} time(s) or set pipeline_nstages={len(markers) + 1 - int(all_device_first)}")
        return CutSpace(weights, markers, "at pipe_split()", True)
    if options.pivots:
        candidates, names = _instance_starts(nodes, lambda path, cls: cls.__name__ in options.pivots)
        how = f"before pivots ({names})"
        if names is None:
            raise ValueError(f"dynshard: no module of the classes in pipeline_pivots "
                             f"({options.pipeline_pivots}) runs in the compiled graph")
    else:
        layer = _repeated_layer(nodes)
        candidates, names = _instance_starts(nodes, lambda path, cls: cls is layer) if layer else ([], None)
        how = f"before layers ({names}), balanced by FLOPs" if names else "balanced by FLOPs"
        if len(candidates) < nstages - 1:
            candidates, how = list(range(1, len(nodes))), "balanced by FLOPs"
    candidates = [c for c in candidates if c > 0]
    if len(candidates) < nstages - 1:
        raise ValueError(f"dynshard: only {len(candidates) + 1} stage(s) can be cut {how}, but "
                         f"pipeline_nstages is {nstages}; lower pipeline_nstages or choose other pivots")
    return CutSpace(weights, candidates, how, False)


def _choose_cuts(gm: fx.GraphModule, nodes: list[fx.Node], ctx: PassContext) -> dict[str, Any]:
    """The policy: the cut of :func:`cut_space` whose heaviest stage is lightest (FLOPs measured on
    FakeTensors)."""
    nstages, all_device_first = ctx.outline.pipeline.nsegments, ctx.outline.pipeline.all_device_first
    space = cut_space(gm, ctx, nodes)
    weights, candidates, how = space.weights, space.candidates, space.how
    if space.markers:
        cuts = candidates
    elif all_device_first:    # the all-device segment: what runs before the first layer
        first = candidates[0]
        weights = [0] * first + weights[first:]
        cuts = [first] + balanced_cuts(weights, candidates[1:], nstages - 1)
        how += "; the ops before the first cut run on every rank (1f1b_plus)"
    else:
        cuts = balanced_cuts(weights, candidates, nstages)
    flops = _node_flops(gm, ctx)
    bounds = [0, *cuts, len(nodes)]
    stage_flops = [sum(flops.get(n, 0) for n in nodes[a:b]) for a, b in zip(bounds, bounds[1:])]
    return StageCut(list(cuts), how, stage_flops)


def stage_start_names(gm: fx.GraphModule, cuts: list[int]) -> list[str]:
    """How a plan names stages starting at ``cuts`` (positions among the ops): module paths, else node keys."""
    nodes, keys = _compute_nodes(gm), node_keys(gm.graph)
    return [_start_name(nodes, cut, keys) for cut in cuts]


def input_read_positions(gm: fx.GraphModule) -> list[list[int]]:
    """Per graph input (placeholder order), the positions among the ops that read it (the graph's output
    counts as the last op: the last stage returns it)."""
    nodes = _compute_nodes(gm)
    position = {n: i for i, n in enumerate(nodes)}
    return [sorted({len(nodes) - 1 if user.op == "output" else position[user] for user in placeholder.users
                    if user.op == "output" or user in position})
            for placeholder in gm.graph.nodes if placeholder.op == "placeholder"]


def split_stages(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """One GraphModule per stage (``ctx.staged``); the captured graph itself is returned unchanged."""
    nstages = ctx.outline.pipeline.nsegments
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index_of = {n: i for i, n in enumerate(placeholders)}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    stage_of = {n: n.meta["pipeline_stage"] for n in _compute_nodes(gm)}
    # a value is read at the stages of its users; the graph's outputs are read by the last stage
    last_read: dict[fx.Node, int] = {}
    for node in stage_of:
        for user in node.users:
            reader = nstages - 1 if user is output else stage_of[user]
            if reader < stage_of[node]:
                raise ValueError(f"dynshard: {user.name} (stage {reader}) reads {node.name} of a later stage "
                                 f"{stage_of[node]}; the cut is not in graph order")
            last_read[node] = max(last_read.get(node, -1), reader)
    boundaries = [tuple(n.name for n in stage_of if stage_of[n] <= s < last_read.get(n, -1))
                  for s in range(nstages - 1)]
    by_name = {n.name: n for n in stage_of}
    stages = []
    for s in range(nstages):
        own = [n for n in stage_of if stage_of[n] == s]
        own_set = set(own)
        read_inputs, read_values = [], []
        for node in own:
            for arg in node.all_input_nodes:
                if arg in index_of and arg not in read_inputs:
                    read_inputs.append(arg)
                elif arg not in own_set and arg not in index_of and arg.name not in read_values:
                    read_values.append(arg.name)
        leaving = set(boundaries[s]) if s < nstages - 1 else set()
        if s == nstages - 1:
            for out in _flat_nodes(output.args):
                if out in index_of and out not in read_inputs:
                    read_inputs.append(out)
        produced = [n.name for n in own if n.name in leaving or (s == nstages - 1 and n in _flat_nodes(output.args))]
        read_inputs.sort(key=index_of.get)
        received = [name for name in (boundaries[s - 1] if s else ()) if name in read_values]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in read_inputs:
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
        for name in received:
            env[by_name[name]] = graph.placeholder(name)
            env[by_name[name]].meta = dict(by_name[name].meta)
        for node in own:
            env[node] = graph.node_copy(node, lambda n: env[n])
        graph.output(tuple(env[by_name[name]] for name in produced))
        stages.append(Stage(s, compat.graph_module(gm, graph), tuple(index_of[n] for n in read_inputs), tuple(received),
                            tuple(produced), _modules(own)))
    outputs = [_output_ref(v, index_of) for v in _flat_outputs(output.args[0])]
    ctx.staged = StagedGraph(stages, boundaries, outputs, ctx.stage_info.flops, ctx.stage_info.how)
    return gm


def _modules(nodes: list[fx.Node]) -> tuple[str, ...]:
    """The outermost modules (a ModuleList's items rather than the list) the ops belong to, in order."""
    names: list[str] = []
    for node in nodes:
        stack = list(node.meta.get("nn_module_stack", {}).values())
        if not stack:
            continue
        path = stack[0][0]
        for inner, _ in stack[1:]:
            if not _LIST_CHILD.search(path) and _LIST_CHILD.search(inner):
                path = inner
                break
        name = re.sub(r"^L\['[^']+'\]\.?", "", path) or "(root)"
        if name not in names:
            names.append(name)
    return tuple(names)


def _flat_nodes(args) -> list[fx.Node]:
    nodes: list[fx.Node] = []
    fx.node.map_arg(args, lambda n: nodes.append(n))
    return nodes


def _flat_outputs(value) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _output_ref(value, index_of) -> Any:
    """A graph output: ("value", name), ("input", placeholder index) or ("constant", value)."""
    if isinstance(value, fx.Node):
        return ("input", index_of[value]) if value in index_of else ("value", value.name)
    return ("constant", value)

"""What one rank of a plan unit computes, keeps and sends for one micro-batch of a graph, read from its ATen
graph and, when the unit is split, from the sharding propagation of a candidate plan.

Per op (one node of the forward ATen graph, run once on FakeTensors of the global shapes):
- forward FLOPs by torch's ``flop_counter`` formulas, bytes read and written;
- the bytes autograd saves for the backward from the op's output (saved-tensors hooks; parameters and
  graph inputs excluded: they are held anyway), attributed to the op that produced the tensor.
On a rank of a candidate: an op whose output is split (or partial, or a partial reduced at once) does
1/tp of the work and writes 1/tp of the bytes; a replicated op does all of it (every rank repeats it).

An op's time is its FLOPs at the device's rate when it has any (a matmul, attention: compute bound), else
the bytes it moves at the device's bandwidth (a pointwise op, a copy: memory bound); an op is one or the
other, not the sum (a roofline per op).

Module instances (from ``nn_module_stack``) group the ops for recompute: the repeated module class that
covers the most ops is the recompute choice a search offers.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Shard
from torch.utils.flop_counter import flop_registry

from ..compat import pytree
from .cost_model import InstanceCosts, UnitCosts
from .device_profile import DeviceProfile
from .fused_traffic import aliases_input, fused_traffic
from ..passes.context_parallel_attention import ATTENTION_OPS
from ..passes.tag_recompute import is_rng
from ..planning.node_keys import module_paths

_ROOT_CLASS = ""


@dataclasses.dataclass(frozen=True)
class OpCost:
    name: str
    flops: int               # forward, global
    bytes: int               # moved to and from memory once Inductor fuses the graph, global (fused_traffic)
    out_bytes: int           # written, global
    saved_bytes: int         # of its output, kept for the backward, global
    modules: tuple[str, ...]  # module paths around it, outermost first
    saves: tuple[str, ...] = ()     # the ops whose outputs this op saves for its backward (not graph inputs)
    kernels: int = 0         # launched, once fused (0 for a view or an op fused into another's kernel)
    touched: int = 0         # read and written op by op, views too, global (how the per-op ILP ranks options)
    rate: str = ""           # the class of its FLOPs, the rate they run at (``DeviceProfile.rates``): its dtype
    backward_extra_flops: int = 0   # its backward's FLOPs beyond twice its forward's (a fused attention's)


def op_costs(gm: fx.GraphModule, inputs, fake_mode) -> list[OpCost]:
    """Each op of the ATen graph ``gm`` (placeholders in the order of ``inputs``) with its global costs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    held = {n.name for n in placeholders} | _parameter_copies(gm, inputs)
    producer: dict[int, str] = {}
    saved: dict[str, dict[int, int]] = defaultdict(dict)
    saves: dict[str, set[str]] = defaultdict(set)       # the op saving -> the ops whose outputs it saves
    current: list[str] = [""]
    views: set[str] = set()
    outputs: list = []          # every output stays alive, so that no tensor's id is reused by another

    def pack(tensor):
        base = tensor._base if tensor._base is not None else tensor
        name = producer.get(id(base), producer.get(id(tensor), current[0]))
        if name not in held:
            saved[name][id(base)] = base.numel() * base.element_size()
            saves[current[0]].add(name)
        return tensor

    class Run(fx.Interpreter):
        def run_node(self, n):
            current[0] = n.name
            out = super().run_node(n)
            if n.op == "call_function" and aliases_input(n, out, self.env):
                views.add(n.name)
            for leaf in pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    producer.setdefault(id(leaf), n.name)
                    outputs.append(leaf)
            return out

    with fake_mode:
        fakes = [torch.empty_strided(i.shape, i.stride, dtype=i.dtype, device=i.device).requires_grad_(i.requires_grad)
                 for i in inputs]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            Run(gm).run(*fakes)
    calls = [node for node in gm.graph.nodes if node.op == "call_function"]
    flops = {node.name: _flops(node) for node in calls}
    traffic = fused_traffic(gm, views, {name for name, kept in saved.items() if kept},
                            {name for name, count in flops.items() if count})
    return [OpCost(node.name, flops[node.name], traffic[node.name][0], _nbytes(node.meta.get("val")),
                   sum(saved[node.name].values()), tuple(module_paths(node)), tuple(sorted(saves[node.name])),
                   traffic[node.name][1], _touched(node), _rate(node) if flops[node.name] else "") for node in calls]


def _parameter_copies(gm: fx.GraphModule, inputs) -> set[str]:
    """The ops that cast a parameter to mixed precision's compute dtype: what the backward keeps of them is the
    parameter's copy, which the cost model counts per parameter (``cost_model.gathered_bytes``: a ZeRO
    parameter's gathered replica, a replicated one's copy), not as activations."""
    parameters = {n for n, inp in zip((n for n in gm.graph.nodes if n.op == "placeholder"), inputs)
                  if getattr(inp, "kind", None) == "parameter"}
    return {n.name for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten._to_copy.default
            and n.args and n.args[0] in parameters}


def repeated_blocks(gm: fx.GraphModule) -> tuple[str | None, dict[str, list[str]]]:
    """The repeated module class a search may recompute, and its instances' ops (path -> node names): the same
    for every copy of a graph placed otherwise, so a search reads it once."""
    recompute = _recompute_class(gm)
    return recompute, ({} if recompute is None else _instances(gm, recompute))


def graph_costs(gm: fx.GraphModule, inputs, ops: list[OpCost], tp: int, propagation=None,
                blocks: tuple[str | None, dict[str, list[str]]] | None = None, *, profile: DeviceProfile) -> UnitCosts:
    """``ops`` (of ``gm``, whose placeholders are ``inputs``) on one rank of a unit of ``tp`` ranks placed
    as ``propagation`` found, with the instances of the repeated module class a search may recompute
    (``blocks``: :func:`repeated_blocks` of ``gm`` or of the graph it copies), their FLOPs at the rates of
    ``profile``."""
    split = {op.name: _split(op.name, tp, propagation) for op in ops}
    written = {op.name: _written(op.name, tp, propagation) for op in ops}
    flops = flop_seconds([(op, split[op.name]) for op in ops], profile)
    backward_extra = flop_seconds([(op, split[op.name]) for op in ops], profile, backward_extra=True)
    moved = sum(op.bytes * split[op.name] for op in ops if not op.flops)     # (a roofline per op: see above)
    nodes = {n.name: n for n in gm.graph.nodes}
    saved = sum(op.saved_bytes * written[op.name] for op in ops) + _gathered_for_backward(nodes, tp, propagation)
    outputs = tuple(op.out_bytes * written[op.name] for op in ops)
    recompute, blocks_of = blocks or repeated_blocks(gm)
    instances = []
    if recompute is not None:
        by_op = {op.name: op for op in ops}
        for path, names in blocks_of.items():
            inside = [by_op[n] for n in names if n in by_op]
            again, kept = _recomputed(names, by_op, nodes, propagation)
            entry = _entry_bytes(nodes, names, tp, propagation)
            gathered = _gathered_for_backward(nodes, tp, propagation, set(names))
            instances.append(InstanceCosts(
                path, sum(op.saved_bytes * written[op.name] for op in inside) + gathered,
                entry + gathered + sum(_kept_bytes(by_op[n], tp, propagation) for n in kept),
                flop_seconds([(by_op[n], split[n]) for n in again], profile),
                sum(by_op[n].bytes * split[n] for n in again if not by_op[n].flops), entry,
                sum(by_op[n].kernels for n in again)))
    grads = _replicated_grads(gm, inputs, tp, propagation)
    return UnitCosts(flops, moved, saved, max(outputs, default=0), sum(grads), recompute, tuple(instances), len(grads),
                     outputs, sum(op.kernels for op in ops), backward_extra)


def flop_seconds(ops: list[tuple[OpCost, float]], profile: DeviceProfile, backward_extra: bool = False) -> float:
    """The seconds of the FLOPs of ``ops`` (each with the share a rank does) at ``profile``'s rate for each
    class (their forward's, or their backward's beyond twice that): summed by class, then divided."""
    by_rate: dict[str, float] = defaultdict(float)
    for op, share in ops:
        by_rate[op.rate] += (op.backward_extra_flops if backward_extra else op.flops) * share
    return sum(profile.flop_seconds(flops, rate) for rate, flops in by_rate.items())


def _flops(node: fx.Node) -> int:
    formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if formula is None:
        return 0
    args, kwargs = pytree.tree_map_only(fx.Node, lambda a: a.meta.get("val"), (node.args, node.kwargs))
    try:
        return int(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:       # (a formula that does not take these arguments counts nothing)
        return 0


def _rate(node: fx.Node) -> str:
    """The class of an op's FLOPs: the dtype it computes in (its output's)."""
    value = next((t for t in pytree.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)), None)
    return "" if value is None else str(value.dtype).removeprefix("torch.")


def _touched(node: fx.Node) -> int:
    read = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
    return sum(_nbytes(a.meta.get("val")) for a in read) + _nbytes(node.meta.get("val"))


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def _placements(name: str, propagation) -> tuple:
    return () if propagation is None else propagation.placements.get(name, ())


def _split(name: str, tp: int, propagation) -> float:
    """The share of an op's work one rank does."""
    placements = _placements(name, propagation)
    if any(isinstance(p, (Shard, Partial)) for p in placements) or (
            propagation is not None and name in propagation.reduced_partials):
        return 1 / tp
    return 1.0


def _written(name: str, tp: int, propagation) -> float:
    """The share of an op's output one rank holds."""
    return 1 / tp if any(isinstance(p, Shard) for p in _placements(name, propagation)) else 1.0


def _gathered_for_backward(nodes: dict[str, fx.Node], tp: int, propagation, names: set[str] | None = None
                           ) -> float:
    """What attention over a split sequence keeps beyond a rank's share of its inputs (context parallelism):
    the keys and values it gathers, whole, saved for its backward and kept by a recompute too (a collective's
    output is never recomputed). Of the ops ``names`` (default: every op)."""
    if propagation is None or tp == 1:
        return 0.0
    return sum(c.bytes * (1 - 1 / tp) for c in propagation.collectives
               if c.kind == "all_gather" and c.mirrored and (names is None or c.node in names)
               and c.node in nodes and nodes[c.node].target in ATTENTION_OPS)


def _recomputed(names: list[str], by_op: dict[str, OpCost], nodes: dict[str, fx.Node], propagation
                ) -> tuple[set[str], set[str]]:
    """The ops of a recomputed module instance (its ops ``names``) that the backward runs again, and the ops
    inside it whose outputs it keeps instead. The partitioners recompute what the backward reads, not the
    whole forward: the values the instance's ops save, and what they are computed from inside the instance
    (a projection whose output feeds only the block's output is not run again: 4 of a GPT block's 6
    matmuls under tp, 5 under dp, traced). The walk stops at the instance's inputs, at random ops (saved,
    never drawn again) and at ops that communicate (dynshard's collectives are not tagged: the reduced
    value is saved; ``passes/tag_recompute``)."""
    inside = set(names)
    communicating = set() if propagation is None else (
        {c.node for c in propagation.collectives} | set(propagation.fallbacks) | propagation.reduced_partials)
    again: set[str] = set()
    kept: set[str] = set()
    stack = [source for name in names if name in by_op for source in by_op[name].saves]
    while stack:
        name = stack.pop()
        if name not in inside or name in again or name in kept or name not in by_op:
            continue
        if name in communicating or is_rng(nodes[name]):
            kept.add(name)
            continue
        again.add(name)
        stack.extend(a.name for a in nodes[name].all_input_nodes)
    return again, kept


def _kept_bytes(op: OpCost, tp: int, propagation) -> float:
    """The bytes a recompute keeps of an op it does not run again: a tp reduction's output (:func:`_reduced_bytes`),
    else the op's output as this rank holds it."""
    reduced = _reduced_bytes(op, tp, propagation)
    return reduced if reduced else op.out_bytes * _written(op.name, tp, propagation)


def _reduced_bytes(op: OpCost, tp: int, propagation) -> float:
    """The bytes of ``op``'s output after its tp reduction: whole when all-reduced, 1/tp when its partial sum
    is reduce-scattered (sequence parallel); 0 when nothing reduces it."""
    if propagation is None or tp == 1:
        return 0.0
    if op.name in propagation.reduced_partials:
        return float(op.out_bytes)
    if any(isinstance(p, Partial) for p in _placements(op.name, propagation)):
        return op.out_bytes / tp
    return 0.0


def _recompute_class(gm: fx.GraphModule) -> str | None:
    """The model's repeated block: the module class with two or more instances that covers the most ops,
    each op counted for the outermost such class around it (a decoder layer, not the norms inside it)."""
    paths: dict[str, set[str]] = defaultdict(set)
    for node in gm.graph.nodes:
        for path, cls in _stack(node):
            paths[cls].add(path)
    repeated = {cls for cls in paths if len(paths[cls]) > 1 and cls != _ROOT_CLASS}
    covered: Counter = Counter()
    for node in gm.graph.nodes:
        outermost = next((cls for _, cls in _stack(node) if cls in repeated), None)
        if outermost is not None:
            covered[outermost] += 1
    return min(covered, key=lambda cls: (-covered[cls], cls), default=None)


def _instances(gm: fx.GraphModule, cls: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = defaultdict(list)
    for node in gm.graph.nodes:
        for path, name in _stack(node):
            if name == cls:
                found[path].append(node.name)
                break
    return found


def _stack(node: fx.Node) -> list[tuple[str, str]]:
    classes = [c if isinstance(c, str) else getattr(c, "__name__", str(c))
               for _, c in node.meta.get("nn_module_stack", {}).values()]
    return [(path, cls.rsplit(".", 1)[-1]) for path, cls in zip(module_paths(node), classes)]


def _entry_bytes(nodes: dict[str, fx.Node], names: list[str], tp: int, propagation) -> float:
    """The activations a module instance reads from outside it: what a recompute keeps."""
    inside = set(names)
    entries = set()
    for name in names:
        for arg in nodes[name].all_input_nodes:
            if arg.name not in inside and arg.op != "placeholder" and arg.op != "get_attr":
                entries.add(arg)
    return sum(_nbytes(a.meta.get("val")) * _written(a.name, tp, propagation) for a in entries)


def _replicated_grads(gm: fx.GraphModule, inputs, tp: int, propagation) -> list[int]:
    """The bytes of each all-reduce of a tp-replicated parameter's gradient whose readers split the work:
    partial sums over tp, one all-reduce per reader that splits (a table tied to an embedding and a head
    under data is all-reduced twice, as the program does)."""
    if propagation is None or tp == 1:
        return []
    found = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, inp in zip(placeholders, inputs):
        if inp.kind != "parameter" or not inp.requires_grad:
            continue
        if any(isinstance(p, (Shard, Partial)) for p in _placements(node.name, propagation)):
            continue
        readers = sum(_reads_split(user, node, propagation) for user in node.users)
        found += [math.prod(inp.shape) * inp.dtype.itemsize] * readers
    return found


def _reads_split(node: fx.Node, source: fx.Node, propagation, depth: int = 0) -> bool:
    """Whether ``node``, a reader of ``source`` (following views, casts and lookups of a parameter whose other
    inputs are constants), splits its work by a sharded activation, its value is re-sharded locally for a
    reader (a position embedding added to a sequence shard: each rank's gradient holds its rows only), or a
    reader broadcasts it over a split dimension (a position embedding added to batch shards: its gradient
    sums the rank's rows)."""
    if any(isinstance(p, Shard) for p in _placements(node.name, propagation)) or any(
            r.source == node.name for r in propagation.local_reshards):
        return True
    if any(_broadcast_over_split(node, user, propagation) for user in node.users):
        return True
    others = [a for a in node.all_input_nodes if a is not source and a.name not in propagation.replicated_constants]
    if depth < 4 and not others:
        return any(_reads_split(user, node, propagation, depth + 1) for user in node.users)
    return False


def _broadcast_over_split(node: fx.Node, user: fx.Node, propagation) -> bool:
    value, out = node.meta.get("val"), user.meta.get("val")
    if not isinstance(value, torch.Tensor) or not isinstance(out, torch.Tensor) or out.dim() <= value.dim():
        return False
    leading = out.dim() - value.dim()
    return any(isinstance(p, Shard) and p.dim < leading for p in _placements(user.name, propagation))


__all__ = ["OpCost", "graph_costs", "op_costs", "repeated_blocks"]

"""Outline repeated nn.Module blocks of an FX graph into calls of one shared invoke_subgraph subgraph.

outline_blocks(gm) -> (gm, report). Works on a Dynamo graph (torch-level, node.meta["example_value"])
and on an ATen graph from make_fx (node.meta["val"]), as long as nodes carry
node.meta["nn_module_stack"].

Block = the outermost module in a node's nn_module_stack whose path ends in ".<int>" (a ModuleList /
Sequential entry, e.g. "L['self'].blocks.3" or "blocks.3"). Blocks of one class whose node lists are
structurally identical (same op sequence, same non-node args, same input metadata) share one subgraph.
The block's parameters are simply inputs of the region (they are placeholders of the outer graph).
"""
from __future__ import annotations

import operator
import re
from collections import defaultdict

import torch
import torch.fx as fx
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph   # == torch.ops.higher_order.invoke_subgraph

# the reorder and the aliasing workaround are the pass's own (dynshard/passes/outline_repeated_blocks.py)
from dynshard.passes.outline_repeated_blocks import _topological_order as _toposort  # noqa: F401
from dynshard.passes.outline_repeated_blocks import unalias_subgraph_outputs  # noqa: F401

_BLOCK = re.compile(r"^(.*)\.(\d+)$")


def block_of(node: fx.Node):
    stack = node.meta.get("nn_module_stack") or {}
    for path, cls in stack.values():            # outermost first
        if _BLOCK.match(path):
            return path, getattr(cls, "__qualname__", str(cls))
    return None


def _val(n: fx.Node):
    return n.meta.get("val", n.meta.get("example_value"))


def _tensor_sig(v):
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), tuple(v.stride()), v.dtype, v.device.type, v.requires_grad)
    return ("O", type(v).__name__, v if isinstance(v, (int, float, bool, str)) else None)


class _Region:
    def __init__(self, key, cls, nodes):
        self.key, self.cls, self.nodes = key, cls, nodes
        members = set(nodes)
        self.inputs: list[fx.Node] = []
        seen = {}
        sig = []
        local = {n: i for i, n in enumerate(nodes)}

        def ref(a):
            if a in local:
                return ("L", local[a])
            if a not in seen:
                seen[a] = len(self.inputs)
                self.inputs.append(a)
            return ("I", seen[a])

        for n in nodes:
            refs = []
            fx.node.map_arg((n.args, n.kwargs), lambda a: refs.append(ref(a)) or a)
            # non-node structure of the args: repr with nodes blanked out
            shape = fx.node.map_arg((n.args, n.kwargs), lambda a: "%")
            sig.append((n.op, str(n.target), repr(shape), tuple(refs)))
        self.signature = (tuple(sig), tuple(_tensor_sig(_val(i)) for i in self.inputs))
        # positions of nodes used outside the region
        self.external_outs = {local[n] for n in nodes if any(u not in members for u in n.users)}


def find_regions(gm: fx.GraphModule):
    by_block = defaultdict(list)
    cls_of = {}
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module"):
            continue
        b = block_of(n)
        if b is not None:
            by_block[b[0]].append(n)
            cls_of[b[0]] = b[1]
    return [_Region(k, cls_of[k], v) for k, v in by_block.items()]


def _build_subgraph(region: _Region, out_positions: list[int], strip_output_vals: bool = True) -> fx.GraphModule:
    g = fx.Graph()
    env = {}
    for i, inp in enumerate(region.inputs):
        p = g.placeholder(f"arg{i}")
        p.meta = {k: v for k, v in inp.meta.items() if k in ("val", "example_value", "tensor_meta")}
        env[inp] = p
    for n in region.nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    outs = tuple(env[region.nodes[i]] for i in out_positions)
    # invoke_subgraph's autograd key reads requires_grad of the outputs from meta["val"] /
    # meta["example_value"] (get_output_metadata, get_non_differentiable_indices). A make_fx'd ATen graph has
    # vals traced below autograd (requires_grad=False everywhere), which would drop the block's gradients
    # ("outs_to_grad length (1) != tangents length (0)"). Without them it runs the subgraph on fakes instead.
    if strip_output_vals:
        for o in outs:
            o.meta = {k: v for k, v in o.meta.items() if k not in ("val", "example_value")}
    g.output(outs)
    return fx.GraphModule(torch.nn.Module(), g)


def outline_blocks(gm: fx.GraphModule, min_count: int = 2):
    regions = find_regions(gm)
    groups = defaultdict(list)
    for r in regions:
        groups[(r.cls, r.signature)].append(r)
    report = {"blocks": len(regions), "groups": []}
    graph = gm.graph
    replaced: dict[fx.Node, fx.Node] = {}     # region output -> getitem that replaced it
    for gi, ((cls, _sig), members) in enumerate(groups.items()):
        if len(members) < min_count:
            report["groups"].append((cls, len(members), "left inline"))
            continue
        out_positions = sorted(set().union(*(r.external_outs for r in members)))
        sub = _build_subgraph(members[0], out_positions)
        name = f"repeated_block_{gi}"
        gm.add_submodule(name, sub)
        # get_attr right after the last placeholder
        last_ph = list(graph.find_nodes(op="placeholder"))[-1]
        with graph.inserting_after(last_ph):
            sub_attr = graph.get_attr(name)
        for r in members:
            with graph.inserting_after(r.nodes[-1]):
                call = graph.call_function(invoke_subgraph,
                                           (sub_attr, name, *(replaced.get(i, i) for i in r.inputs)))
            outs_meta = []
            with graph.inserting_after(call):
                getitems = []
                for j, pos in enumerate(out_positions):
                    gi_node = graph.call_function(operator.getitem, (call, j))
                    src = r.nodes[pos]
                    gi_node.meta = {k: v for k, v in src.meta.items()
                                    if k in ("val", "example_value", "tensor_meta", "stack_trace")}
                    outs_meta.append(_val(src))
                    getitems.append(gi_node)
            # keep meta on the HOP node like Dynamo does
            call.meta["example_value"] = tuple(outs_meta)
            if all("val" in r.nodes[p].meta for p in out_positions):
                call.meta["val"] = tuple(outs_meta)
            members_set = set(r.nodes)
            for pos, gi_node in zip(out_positions, getitems):
                src = r.nodes[pos]
                src.replace_all_uses_with(gi_node, delete_user_cb=lambda u: u not in members_set)
                replaced[src] = gi_node
            for n in reversed(r.nodes):
                graph.erase_node(n)
        report["groups"].append((cls, len(members), name, len(members[0].nodes), len(members[0].inputs),
                                 len(out_positions)))
    # an external user of a region output placed before the region's end would now precede the call
    _toposort(graph)
    graph.lint()
    gm.recompile()
    return gm, report

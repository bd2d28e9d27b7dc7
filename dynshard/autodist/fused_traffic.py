"""The memory traffic and kernels of a forward ATen graph once Inductor has fused it.

Inductor fuses the memory-bound ops between two compute-bound ones (pointwise ops, reductions, copies,
lookups) into kernels that read their inputs from memory once and write only what is read outside them.
Priced op by op, the forward of a GPT (d 1024, 8 layers, seq 1024, batch 8) moved 84 GB, of which 51 GB were
views; its step on an H200 was predicted at 1.54x its measurement (docs/design.md "Cost model").

Per op of the graph:
- a view (its outputs share an input's storage and it writes nothing: view, reshape without a copy,
  transpose, expand, an item of a tuple) and a marker that returns nothing (``pipe_split``) move nothing
  and launch nothing;
- a *kernel* of its own: an op with FLOPs (matmul, attention), an in-place op, a random op and an op outside
  ATen (a collective). It reads and writes its tensors whole (a collective: nothing here, nor a launch;
  communication prices it, its latency included);
- any other ATen op is *fused*. Fused ops joined by an edge that no kernel separates (the same stage: as many
  kernels on the longest path to each) share a kernel, launched once if it writes anything. A fused op reads
  an input from memory where another kernel wrote it (or it is a graph input), and writes its output where
  another kernel reads it, the backward keeps it, or the graph returns it.

A view's bytes are the lesser of the view's and the memory behind it: a bias expanded over the batch is read
once, not once per row.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..compat import OpOverload, pytree
from ..passes.tag_recompute import is_rng


def aliases_input(node: fx.Node, out, env: dict) -> bool:
    """Whether ``node``'s outputs ``out`` (run on ``env``'s values) are views of its inputs: every output
    tensor shares an input's storage, and the op writes none of them."""
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, OpOverload) or node.target._schema.is_mutable:
        return False
    outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    inputs = {_storage(t) for a in node.all_input_nodes for t in pytree.tree_leaves(env.get(a))
              if isinstance(t, torch.Tensor)}
    return bool(outputs) and all(_storage(t) in inputs for t in outputs)


def fused_traffic(gm: fx.GraphModule, views: set[str], saved: set[str], computing: set[str]
                  ) -> dict[str, tuple[int, int]]:
    """Each op of ``gm`` -> (bytes it moves to and from memory, kernels it launches), with ``views`` the ops
    whose outputs alias their inputs, ``saved`` those whose outputs the backward keeps and ``computing`` those
    with FLOPs."""
    nodes = list(gm.graph.nodes)
    kind = {n.name: _kind(n, views, computing) for n in nodes}
    stage: dict[str, int] = {}
    for n in nodes:
        stage[n.name] = max((stage[a.name] + (kind[a.name] == "kernel") for a in n.all_input_nodes), default=0)
    memory = {n.name: _memory(n, views) for n in nodes}
    readers: dict[str, list[fx.Node]] = {}
    for n in nodes:
        if kind[n.name] != "view":
            for a in n.all_input_nodes:
                readers.setdefault(memory[a.name].name, []).append(n)

    def written(n: fx.Node) -> bool:
        return n.name in saved or any(
            r.op == "output" or kind[r.name] == "kernel" or stage[r.name] != stage[n.name]
            for r in readers.get(n.name, ()))

    group = {n.name: n.name for n in nodes}        # fused ops joined by an edge within a stage: one kernel

    def root(name: str) -> str:
        while group[name] != name:
            group[name] = group[group[name]]
            name = group[name]
        return name
    for n in nodes:
        if kind[n.name] == "fused":
            for a in n.all_input_nodes:
                source = memory[a.name]
                if kind[source.name] == "fused" and stage[source.name] == stage[n.name]:
                    group[root(n.name)] = root(source.name)
    launched: set[str] = set()
    out = {}
    for n in nodes:
        if n.op != "call_function":
            continue
        if kind[n.name] == "view":
            out[n.name] = (0, 0)
        elif kind[n.name] == "kernel":
            communicates = isinstance(n.target, OpOverload) and n.target.namespace != "aten"
            whole = sum(_nbytes(a.meta.get("val")) for a in n.all_input_nodes) + _nbytes(n.meta.get("val"))
            out[n.name] = (0, 0) if communicates else (whole, 1)
        else:
            read = {}
            for a in n.all_input_nodes:
                source = memory[a.name]
                if kind[source.name] != "fused" or stage[source.name] != stage[n.name]:
                    read[source.name] = max(read.get(source.name, 0), min(_nbytes(a.meta.get("val")),
                                                                          _nbytes(source.meta.get("val"))))
            writes = written(n)
            first = writes and root(n.name) not in launched
            if first:
                launched.add(root(n.name))
            out[n.name] = (sum(read.values()) + (_nbytes(n.meta.get("val")) if writes else 0), int(first))
    return out


def _kind(node: fx.Node, views: set[str], computing: set[str]) -> str:
    if node.op != "call_function":
        return "input" if node.op in ("placeholder", "get_attr") else "output"
    if node.name in views or not _nbytes(node.meta.get("val")):     # (a marker: pipe_split)
        return "view"
    target = node.target
    if (not isinstance(target, OpOverload) or target.namespace != "aten" or target._schema.is_mutable
            or is_rng(node) or node.name in computing):
        return "kernel"
    return "fused"


def _memory(node: fx.Node, views: set[str]) -> fx.Node:
    """The op that wrote the memory ``node``'s value lies in (through views)."""
    while node.name in views and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _storage(tensor: torch.Tensor):
    return StorageWeakRef(tensor.untyped_storage())


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))

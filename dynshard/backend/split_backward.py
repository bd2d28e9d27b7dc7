"""Split a stage's compiled backward into its input-gradient part (I) and its weight-gradient part (W).

Zero-bubble schedules run I as soon as the next stage's gradient arrives (the previous stage is waiting
for it) and defer W to fill the pipeline's bubbles. A compiled stage's backward is one autograd node, so
torch's eager split (``stage_backward_input`` / ``_weight``) would run it whole twice; the split has to
happen in the compiler, on aot_autograd's backward graph (as torchtitan's and autoparallel's graph
pipelines do).

The backward graph returns one gradient per forward input. ``split`` cuts it in two graphs:

- I computes every gradient of a non-weight input, plus the intermediate values W needs from it;
- W takes the backward's inputs it reads (saved activations, tangents) and those intermediates, and
  computes the weights' gradients.

At run time the backward autograd calls runs I, returns None for the weights (autograd then accumulates
nothing into them) and leaves W's inputs with :class:`DeferredWeightGradients`, which the W action runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.fx as fx

from ..runtime.pipeline.deferred import DEFERRING

@dataclasses.dataclass
class SplitBackward:
    input_part: fx.GraphModule     # bw inputs -> (input gradients..., values for W...)
    weight_part: fx.GraphModule    # (bw inputs it reads..., values from I...) -> weight gradients
    weight_reads: list[int]        # which bw inputs W reads
    input_positions: list[int]     # bw output positions of I's gradients
    weight_positions: list[int]    # bw output positions of W's gradients
    noutputs: int


def _ancestors(targets: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(targets)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def split(bw: fx.GraphModule, weight_outputs: set[int]) -> SplitBackward:
    """Cut ``bw`` so that the outputs at ``weight_outputs`` (the weights' gradients) come from a second graph."""
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    output = next(n for n in bw.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    input_positions = [i for i, o in enumerate(outs) if isinstance(o, fx.Node) and i not in weight_outputs]
    weight_positions = [i for i, o in enumerate(outs) if isinstance(o, fx.Node) and i in weight_outputs]
    for_inputs = _ancestors([outs[i] for i in input_positions])
    for_weights = _ancestors([outs[i] for i in weight_positions])
    only_weights = [n for n in bw.graph.nodes if n in for_weights and n not in for_inputs and n.op != "placeholder"]
    weight_targets = [outs[i] for i in weight_positions]
    needed = []     # values W reads that it does not compute: bw inputs, or I's intermediates
    for node in only_weights + weight_targets:
        for arg in ([node] if node in for_inputs or node.op == "placeholder" else node.all_input_nodes):
            if (arg.op == "placeholder" or arg in for_inputs) and arg not in needed:
                needed.append(arg)
    shared = [n for n in needed if n.op != "placeholder"]
    weight_reads = [placeholders.index(n) for n in needed if n.op == "placeholder"]

    graph_i = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in bw.graph.nodes:
        if node.op == "placeholder" or (node in for_inputs and node.op != "output"):
            env[node] = graph_i.node_copy(node, lambda n: env[n])
    graph_i.output(tuple(env[outs[i]] for i in input_positions) + tuple(env[n] for n in shared))

    graph_w = fx.Graph()
    env = {}
    for node in [n for n in needed if n.op == "placeholder"] + shared:
        env[node] = graph_w.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in only_weights:
        env[node] = graph_w.node_copy(node, lambda n: env[n])
    graph_w.output(tuple(env[n] for n in weight_targets))
    return SplitBackward(fx.GraphModule(bw, graph_i), fx.GraphModule(bw, graph_w), weight_reads, input_positions,
                         weight_positions, len(outs))


def compiled_backward(bw: fx.GraphModule, example_inputs, compile_graph, weight_outputs: set[int]) -> Callable:
    """The boxed backward aot_autograd calls: I now, W deferred (or at once outside a ``collecting`` block)."""
    parts = split(bw, weight_outputs)
    examples_i = list(example_inputs)
    shared_examples = [n.meta.get("val") for n in parts.weight_part.graph.nodes if n.op == "placeholder"][
        len(parts.weight_reads):]
    examples_w = [examples_i[i] for i in parts.weight_reads] + shared_examples
    run_i = compile_graph(parts.input_part, examples_i)
    run_w = compile_graph(parts.weight_part, examples_w)
    ninput = len(parts.input_positions)

    def backward(args: list) -> list:
        results = list(run_i(list(args)))
        grads: list[Any] = [None] * parts.noutputs
        for position, grad in zip(parts.input_positions, results[:ninput]):
            grads[position] = grad
        reads = [args[i] for i in parts.weight_reads] + results[ninput:]
        args.clear()
        deferred = DEFERRING.get()

        def weights() -> list[torch.Tensor]:
            return list(run_w(list(reads)))

        if deferred is None:        # not inside an I action: the whole backward at once
            for position, grad in zip(parts.weight_positions, weights()):
                grads[position] = grad
        else:
            store, key = deferred
            store.pending[key] = lambda: dict(zip(parts.weight_positions, weights()))
        return grads

    backward._boxed_call = True
    return backward

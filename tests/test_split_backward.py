"""The stage compiler's split of a backward into input gradients (now) and weight gradients (deferred)."""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from dynshard.backend.compiler import compile_per_rank
from dynshard.backend.split_backward import compiled_backward, split
from dynshard.runtime.pipeline.deferred import DeferredWeightGradients


def _mlp(w1, w2, x):
    return (torch.tanh(x @ w1) @ w2,)


def _compiled(graphs: dict):
    def on_graph(graph, phase):
        graphs[phase] = graph

    def backward(graph, inputs, compile_graph):
        graphs["split"] = split(graph, {0, 1})
        return compiled_backward(graph, inputs, compile_graph, weight_outputs={0, 1})

    tensors = [torch.randn(4, 8, requires_grad=True), torch.randn(8, 3, requires_grad=True),
               torch.randn(2, 4, requires_grad=True)]
    run = compile_per_rank(fx.symbolic_trace(_mlp), tensors, "aot_eager", on_graph, backward=backward)
    return run, tensors


def _matmuls(graph: fx.GraphModule) -> int:
    return sum(1 for n in graph.graph.nodes if n.op == "call_function" and "mm" in str(n.target))


def test_the_input_part_holds_no_weight_gradient_matmul_and_the_weight_part_runs_when_asked():
    graphs: dict = {}
    run, (w1, w2, x) = _compiled(graphs)
    grad = torch.randn(2, 3)
    deferred = DeferredWeightGradients()
    with deferred.collecting(("stage", 0)):
        torch.autograd.backward(run(w1, w2, x)[0], grad)
    assert w1.grad is None and w2.grad is None and x.grad is not None
    weight_grads = deferred.run(("stage", 0))
    reference = [t.detach().requires_grad_() for t in (w1, w2, x)]
    torch.autograd.backward(_mlp(*reference)[0], grad)
    torch.testing.assert_close(x.grad, reference[2].grad)
    torch.testing.assert_close(weight_grads[0], reference[0].grad)
    torch.testing.assert_close(weight_grads[1], reference[1].grad)
    parts = graphs["split"]
    # the whole backward has 4 matmuls: dx needs 2 (through w2 then w1), the weights 2 more
    assert (_matmuls(graphs["backward"]), _matmuls(parts.input_part), _matmuls(parts.weight_part)) == (4, 2, 2)


def test_outside_an_input_gradient_action_the_whole_backward_runs_at_once():
    run, (w1, w2, x) = _compiled({})
    torch.autograd.backward(run(w1, w2, x)[0], torch.ones(2, 3))
    assert w1.grad is not None and w2.grad is not None and x.grad is not None

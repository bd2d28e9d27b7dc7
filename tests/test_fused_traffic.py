"""The memory traffic and kernels a forward ATen graph costs once Inductor fuses it (the cost model's memory-bound
term): views move nothing, a chain of pointwise ops between two matmuls reads what the first wrote and writes
what the second reads, once."""

from __future__ import annotations

import types

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from dynshard.autodist.graph_costs import op_costs

N, M = 64, 32


def _costs(fn, *shapes):
    mode = FakeTensorMode()
    with mode:
        fakes = [torch.empty(s) for s in shapes]
        gm = make_fx(fn)(*fakes)
    inputs = [types.SimpleNamespace(shape=tuple(s), stride=torch.empty(s).stride(), dtype=torch.float32,
                                    device=torch.device("cpu"), requires_grad=False) for s in shapes]
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    return {str(n.target): c for n, c in zip(calls, op_costs(gm, inputs, mode))}


def test_a_pointwise_chain_between_two_matmuls_reads_and_writes_its_ends_once_in_one_kernel():
    def fn(x, w, b):
        h = torch.mm(x, w)
        h = (h + b.expand(N, M)).relu() * 2
        return torch.mm(h.t(), h)

    costs = _costs(fn, (N, N), (N, M), (M,))
    views = [costs["aten.expand.default"], costs["aten.t.default"]]
    assert all(c.bytes == 0 and c.kernels == 0 for c in views)
    add, relu, mul = costs["aten.add.Tensor"], costs["aten.relu.default"], costs["aten.mul.Tensor"]
    # the matmul's output read once, the bias once (not once a row), nothing between them, the end written
    assert add.bytes == N * M * 4 + M * 4 and relu.bytes == 0 and mul.bytes == N * M * 4
    assert add.kernels + relu.kernels + mul.kernels == 1
    assert costs["aten.mm.default"].kernels == 1 and costs["aten.mm.default"].flops > 0


def test_a_value_read_past_a_matmul_is_written_and_read_again():
    """A residual: the sum feeds a matmul and, after it, another sum; the two sums cannot share a kernel."""
    def fn(x, w):
        r = x * 3
        return r + torch.mm(r, w)

    costs = _costs(fn, (N, N), (N, N))
    mul, add = costs["aten.mul.Tensor"], costs["aten.add.Tensor"]
    assert mul.bytes == 2 * N * N * 4 and mul.kernels == 1          # read x, write r
    assert add.bytes == 3 * N * N * 4 and add.kernels == 1          # read r and the product, write the output

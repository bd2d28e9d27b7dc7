"""torch 2.13's proxy tracer on DTensor programs of symbolic sizes (the ground one symbolic tp program stands
on, see docs/probes/tp-symbolic/): a Megatron column -> row pair and split-head attention scores at a symbolic
sequence length, compiled once with aot_autograd inside ``compat.dtensor_symbolic_tracing()``, forward and
backward equal to eager DTensor, and at another length with no recompile. One process, a fake group of 2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dynshard import compat

D = 16


def _programs(mesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def whole(t):
        return DTensor.from_local(t, mesh, [Replicate()], run_check=False)

    def rows(t):
        return DTensor.from_local(t, mesh, [Shard(0)], run_check=False)

    def columns(t):
        return DTensor.from_local(t, mesh, [Shard(1)], run_check=False)

    def column_then_row(x, w1, w2):      # Megatron's MLP: column-split, row-split, the all-reduce
        return F.linear(F.linear(whole(x), rows(w1)), columns(w2)).redistribute(mesh, [Replicate()]).to_local().sum()

    def scores(x, w1, w2):               # heads split by view/transpose, q @ k^T
        q = F.linear(whole(x), rows(w1)).view(x.shape[0], x.shape[1], 4, D // 4).transpose(1, 2)
        return (q @ q.transpose(-2, -1)).to_local().sum()

    return {"column_then_row": column_then_row, "scores": scores}


@pytest.mark.parametrize("program", ["column_then_row", "scores"])
def test_dtensor_programs_of_a_symbolic_length_compile_once_and_match_eager(fake_world, program):
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    fn = _programs(init_device_mesh("cpu", (2,)))[program]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    generator = torch.Generator().manual_seed(0)
    w1 = torch.randn(D // 2, D, generator=generator)     # this rank's shard of [D, D], rows
    w2 = torch.randn(D, D // 2, generator=generator)     # and of [D, D], columns
    with compat.dtensor_symbolic_tracing():
        for length in (8, 12, 5):
            x = torch.randn(2, length, D, generator=generator)
            got = [t.clone().requires_grad_() for t in (x, w1, w2)]
            torch._dynamo.mark_dynamic(got[0], 1)
            want = [t.clone().requires_grad_() for t in (x, w1, w2)]
            out, expected = compiled(*got), fn(*want)
            out.backward()
            expected.backward()
            torch.testing.assert_close(out, expected)
            for g, w in zip(got, want):
                torch.testing.assert_close(g.grad, w.grad)
    assert counters["stats"]["unique_graphs"] == 1, counters["stats"]
    torch._dynamo.reset()


def test_the_mended_tracer_is_torchs_own_again_outside():
    import sympy
    import torch.fx.experimental.proxy_tensor as proxy_tensor

    register, had_pow = proxy_tensor._sym_register, sympy.Pow in proxy_tensor._sympy_handlers()
    with compat.dtensor_symbolic_tracing():
        assert proxy_tensor._sym_register is not register
    assert proxy_tensor._sym_register is register
    assert (sympy.Pow in proxy_tensor._sympy_handlers()) == had_pow

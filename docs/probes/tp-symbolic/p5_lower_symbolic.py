"""Probe: does dynshard's lowering (compat.trace_to_aten: torch.func.functionalize + make_fx "real") keep
symbolic sizes? Compared with make_fx without functionalize, and with aot_autograd-style functionalization."""
import os, sys
os.environ["OMP_NUM_THREADS"] = "1"
import torch, torch.fx as fx
torch.set_num_threads(1)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv, StatelessSymbolicContext, DimDynamic
from torch.fx.experimental.proxy_tensor import make_fx
from dynshard import compat

def model(x, w, b):
    return torch.nn.functional.linear(x, w, b).sum()

gm = fx.symbolic_trace(model)
def fakes():
    env = ShapeEnv(); mode = FakeTensorMode(shape_env=env)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x = mode.from_tensor(torch.randn(2, 5, 16), symbolic_context=ctx)
    w = mode.from_tensor(torch.randn(8, 16), static_shapes=True)
    b = mode.from_tensor(torch.randn(8), static_shapes=True)
    return env, mode, (x, w, b)

def show(tag, env, g):
    views = [f"{n.target}{tuple(n.args[1:])}" for n in g.graph.nodes if "view" in str(n.target) or "reshape" in str(n.target)]
    print(f"[{tag}] guards {[str(x.expr) for x in env.guards]}; views {views}")

env, mode, args = fakes()
show("dynshard trace_to_aten", env, compat.trace_to_aten(gm, args, mode, compat.sharding_decompositions()))
env, mode, args = fakes()
from dynshard.compat.tracing import isolated_tracing
with isolated_tracing(mode), mode:
    g = make_fx(lambda *a: fx.Interpreter(gm).run(*a), tracing_mode="real")(*args)
show("make_fx real, no functionalize", env, g)
env, mode, args = fakes()
with isolated_tracing(mode), mode:
    g = make_fx(torch.func.functionalize(lambda *a: fx.Interpreter(gm).run(*a), remove="mutations"),
                tracing_mode="real")(*args)
show("make_fx real + torch.func.functionalize", env, g)
env, mode, args = fakes()
from torch._subclasses.functional_tensor import dispatch_functionalize
with isolated_tracing(mode), mode:
    g = make_fx(dispatch_functionalize(lambda *a: fx.Interpreter(gm).run(*a)), tracing_mode="real")(*args)
show("make_fx real + python dispatch_functionalize", env, g)

# a buffer mutation (BatchNorm running stats), why dynshard functionalizes: does python functionalization keep it?
def bn(x, w, b, rm, rv):
    return torch.nn.functional.batch_norm(x, rm, rv, w, b, training=True).sum()
gm2 = fx.symbolic_trace(bn)
env = ShapeEnv(); mode = FakeTensorMode(shape_env=env)
ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC, DimDynamic.DYNAMIC])
a = [mode.from_tensor(torch.randn(2, 4, 5), symbolic_context=ctx)] + [mode.from_tensor(t, static_shapes=True) for t in (torch.ones(4), torch.zeros(4), torch.zeros(4), torch.ones(4))]
with isolated_tracing(mode), mode:
    g = make_fx(dispatch_functionalize(lambda *a: fx.Interpreter(gm2).run(*a)), tracing_mode="real",
                decomposition_table=compat.sharding_decompositions())(*a)
print("[batch_norm, python functionalize] guards", [str(x.expr) for x in env.guards], "copy_ nodes:",
      [str(n.target) for n in g.graph.nodes if "copy" in str(n.target)])

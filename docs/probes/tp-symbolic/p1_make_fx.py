"""Probe 1a: trace the DTensor block with make_fx under a FakeTensorMode+ShapeEnv where only the batch's
B and S are symbolic (parameters static, as Dynamo has them), on a 2-rank fake process group."""
import os, sys, traceback
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))
import block
if '--patch' in sys.argv:
    import torch_patches; torch_patches.patch_all()
if '--no-dynshard' not in sys.argv:
    import dynshard.compat  # registers DTensor strategies for CPU flash attention (compat/cpu_attention.py)
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv, StatelessSymbolicContext, DimDynamic
from torch.fx.experimental.proxy_tensor import make_fx

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
mesh = init_device_mesh("cpu", (2,))

def run(tag, dyn_dims, trace=True, **kw):
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=False)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dyn_dims])
    full = block.full_params()
    local = block.local_params(full, 0, 2)
    tokens = torch.randint(0, block.V, (2, 8))
    ft = mode.from_tensor(tokens, symbolic_context=ctx)
    fps = [mode.from_tensor(local[k], static_shapes=True) for k in block.NAMES]
    fn = lambda t, l, *ps: block.forward(mesh, t, l, *ps, **kw)
    try:
        if not trace:     # propagation style: DTensor ops run eagerly on symbolic fakes, nothing traced
            with mode:
                loss = fn(ft, ft.clone(), *fps)
            print(f"[{tag}] OK eager on symbolic fakes: loss", loss.shape, type(loss).__name__)
            print(f"[{tag}] guards:", [(str(g.expr), str(g.sloc)[-120:]) for g in env.guards])
            print(f"[{tag}] replacements:", {str(k): str(v) for k, v in env.replacements.items()})
            return None
        with mode:
            gm = make_fx(fn, tracing_mode="real")(ft, ft.clone(), *fps)   # labels: same sizes as tokens
        ops = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        print(f"[{tag}] OK: {len(gm.graph.nodes)} nodes; placeholders", [n.meta['val'].shape for n in gm.graph.nodes if n.op == 'placeholder'][:2])
        print(f"[{tag}] guards:", [str(g.expr) for g in env.guards])
        print(f"[{tag}] collectives:", [o for o in ops if "c10d" in o or "functional" in o])
        return gm
    except Exception as e:
        print(f"[{tag}] FAILED: {type(e).__name__}: {str(e).splitlines()[0][:400]}")
        traceback.print_exc(limit=-14 if "-full" in sys.argv else -6)

for dims in ([False, False], [False, True], [True, True]):
    for kw in (dict(math_path=False), dict(math_path=False, vocab_loss=False), dict(math_path=False, explicit_softmax=False), dict()):
        run(f"EAGER dims={dims} {kw}", dims, trace=False, **kw)
gm = run("S dyn, math sdpa, vocab loss", [False, True])
if gm is not None and "-v" in sys.argv:
    print(gm.code)
run("B,S dyn, math sdpa, vocab loss", [True, True])
run("S dyn, default sdpa (dynshard strategy)", [False, True], math_path=False)
run("B,S dyn, default sdpa (dynshard strategy)", [True, True], math_path=False)
run("S dyn, default sdpa, no loss_parallel", [False, True], math_path=False, vocab_loss=False)

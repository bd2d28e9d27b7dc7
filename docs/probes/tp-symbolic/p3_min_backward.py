"""Probe: the smallest DTensor programs whose aot_autograd backward fails with a symbolic sequence length
(one process, fake process group of 2; compile only, aot_eager). usage: python p3_min_backward.py [case ...]"""
import os, sys, traceback
os.environ["OMP_NUM_THREADS"] = "1"
import torch, torch.nn.functional as F
torch.set_num_threads(1)
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "--pow" in sys.argv:
    import torch_patches; torch_patches.patch_pow()
if "--cycle" in sys.argv:
    import torch_patches; torch_patches.patch_self_cycle()
if "--recursion" in sys.argv:
    sys.setrecursionlimit(20000)
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
mesh = init_device_mesh("cpu", (2,))
D = 16


def R(t): return DTensor.from_local(t, mesh, [Replicate()], run_check=False)
def S0(t): return DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
def S1(t): return DTensor.from_local(t, mesh, [Shard(1)], run_check=False)


CASES = {
    # x [B, S, D] replicated; column-split weight: out Shard(-1)
    "col3d": lambda x, w1, w2: F.linear(R(x), S0(w1)).to_local().sum(),
    # x [B*S, D] (2-D): column-split
    "col2d": lambda x, w1, w2: F.linear(R(x).flatten(0, 1), S0(w1)).to_local().sum(),
    # column then row with the all-reduce
    "colrow3d": lambda x, w1, w2: F.linear(F.linear(R(x), S0(w1)), S1(w2)).redistribute(mesh, [Replicate()]).to_local().sum(),
    "colrow2d": lambda x, w1, w2: F.linear(F.linear(R(x).flatten(0, 1), S0(w1)), S1(w2)).redistribute(mesh, [Replicate()]).to_local().sum(),
    # elementwise only
    "mul": lambda x, w1, w2: (R(x) * 2).to_local().sum(),
    # scores matmul q @ k^T with heads split
    "scores": lambda x, w1, w2: (lambda q: (q @ q.transpose(-2, -1)).to_local().sum())(
        F.linear(R(x), S0(w1)).view(x.shape[0], x.shape[1], 4, 4).transpose(1, 2)),
    "layernorm": lambda x, w1, w2: F.layer_norm(R(x), (D,)).to_local().sum(),
}

cases = [a for a in sys.argv[1:] if not a.startswith("--")] or list(CASES)
for name in cases:
    torch._dynamo.reset()
    for grad in (False, True):
        x = torch.randn(2, 8, D, requires_grad=grad)
        w1 = torch.randn(D // 2 * 2, D)[: D // 2].clone().requires_grad_(grad)   # local shard [8, 16] of [16, 16]
        w2 = torch.randn(D, D // 2).requires_grad_(grad)                          # local shard [16, 8] of [16, 16]
        torch._dynamo.mark_dynamic(x, 1)
        f = torch.compile(CASES[name], backend="aot_eager", fullgraph=True)
        try:
            out = f(x, w1, w2)
            if grad:
                out.backward()
            print(f"[{name} grad={grad}] OK")
        except Exception as e:
            msg = str(e).split("\n")
            print(f"[{name} grad={grad}] FAILED {type(e).__name__}: {' | '.join(m for m in msg[:3] if m)[:300]}")
            if "-v" in sys.argv:
                traceback.print_exc(limit=-25)
        torch._dynamo.reset()

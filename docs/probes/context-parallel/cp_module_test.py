# New (torchtitan-style) API: _context_parallel_shard + _enable_context_parallel_dispatcher + _ContextParallel plan.
# usage: torchrun --nproc-per-node 2 cp_module_test.py [handler0|handler1] [eager|compile]
import sys, torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.experimental._attention import (
    _context_parallel_shard, _ContextParallel, _enable_context_parallel_dispatcher,
    _HeadTailLoadBalancer, context_parallel_unshard)
import torch.distributed.tensor.experimental._context_parallel._attention as cpa
from cp_test import cpu_flash_fwd_handler, cpu_flash_bwd_handler
aten = torch.ops.aten

class Attn(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

dist.init_process_group("gloo"); rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
torch.manual_seed(0)
q, k, v, w = (torch.randn(2, 4, 64, 16) for _ in range(4))
rq, rk, rv = (t.clone().requires_grad_() for t in (q, k, v))
ref = Attn()(rq, rk, rv); (ref * w).sum().backward()
if sys.argv[1] == "handler1":
    cpa.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = cpu_flash_fwd_handler
    cpa.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = cpu_flash_bwd_handler
_enable_context_parallel_dispatcher()
attn = Attn()
parallelize_module(attn, mesh, _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA))
lb = _HeadTailLoadBalancer(64, 2, "cpu")
cq, ck, cv, cw = _context_parallel_shard(mesh, [q, k, v, w], [2, 2, 2, 2], load_balancer=lb)
cq, ck, cv = (t.requires_grad_() for t in (cq, ck, cv))
fn = attn if sys.argv[2] == "eager" else torch.compile(attn, backend="aot_eager", fullgraph=False)
try:
    out = fn(cq, ck, cv); (out * cw).sum().backward()
    res = context_parallel_unshard(mesh, [out.detach(), cq.grad, ck.grad, cv.grad], [2]*4, load_balancer=lb)
    if rank == 0:
        for n, a, b in zip(["out", "dq", "dk", "dv"], res, [ref, rq.grad, rk.grad, rv.grad]):
            print(f"[module {sys.argv[1:]}] {n} max|diff| = {(a-b).abs().max().item():.3e}", flush=True)
except Exception as e:
    if rank == 0: print(f"[module {sys.argv[1:]}] FAILED: {type(e).__name__}: {str(e)[:1500]}", flush=True)
dist.destroy_process_group()

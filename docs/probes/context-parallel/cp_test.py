# usage: torchrun --nproc-per-node 2 cp_test.py MODE [rotate] [lb]
#   MODE: default | math | flash | cpuring (custom handler for _scaled_dot_product_flash_attention_for_cpu)
import os, sys, traceback
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import (
    context_parallel_unshard, set_rotate_method, _cp_options)
import torch.distributed.tensor.experimental._context_parallel._attention as cpa

aten = torch.ops.aten
mode = sys.argv[1]; rotate = sys.argv[2] if len(sys.argv) > 2 else "allgather"
lb = (sys.argv[3] if len(sys.argv) > 3 else "1") == "1"

def cpu_flash_fwd_handler(op_call, args, kwargs):
    # args: query, key, value, dropout_p=0., is_causal=False, *, attn_mask=None, scale=None
    q, k, v = args[:3]
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    assert kwargs.get("attn_mask") is None
    mesh = q.device_mesh
    out, lse = cpa._templated_ring_attention(
        mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu.default,
        q.to_local(), k.to_local(), v.to_local(), is_causal=is_causal,
        dropout_p=dropout_p, scale=kwargs.get("scale"))
    wrap = lambda t: DTensor.from_local(t, mesh, [Shard(2)], run_check=False)
    return wrap(out), wrap(lse)

def cpu_flash_bwd_handler(op_call, args, kwargs):
    # grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None
    g, q, k, v, o, lse, dropout_p, is_causal = args[:8]
    mesh = q.device_mesh
    L = lambda t: t.to_local()
    gq, gk, gv = cpa._templated_ring_attention_backward(
        mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=L(g), grad_out_name="grad_out", query=L(q), key=L(k), value=L(v),
        out=L(o), logsumexp=L(lse), is_causal=is_causal, dropout_p=dropout_p,
        scale=kwargs.get("scale"))
    wrap = lambda t: DTensor.from_local(t, mesh, [Shard(2)], run_check=False)
    return wrap(gq), wrap(gk), wrap(gv)

def main():
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    B, H, S, D = 2, 4, 64, 16
    q, k, v, w = (torch.randn(B, H, S, D) for _ in range(4))
    # reference, single process
    rq, rk, rv = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(rq, rk, rv, is_causal=True)
    (ref * w).sum().backward()

    set_rotate_method(rotate)
    _cp_options.enable_load_balance = lb
    if mode == "cpuring":
        cpa.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = cpu_flash_fwd_handler
        cpa.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = cpu_flash_bwd_handler
    backend = {"default": None, "math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
               "cpuring": SDPBackend.FLASH_ATTENTION}[mode]
    cq, ck, cv, cw = (t.clone() for t in (q, k, v, w))
    try:
        with context_parallel(mesh, buffers=[cq, ck, cv, cw], buffer_seq_dims=[2, 2, 2, 2]):
            # leaf aliases (resize_ on exit refuses tensors that require grad)
            cq, ck, cv = (t.detach().requires_grad_() for t in (cq, ck, cv))
            if backend is None:
                out = F.scaled_dot_product_attention(cq, ck, cv, is_causal=True)
            else:
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(cq, ck, cv, is_causal=True)
            if rank == 0: print("local out type/shape:", type(out).__name__, tuple(out.shape), flush=True)
            (out * cw).sum().backward()
        res = context_parallel_unshard(mesh, [out.detach(), cq.grad, ck.grad, cv.grad], [2, 2, 2, 2])
        names = ["out", "dq", "dk", "dv"]
        refs = [ref.detach(), rq.grad, rk.grad, rv.grad]
        if rank == 0:
            for n, a, b in zip(names, res, refs):
                print(f"[{mode} rotate={rotate} lb={lb}] {n}: shape {tuple(a.shape)} max|diff| = {(a - b).abs().max().item():.3e}", flush=True)
    except Exception as e:
        if rank == 0:
            print(f"[{mode} rotate={rotate} lb={lb}] FAILED: {type(e).__name__}: {e}"[:3000], flush=True)
            traceback.print_exc(limit=-12)
    dist.destroy_process_group()

if __name__ == "__main__":
    main()

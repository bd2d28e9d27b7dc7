"""Isolate the gradient mismatch of invoke_subgraph + Inductor (CPU)."""
import sys, torch, gpt
from outline import outline_blocks
from torch._inductor.compile_fx import compile_fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
variant = sys.argv[1]; N = int(sys.argv[2]) if len(sys.argv) > 2 else 2
def eager_grads():
    m, idx, tgt = gpt.make(N); l = m(idx, tgt); l.backward()
    return l.detach(), {k: p.grad for k, p in m.named_parameters()}
def be(gm, ex):
    if variant != "flat_inductor":
        gm, _ = outline_blocks(gm, min_count=1)
    if variant == "aot_eager":
        return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop)(gm, ex)
    patches = {}
    if variant == "no_inplace":
        patches = {"inplace_buffers": False, "allow_buffer_reuse": False}
    if variant == "no_inplace_only":
        patches = {"inplace_buffers": False}
    if variant == "no_reuse_only":
        patches = {"allow_buffer_reuse": False}
    if variant in ("noreuse_fw", "noreuse_bw"):
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._inductor import config as ic
        def inner(g, inputs, **kw):
            phase_bw = bool(kw.get("is_backward"))
            if phase_bw == (variant == "noreuse_bw"):
                with ic.patch(allow_buffer_reuse=False):
                    return compile_fx_inner(g, inputs, **kw)
            return compile_fx_inner(g, inputs, **kw)
        return compile_fx(gm, ex, inner_compile=inner)
    return compile_fx(gm, ex, config_patches=patches)
l0, g0 = eager_grads()
m, idx, tgt = gpt.make(N)
if variant == "ncr_aot_eager":
    gpt.Block.forward = torch.compiler.nested_compile_region(gpt.Block.forward)
    cm = torch.compile(m, backend="aot_eager")
else:
    cm = torch.compile(m, backend=be)
l = cm(idx, tgt); l.backward()
d = max((p.grad - g0[k]).abs().max().item() for k, p in m.named_parameters())
print(variant, N, "loss diff", (l - l0).abs().item(), "max grad diff", d)

import torch, torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.nn.attention import sdpa_kernel, SDPBackend
class Log(TorchDispatchMode):
    def __init__(s): super().__init__(); s.ops=[]
    def __torch_dispatch__(s, f, t, a=(), k=None):
        s.ops.append(str(f)); return f(*a, **(k or {}))
q = torch.randn(2,4,64,16, requires_grad=True)
for be in [None, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION]:
    m = Log()
    try:
        with m:
            if be is None: o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
            else:
                with sdpa_kernel(be): o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
            o.sum().backward()
        print(be, sorted(set(x for x in m.ops if 'attention' in x or 'softmax' in x or 'bmm' in x or 'matmul' in x)))
    except Exception as e: print(be, "ERR", type(e).__name__, str(e)[:200])
o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, True)
print("cpu flash lse shape", lse.shape, lse.dtype)

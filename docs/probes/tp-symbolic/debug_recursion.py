"""Print the cycle of proxy thunks behind the RecursionError (probe 3, colrow3d backward)."""
import sys, os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch.fx.experimental.proxy_tensor as pt
orig = pt._compute_proxy
stack = []
def traced(tracer, func, args, out):
    stack.append((getattr(func, "__name__", str(func)), [(str(a), id(a), id(getattr(a, "node", None))) for a in args], str(out), id(out), id(getattr(out, "node", None))))
    if len(stack) == 30:
        for s in stack[:12]:
            print("  CYCLE?", s)
    try:
        return orig(tracer, func, args, out)
    finally:
        stack.pop()
pt._compute_proxy = traced
sys.argv = [sys.argv[0], "colrow3d", "--pow", "--cycle"]
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "p3_min_backward.py")).read())

"""One cold compile of the small GPT in a fresh process; prints a JSON line.

python bench.py MODE N OUTFILE
MODE: flat        backend = compile_fx(dynamo_gm)                        (what dynshard does today)
      outlined    backend = outline_blocks(dynamo_gm) -> compile_fx
      aten_flat   backend = make_fx (like dynshard's trace_to_aten) -> compile_fx   (inside a fresh TracingContext)
      aten_outlined  same, outline_blocks on the ATen graph before compile_fx
      ncr         user-level: Block.forward wrapped in torch.compiler.nested_compile_region, backend="inductor"
      per_block   user-level regional compile: each block torch.compile'd (backend="inductor"), rest eager
      stitched    backend: outline, compile ONE block with aot_autograd+inductor, run blocks in a Python loop
      eager
"""
import json, os, sys, tempfile, time

MODE, N, OUT = sys.argv[1], int(sys.argv[2]), sys.argv[3]
FIX = MODE.endswith("_fix")        # outlined_fix, aten_outlined_fix, ncr_fix: apply unalias_subgraph_outputs
MODE = MODE.removesuffix("_fix")
WARM = os.environ.get("KERNEL_CACHE_DIR")
if WARM:   # C++ kernels already compiled in this dir; FX-graph and AOT-autograd caches off: everything else is cold
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = WARM
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
else:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"ind_{MODE}_{N}_")
import torch  # noqa: E402
import torch.fx as fx  # noqa: E402
from torch._inductor.compile_fx import compile_fx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402
from outline import outline_blocks  # noqa: E402

info = {"mode": MODE + ("_fix" if FIX else ""), "N": N, "warm_kernels": bool(WARM)}
graphs = {}


def recording_compile_fx(gm, ex):
    from torch._inductor.compile_fx import compile_fx_inner

    def inner(g, inputs, **kw):
        phase = "bw" if kw.get("is_backward") else "fw"
        nsub = sum(1 for n in g.graph.nodes if n.op == "call_function"
                   and n.target is torch.ops.higher_order.invoke_subgraph)
        subs = {n.target for n in g.graph.nodes if n.op == "get_attr"
                and isinstance(getattr(g, n.target, None), fx.GraphModule)}
        graphs[phase] = {"nodes": len(g.graph.nodes), "invoke_subgraph_calls": nsub, "distinct_subgraphs": len(subs),
                         "subgraph_nodes": sum(len(getattr(g, s).graph.nodes) for s in subs)}
        if FIX:
            from outline import unalias_subgraph_outputs
            graphs[phase]["unaliased_outputs"] = unalias_subgraph_outputs(g)
        return compile_fx_inner(g, inputs, **kw)
    return compile_fx(gm, ex, inner_compile=inner)


def to_aten(gm, ex):
    """Like dynshard.compat.trace_to_aten: make_fx of the Dynamo graph on fakes, node meta preserved."""
    import torch.fx.traceback as fx_traceback
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    fm = FakeTensorMode()
    fakes = [fm.from_tensor(t) for t in ex]

    def run(*args):
        return fx.Interpreter(gm).run(*args)
    functional = torch.func.functionalize(run, remove="mutations")
    with tracing(TracingContext(fm)), fm, fx_traceback.preserve_node_meta():
        return make_fx(functional, tracing_mode="real")(*fakes)


def isolated(fn):
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    with tracing(TracingContext(FakeTensorMode())):
        return fn()


backend_seconds = []


def timed(fn):
    def be(gm, ex):
        t = time.perf_counter()
        out = fn(gm, ex)
        backend_seconds.append(time.perf_counter() - t)
        return out
    return be


def be_flat(gm, ex):
    return recording_compile_fx(gm, ex)


def be_outlined(gm, ex):
    gm, rep = outline_blocks(gm)
    info["outline"] = rep["groups"]
    return recording_compile_fx(gm, ex)


def be_aten(outline):
    def be(gm, ex):
        t = time.perf_counter()
        agm = to_aten(gm, ex)
        info["make_fx_s"] = round(time.perf_counter() - t, 3)
        if outline:
            agm, rep = outline_blocks(agm)
            info["outline"] = rep["groups"]
        return isolated(lambda: recording_compile_fx(agm, ex))
    return be


m, idx, tgt = gpt.make(N)
t0 = time.perf_counter()
if MODE == "flat":
    cm = torch.compile(m, backend=timed(be_flat))
elif MODE == "outlined":
    cm = torch.compile(m, backend=timed(be_outlined))
elif MODE == "aten_flat":
    cm = torch.compile(m, backend=timed(be_aten(False)))
elif MODE == "aten_outlined":
    cm = torch.compile(m, backend=timed(be_aten(True)))
elif MODE == "ncr":
    gpt.Block.forward = torch.compiler.nested_compile_region(gpt.Block.forward)
    cm = torch.compile(m, backend=timed(be_flat) if FIX else "inductor")
elif MODE == "per_block":
    for b in m.blocks:
        b.compile(backend="inductor")
    cm = m
elif MODE == "stitched":
    from stitched import stitched_backend
    cm = torch.compile(m, backend=timed(stitched_backend(info)))
else:
    cm = m
loss = cm(idx, tgt)
t1 = time.perf_counter()
loss.backward()
t2 = time.perf_counter()
info.update(first_fw_s=round(t1 - t0, 3), first_bw_s=round(t2 - t1, 3), first_step_s=round(t2 - t0, 3),
            backend_s=[round(s, 3) for s in backend_seconds], graphs=graphs, loss=loss.item())
# steady state: 3 more steps
for p in m.parameters():
    p.grad = None
ts = []
for _ in range(3):
    t = time.perf_counter()
    cm(idx, tgt).backward()
    ts.append(time.perf_counter() - t)
info["step_s"] = round(min(ts), 4); info["steps"] = [round(x, 3) for x in ts]
for p in m.parameters():
    p.grad = None
loss = cm(idx, tgt)
loss.backward()
torch.save({"loss": loss.detach(), "grads": {k: p.grad for k, p in m.named_parameters()}}, OUT)
# generated code: count kernel definitions in the cache dir's output code
kernels, pyfiles = 0, 0
for root, _, files in ([] if WARM else os.walk(os.environ["TORCHINDUCTOR_CACHE_DIR"])):
    for f in files:
        if f.endswith(".py"):
            src = open(os.path.join(root, f)).read()
            if "async_compile" in src and "def call(" in src:
                pyfiles += 1
                kernels += src.count("= async_compile.cpp_pybinding(")
info["output_code_files"], info["cpp_kernels"] = pyfiles, kernels
try:
    from torch._dynamo.utils import compilation_time_metrics
    info["phases"] = {k: round(sum(v), 2) for k, v in compilation_time_metrics.items() if sum(v) > 0.3}
    info["calls"] = {k: len(v) for k, v in compilation_time_metrics.items()
                     if k in ("invoke_subgraph_proxy_tensor", "invoke_subgraph_trace_joint_graph",
                              "compile_fx_inner", "GraphLowering.run")}
except Exception as e:  # noqa: BLE001
    info["phases"] = str(e)
print("RESULT", json.dumps(info))

"""Probe 2: dynshard tp (plan_ngpus=2, one unit, 2 gloo ranks) on a 2-layer token MLP compiled with dynamic=True,
with monkeypatches (in this process only, nothing in the repo) so that ONE per-rank program is compiled on
Dynamo's symbols: plan at the hints as today, then run the passes again with that plan given on inputs whose
shapes are Dynamo's SymInts, in Dynamo's fake mode, and compile on Dynamo's examples in its tracing context.
usage: python p4_dynshard_symbolic_tp.py [aot_eager|inductor] [--no-patch] [--no-torch-patch] [--lengths 5,6,7,9]"""
import os, sys, traceback, dataclasses, math
os.environ["OMP_NUM_THREADS"] = "1"
import torch
import torch.multiprocessing as mp
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
DIM = 16


class MLP2(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up1, self.down1 = torch.nn.Linear(DIM, 4 * DIM), torch.nn.Linear(4 * DIM, DIM)
        self.up2, self.down2 = torch.nn.Linear(DIM, 4 * DIM), torch.nn.Linear(4 * DIM, DIM)
        self.norm = torch.nn.LayerNorm(DIM)

    def forward(self, x, target):
        x = x + self.down1(torch.nn.functional.gelu(self.up1(x)))
        x = self.norm(x + self.down2(torch.nn.functional.gelu(self.up2(x))))
        return torch.nn.functional.mse_loss(x.mean(dim=1), target)


NOTES = []


def install_patches():
    import dynshard.backend as backend
    from dynshard import compat
    import importlib
    pac_mod = importlib.import_module("dynshard.backend.plan_and_compile")
    from dynshard.passes import LOWER, PLACE, PROPAGATE, REWRITE, PassContext, run_passes
    ps = importlib.import_module("dynshard.passes.propagate_sharding")
    op_memo = importlib.import_module("dynshard.passes.op_memo")
    from dynshard.backend.compile import compile_program
    original_pac = backend.plan_and_compile

    def has_sym(x):
        return any(isinstance(l, (torch.SymInt, torch.SymFloat)) for l in torch.utils._pytree.tree_leaves(x)) \
            or any(isinstance(s, torch.SymInt) for l in torch.utils._pytree.tree_leaves(x)
                   if isinstance(l, torch.Size) or isinstance(l, torch.Tensor) for s in (l if isinstance(l, torch.Size) else l.shape))

    # (1) one program: no per-size builder (backend/shapes.py compiles_per_size)
    backend.compiles_per_size = lambda *a, **k: False
    # (2) DTensor's uncached propagation (compat.dtensor_redistributions asks the lru_cache'd path, which hashes
    #     the schema: SymInts do not hash)
    def dtensor_redistributions(op, args, kwargs):
        from torch.distributed.tensor import DTensor
        d = DTensor._op_dispatcher
        info = d.unwrap_to_op_info(op, args, kwargs)
        sharding = d.sharding_propagator.propagate_op_sharding_non_cached(info.schema)
        if not sharding.needs_redistribute or sharding.redistribute_schema is None:
            return []
        return list(zip(info.schema.args_spec, sharding.redistribute_schema.args_spec))
    compat.dtensor_redistributions = dtensor_redistributions
    # (3) the op memo keys hash DTensorSpecs (their shapes): no key where a shape is symbolic
    original_op_key = ps.op_key
    def op_key(target, args, kwargs):
        key = original_op_key(target, args, kwargs)
        try:
            hash(key)
        except TypeError:
            return None
        return key
    ps.op_key = op_key
    OM = op_memo.OpMemo
    original_input, original_redistribute = OM.input, OM.redistribute
    def memo_input(self, mesh, meta, placements, make):
        try:
            hash(("input", mesh, tuple(meta), placements))
        except TypeError:
            return make(meta, placements)
        return original_input(self, mesh, meta, placements, make)
    def memo_redistribute(self, value, mesh, placements):
        try:
            hash(op_memo._key(value))
        except (TypeError, op_memo._Unkeyable):
            return value.redistribute(mesh, placements)
        return original_redistribute(self, value, mesh, placements)
    OM.input, OM.redistribute = memo_input, memo_redistribute
    # (4) byte counts of collectives read at the hints (math.prod of SymInts)
    original_rc = ps.redistribution_collectives
    def redistribution_collectives(node, layout, shape, itemsize, src, dst):
        return original_rc(node, layout, [compat.size_hint(s) for s in shape], itemsize, src, dst)
    ps.redistribution_collectives = redistribution_collectives
    # (5) check_even_splits does int(SymInt): specialises the frame; a symbolic program would need a
    #     torch._check / guard instead. Skipped here where shapes are symbolic.
    original_ces = ps.check_even_splits
    def check_even_splits(propagation, ctx):
        if any(isinstance(s, torch.SymInt) for inp in ctx.inputs for s in inp.shape):
            NOTES.append("check_even_splits skipped (symbolic)")
            return
        return original_ces(propagation, ctx)
    ps.check_even_splits = check_even_splits

    # (5b) lowering: torch.func.functionalize (C++ functionalization) turns symbolic sizes into guards
    #      (Eq(s, hint): aten.size.default on FakeTensor); Python functionalization keeps them
    tracing = importlib.import_module("dynshard.compat.tracing")
    original_tta = tracing.trace_to_aten
    def trace_to_aten(gm, fake_inputs, fake_mode, decompositions=None):
        if not any(isinstance(s, torch.SymInt) for f in fake_inputs
                   for s in (f.shape if isinstance(f, torch.Tensor) else [f])):
            return original_tta(gm, fake_inputs, fake_mode, decompositions)
        import torch.fx as fx
        import torch.fx.traceback as fx_traceback
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch._subclasses.functional_tensor import dispatch_functionalize
        run = lambda *args: fx.Interpreter(gm).run(*args)
        with tracing.isolated_tracing(fake_mode), fake_mode, fx_traceback.preserve_node_meta():
            return make_fx(dispatch_functionalize(run), decomposition_table=decompositions or {},
                           tracing_mode="real")(*fake_inputs)
    compat.trace_to_aten = trace_to_aten

    # (5c) the sharding interpreter gives every placeholder a DTensor (propagate_sharding.py placeholder ->
    #      make_input), a size input included: a symbolic size must stay its SymInt
    SIZE_VALUES = {}
    original_placeholder = ps.ShardingInterpreter.placeholder
    def placeholder(self, target, args, kwargs):
        index = self._placeholder_index[self._current]
        if index in SIZE_VALUES:
            return SIZE_VALUES[index]
        return original_placeholder(self, target, args, kwargs)
    ps.ShardingInterpreter.placeholder = placeholder

    # (5d) insert_collectives.wrap_input_fn closes over the input's global shape and stride (ints, or here
    #      Dynamo's SymInts, which aot_autograd's tracer never saw: "16 ... is not tracked with proxy"):
    #      where the shape is symbolic, take the global shape from the local tensor's own sizes
    ic = importlib.import_module("dynshard.passes.insert_collectives")
    from torch.distributed.tensor import DTensor
    original_wrap = ic.wrap_input_fn
    def wrap_input_fn(layout, arrival, planned, shape, stride, sync):
        if not any(isinstance(d, torch.SymInt) for d in shape):
            return original_wrap(layout, arrival, planned, shape, stride, sync)
        mesh = layout.tp_mesh
        def wrap_input(local):
            if sync is not None:
                local = ic.sync_over_dp(local, sync)
            if mesh is None:
                return local
            tensor = DTensor.from_local(local, mesh, arrival, run_check=False)   # global shape from local's
            return tensor if tuple(arrival) == tuple(planned) else tensor.redistribute(mesh, planned)
        return wrap_input
    ic.wrap_input_fn = wrap_input_fn

    # (6) plan at the hints as today, then the passes again on the symbols with the plan given
    def plan_and_compile(gm, ctx, device_type, agreement=None, backward=None, example_inputs=()):
        symbolic_tp = ctx.layout.tp_mesh is not None and any(inp.is_symbolic for inp in ctx.inputs) \
            and compat.dynamo_tracing_context() is not None
        if not symbolic_tp:
            return original_pac(gm, ctx, device_type, agreement, backward, example_inputs)
        lowered = run_passes(pac_mod.copy_graph(gm), ctx, LOWER)
        if agreement is not None:
            agreement.receive()
        placed = run_passes(lowered, ctx, PLACE)
        if agreement is not None:
            agreement.send()
        run_passes(placed, ctx, PROPAGATE)          # the plan's records at the hints (explain, cost)
        NOTES.append("planned at hints")
        tc = compat.dynamo_tracing_context()
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        sym_inputs = []
        for inp, node in zip(ctx.inputs, placeholders):
            ev = node.meta.get("example_value")
            if inp.kind == "size":
                sym_inputs.append(dataclasses.replace(inp, value=ev))
            elif inp.is_symbolic:
                sym_inputs.append(dataclasses.replace(inp, shape=ev.shape, stride=tuple(ev.stride())))
            else:
                sym_inputs.append(inp)
        sctx = PassContext(config=ctx.config, outline=ctx.plan, layout=ctx.layout, inputs=sym_inputs,
                           fake_mode=tc.fake_mode, made_for=ctx.made_for, given=ctx.plan, sync_grads=ctx.sync_grads)
        stage = "lower"
        SIZE_VALUES.clear()
        SIZE_VALUES.update({i.index: i.value for i in sym_inputs if i.kind == "size"})
        env = tc.fake_mode.shape_env
        NOTES.append(f"before LOWER: replacements {dict((str(k), str(v)) for k, v in env.replacements.items())} "
                     f"guards {[str(g.expr) for g in env.guards]}")
        NOTES.append("symbolic inputs: " + "; ".join(f"{i.name}:{i.kind}:{tuple(i.shape) if i.kind != 'size' else i.value}"
                                                   for i in sym_inputs if i.is_symbolic))
        NOTES.append("dynamo graph:\n" + gm.code[:6000])
        try:
            g = run_passes(pac_mod.copy_graph(gm), sctx, LOWER)
            NOTES.append("symbolic LOWER ok: " + ", ".join(sorted({str(n.target) for n in g.graph.nodes
                                                                  if "sym" in str(n.target)})))
            NOTES.append(f"after LOWER: replacements {dict((str(k), str(v)) for k, v in env.replacements.items())} "
                         f"guards {[(str(g.expr), str(g.sloc)) for g in env.guards][:6]}")
            NOTES.append("lowered:\n" + g.code[:600])
            stage = "place"; g = run_passes(g, sctx, PLACE)
            stage = "propagate"; g = run_passes(g, sctx, PROPAGATE)
            a, b = sctx.propagation.placements, ctx.propagation.placements
            NOTES.append(f"symbolic PROPAGATE ok; same placements as at hints: {a == b}; nodes only symbolic "
                         f"{sorted(set(a) - set(b))[:8]}, only at hints {sorted(set(b) - set(a))[:8]}, differing "
                         f"{[(k, a[k], b[k]) for k in a if k in b and a[k] != b[k]][:4]}; collectives sym "
                         f"{[(c.node, c.kind, c.bytes) for c in sctx.propagation.collectives]} hints "
                         f"{[(c.node, c.kind, c.bytes) for c in ctx.propagation.collectives]}")
            SIZE_VALUES.clear()
            stage = "rewrite"; g = run_passes(g, sctx, REWRITE)
            NOTES.append("symbolic REWRITE ok")
            stage = "compile"
            local = [pac_mod.local_example(inp, ctx.placements[inp.index], ctx.zero_of(inp), ctx.layout)
                     for inp in ctx.inputs]
            local = pac_mod.symbolic_examples(example_inputs, local)
            c = ctx.config
            program = compile_program(g, local, c.compiler, ctx.layout, c.inference_only, freeze=c.constant_folding,
                                      partition_pass=pac_mod._reshard_pass(sctx), backward=backward,
                                      blocks_only=c.compile_scope == "blocks", share_traces=c.share_traces,
                                      symbolic=True)
            NOTES.append("symbolic compile ok; collectives in the program: "
                         f"{[(c.phase, c.kind, c.shape) for c in program.collectives]}")
        except Exception as e:
            SIZE_VALUES.clear()
            NOTES.append(f"FAILED at symbolic {stage}: {type(e).__name__}: {str(e)[:700]}")
            NOTES.append(traceback.format_exc(limit=-8))
            raise
        SIZE_VALUES.clear()
        program.split_outputs = sctx.split_outputs
        program.outlined = sctx.outlined
        return program
    backend.plan_and_compile = plan_and_compile
    pc = importlib.import_module("dynshard.backend.plan_cache")
    original_get = pc.PlanCache.get
    def get(self, key):
        plan = original_get(self, key)
        NOTES.append(f"PLANS.get({key[:8]}): {'hit' if plan is not None else 'miss'}")
        return plan
    pc.PlanCache.get = get


def main(rank, world, argv):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import copy
    import torch.distributed as dist
    import dynshard
    if "--no-torch-patch" not in argv:
        import torch_patches; torch_patches.patch_all()
    if "--no-patch" not in argv:
        install_patches()
    compiler = argv[0] if argv and not argv[0].startswith("--") else "aot_eager"
    lengths = [5, 6, 7, 9, 12]
    if "--lengths" in argv:
        lengths = [int(v) for v in argv[argv.index("--lengths") + 1].split(",")]
    torch.manual_seed(0)
    gpt = "--gpt" in argv
    if gpt:
        sys.path.insert(0, "/work/main/tests")
        from models import GPT, GPTConfig      # (imported only: nothing under /work/main is written)
        model = GPT(GPTConfig(layers=2, fused_qkv="--fused" in argv))
    else:
        model = MLP2()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", dynamic=True,
                             options=dynshard.Config(policy="tp", plan_ngpus=2, compiler=compiler))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    log = []
    from torch._dynamo.utils import counters
    for step, S in enumerate(lengths):
        g = torch.Generator().manual_seed(step)
        rows = 3 if "--rows3" in argv and step % 2 else 2
        if gpt:
            x = torch.randint(0, 64, (rows, S), generator=g); t = torch.randint(0, 64, (rows, S), generator=g)
        else:
            x, t = torch.randn(rows, S, DIM, generator=g), torch.randn(rows, DIM, generator=g)
        try:
            loss = compiled(x, t)
            loss.backward()
            r = ref(x, t); r.backward()
            opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
            log.append(f"S={S}: loss {loss.item():.6f} ref {r.item():.6f} dynamo graphs "
                       f"{counters['stats']['unique_graphs']}")
        except Exception as e:
            log.append(f"S={S}: FAILED {type(e).__name__}: {str(e)[:600]}")
            break
    try:
        report = dynshard.explain(compiled)
        log.append(f"programs {len(report.programs)}; compiled sizes {[p.compiled_sizes for p in report.programs]}")
        if "-v" in argv and rank == 0:
            log.append(str(report)[:3000])
    except Exception as e:
        log.append(f"explain failed: {type(e).__name__}: {e}")
    if rank == 0:
        print("== argv", argv)
        print("\n".join(log))
        print("--- notes (rank 0)")
        print("\n".join(NOTES))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(2, sys.argv[1:]), nprocs=2, join=True)

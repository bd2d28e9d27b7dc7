"""One benchmark job: one system on one case, in its own process group (launched by bench_gpt.py).

    torchrun --standalone --nproc-per-node 2 benchmarks/gpt_job.py --system dynshard:zero3 --out r.json

The driver gives every job a fresh, empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, so the first
step is what a new user meets: Dynamo, planning, AOTAutograd and Inductor code generation included.
Measured here, on every rank, then reduced (max over ranks) and written by rank 0 as JSON:

- first_step_s: wall time of step 0 (forward, backward, optimizer step), after a barrier;
- step_s: median of --steps steps after --warmup steps (a barrier before each);
- state bytes: parameters + gradients + optimizer state (tensors with at least one dimension) on this
  rank after a step, before zero_grad; DTensors counted by their local shards;
- collectives: dynshard from dynshard.explain (every traced collective, bytes = the larger of input and
  output); peers from one more eager step (forward, backward, optimizer step) under a dispatch mode that
  sees every c10d / _c10d_functional op (DDP's reducer, ZeroRedundancyOptimizer's broadcasts, FSDP2's
  all-gathers and reduce-scatters, DTensor's functional collectives, those DTensor issues inside its own
  dispatch included), bytes counted the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from models import GPT, GPTConfig, LlamaLM, gpt_batch  # noqa: E402

# system -> (dynshard Config fields or None for a peer, plan_ngpus)
DYNSHARD = {
    "dynshard:dp": dict(policy="dp"),
    "dynshard:zero1": dict(policy="dp", use_zero=1),
    "dynshard:zero1rs": dict(policy="dp", use_zero=1, zero_use_reduce_scatter=True),
    "dynshard:zero2": dict(policy="dp", use_zero=2),
    "dynshard:zero3": dict(policy="dp", use_zero=3),
    "dynshard:tp": dict(policy="tp", plan_ngpus=2),     # vocab-parallel embedding, head and cross-entropy
    "dynshard:tpsp": dict(policy="tp", plan_ngpus=2, pas_config={"sequence_parallel": True}),
    "dynshard:tpzero1": dict(policy="tp", plan_ngpus=2, use_zero=1),
    "dynshard:tpzero3": dict(policy="tp", plan_ngpus=2, use_zero=3),
    "dynshard:data": dict(policy="data", plan_ngpus=2),
    "dynshard:dp-recompute": dict(policy="dp", recompute_modules="Block"),
    "dynshard:zero3-recompute": dict(policy="dp", use_zero=3, recompute_modules="Block"),
    "dynshard:tp-recompute": dict(policy="tp", plan_ngpus=2, recompute_modules="Block"),
    "dynshard:tpsp-recompute": dict(policy="tp", plan_ngpus=2, pas_config={"sequence_parallel": True},
                                    recompute_modules="Block"),
    # tp with one kind of its split layers left whole (autodist's tp variants; the GPT's module names)
    "dynshard:tp-wte-whole": dict(policy="tp", plan_ngpus=2, partition_constraints={"wte.weight": "replicate"}),
    "dynshard:tp-attn-whole": dict(policy="tp", plan_ngpus=2, partition_constraints={
        f"blocks.*.attn.{m}.*": "replicate" for m in ("q", "k", "v", "proj")}),
    "dynshard:tp-fc-whole": dict(policy="tp", plan_ngpus=2, partition_constraints={
        "blocks.*.fc1.*": "replicate", "blocks.*.fc2.*": "replicate"}),
    # tp with the activations between split layers split along the batch (sequence parallelism's, on dim 0)
    "dynshard:tp-batch": dict(policy="tp", plan_ngpus=2, pas_config={"batch_parallel": True}),
    # the same kinds on the unit's batch shards, the rest tp with the activations between split along the batch
    "dynshard:tp-attn-batch": dict(policy="tp", plan_ngpus=2, pas_config={"batch_parallel": True},
                                   partition_constraints={f"blocks.*.attn.{m}.*": "replicate"
                                                          for m in ("q", "k", "v", "proj")}),
    "dynshard:tp-fc-batch": dict(policy="tp", plan_ngpus=2, pas_config={"batch_parallel": True},
                                 partition_constraints={"blocks.*.fc1.*": "replicate", "blocks.*.fc2.*": "replicate"}),
    # the plan in the file BENCH_PLAN_FILE names (bench_autodist.py writes the per-op ILP's there)
    "dynshard:plan-file": dict(plan_ngpus=2, load_plan_path=os.environ.get("BENCH_PLAN_FILE")),
    # autodist: its pas_config (the device profile) comes from DYNSHARD_PAS_CONFIG (bench_autodist.py sets it)
    "dynshard:autodist": dict(policy="autodist", plan_ngpus=2),
    "dynshard:autodist-dp": dict(policy="autodist"),
}
# the same with Inductor code for the outlined blocks only (FSDP2 + torch.compile's scope)
DYNSHARD.update({f"{name}-blocks": dict(fields, compile_scope="blocks") for name, fields in list(DYNSHARD.items())})
PEERS = ("ddp", "ddp_zero", "fsdp2", "fsdp2_noreshard", "dtensor_tp", "dtensor_tp_vocab", "dtensor_tp_sp", "tp_fsdp2")
LOSS_PARALLEL = ("dtensor_tp_vocab", "dtensor_tp_sp")     # peers whose steps run under loss_parallel()
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
MODELS = {"gpt": (GPT, "Block"), "llama": (LlamaLM, LlamaLM.BLOCK)}     # -> (class, its repeated block)


def plan_ngpus(system: str) -> int:
    if system in DYNSHARD:
        return DYNSHARD[system].get("plan_ngpus", 1)
    return 2 if system.startswith("dtensor_tp") or system == "tp_fsdp2" else 1


class CollectiveCounter(TorchDispatchMode):
    """Every collective op dispatched while active: (op, bytes = largest tensor among inputs and outputs,
    group size)."""

    def __init__(self):
        super().__init__()
        self.records: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            # as CommDebugMode does: let DTensor run with this mode still active, so that the collectives
            # it issues inside its dispatch (implicit redistributions, loss_parallel's all-reduces, the
            # Partial -> Replicate reduction of a sequence-parallel LayerNorm's gradient) come back here;
            # a mode otherwise runs before the subclass and never sees them
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in COLLECTIVE_NAMESPACES and "wait" not in func.name():
            leaves = tree_leaves((args, kwargs, out))
            sizes = [t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)]
            self.records.append(dict(op=func.name(), bytes=max(sizes, default=0),
                                     group_size=_group_size(leaves)))
        return out


def _group_size(leaves) -> int:
    for leaf in leaves:
        if isinstance(leaf, dist.ProcessGroup):
            return leaf.size()
    for leaf in leaves:
        if isinstance(leaf, str):
            try:
                return dist.distributed_c10d._resolve_process_group(leaf).size()
            except Exception:   # noqa: BLE001 - not a group name
                continue
    return dist.get_world_size()


def kind_of(op: str) -> str:
    for kind in ("all_reduce", "allreduce", "reduce_scatter", "all_gather", "allgather", "broadcast", "all_to_all",
                 "alltoall"):
        if kind in op:
            return {"allreduce": "all_reduce", "allgather": "all_gather", "alltoall": "all_to_all"}.get(kind, kind)
    return None


def wire_bytes(kind: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends for a collective of full size ``nbytes`` on ``n`` ranks (ring algorithms)."""
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n * nbytes


def state_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = list({id(p): p for p in model.parameters()}.values())
    inner = getattr(optimizer, "optim", optimizer)      # ZeroRedundancyOptimizer keeps its shard's state there
    opt = sum(local(v).numel() * local(v).element_size() for state in inner.state.values()
              for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
    return dict(params=sum(local(p).numel() * local(p).element_size() for p in params),
                grads=sum(local(p.grad).numel() * local(p.grad).element_size() for p in params if p.grad is not None),
                optimizer=opt)


def tp_plan(layers: int):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(layers):
        plan.update({f"blocks.{i}.attn.{n}": ColwiseParallel() for n in ("q", "k", "v")})
        plan.update({f"blocks.{i}.attn.proj": RowwiseParallel(), f"blocks.{i}.fc1": ColwiseParallel(),
                     f"blocks.{i}.fc2": RowwiseParallel()})
    return plan


def vocab_plan(layers: int, sequence_parallel: bool):
    """tp_plan plus the vocabulary (torchtitan's plan): the token embedding split along its rows
    (RowwiseParallel: a masked lookup and an all-reduce, or with sequence parallelism a reduce-scatter
    along T) and the tied LM head along the vocabulary, its logits left split (Shard(-1)) for the
    cross-entropy under loss_parallel(). With ``sequence_parallel`` the residual stream between layers
    is split along T (Shard(1)) as torchtitan does it: SequenceParallel LayerNorms, attention's input
    and fc1's input all-gathered, proj and fc2 reduce-scattered."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    plan = tp_plan(layers)
    if not sequence_parallel:
        plan.update({"wte": RowwiseParallel(input_layouts=Replicate()),
                     "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
        return plan
    plan.update({
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        # the one rewrite sequence parallelism needs here (torchtitan's models have no learned position
        # table): wte(idx) is now this rank's [B, T/tp, C] chunk, so wpe(arange(T)) [T, C] must be cut to
        # the same rows; a local chunk forward, an all-gather of its T x C gradient backward
        "wpe": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
        "ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)})
    for i in range(layers):
        plan.update({f"blocks.{i}.ln1": SequenceParallel(), f"blocks.{i}.ln2": SequenceParallel(),
                     f"blocks.{i}.attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                                            desired_input_layouts=(Replicate(),)),
                     f"blocks.{i}.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                     f"blocks.{i}.fc1": ColwiseParallel(input_layouts=Shard(1)),
                     f"blocks.{i}.fc2": RowwiseParallel(output_layouts=Shard(1))})
    return plan


def loss_context(system: str):
    """The context every step (forward and backward) of ``system`` runs in."""
    if system in LOSS_PARALLEL:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def build(system: str, base: GPT, args):
    """(module that owns the parameters, callable to train, optimizer, module for the eager counting step)."""
    world = dist.get_world_size()
    model = copy.deepcopy(base)
    adamw = dict(lr=1e-4)
    if system in DYNSHARD:
        import dynshard

        fields = dict(DYNSHARD[system])
        if fields.get("recompute_modules") == "Block":
            fields["recompute_modules"] = MODELS[args.model][1]
        compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(**fields))
        return model, compiled, torch.optim.AdamW(model.parameters(), **adamw), None
    if system in ("ddp", "ddp_zero"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        if system == "ddp":
            opt = torch.optim.AdamW(ddp.parameters(), **adamw)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
        return model, torch.compile(ddp), opt, ddp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if system in ("fsdp2", "fsdp2_noreshard"):
        reshard = system == "fsdp2"
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        return model, torch.compile(model), torch.optim.AdamW(model.parameters(), **adamw), model
    from torch.distributed.tensor.parallel import parallelize_module

    tp = plan_ngpus(system)
    for block in model.blocks:
        block.attn.heads //= tp             # the rewrite DTensor TP needs: the local head count
    if system == "dtensor_tp":
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, tp_plan(args.layers))
    elif system in LOSS_PARALLEL:
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, vocab_plan(args.layers, sequence_parallel=system == "dtensor_tp_sp"))
        # parallelize_module distributes wte.weight and lm_head.weight one module at a time, each into a new
        # Parameter: the tie breaks into two Shard(0) DTensors; tie them again (the same rows on each rank)
        model.lm_head.weight = model.wte.weight
        # The whole model is compiled, the cross-entropy over the Shard(-1) logits included (GPT.forward
        # computes it): loss_context() (loss_parallel) is entered around every forward and backward
        # (train(), eager and compiled), so Dynamo traces DTensor's loss ops with it active.
    elif system == "tp_fsdp2":
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan(args.layers))
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        raise SystemExit(f"unknown system {system!r}; known: {', '.join([*DYNSHARD, *PEERS])}")
    return model, torch.compile(model), torch.optim.AdamW(model.parameters(), **adamw), model


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and step-count flags, shared with the driver (bench_gpt.py)."""
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8, help="global batch (split over the data-parallel units)")
    parser.add_argument("--model", choices=MODELS, default="gpt",
                        help="gpt (tests/models.py) or llama (transformers' LlamaForCausalLM at the same sizes; "
                             "dynshard systems only)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", required=True)
    add_run_arguments(parser)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = plan_ngpus(args.system)
    dp_rank, dp_size = rank // tp, world // tp
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, heads=args.heads, layers=args.layers)
    base = MODELS[args.model][0](cfg)
    per_unit = args.batch // dp_size

    def batch_for(i):                   # the ranks of one plan unit read the same rows
        idx, tgt = gpt_batch(cfg, args.batch, i)
        return idx[dp_rank * per_unit:(dp_rank + 1) * per_unit], tgt[dp_rank * per_unit:(dp_rank + 1) * per_unit]

    setup_start = time.perf_counter()
    model, train, opt, eager = build(args.system, base, args)
    setup_s = time.perf_counter() - setup_start

    def step(i, fn=train, measure=None):
        with loss_context(args.system):         # loss_parallel(): forward and backward inside it
            loss = fn(*batch_for(i))
            loss.backward()
        opt.step()
        if measure is not None:
            measure.update(state_bytes(model, opt))
        opt.zero_grad(set_to_none=True)
        return loss

    dist.barrier()
    start = time.perf_counter()
    step(0)
    first = time.perf_counter() - start
    for i in range(1, args.warmup):
        step(i)
    times = []
    memory: dict[str, int] = {}
    for i in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        loss = step(args.warmup + i, measure=memory if i == args.steps - 1 else None)
        times.append(time.perf_counter() - start)

    if args.system in DYNSHARD:
        import dynshard

        report = dynshard.explain(train)
        sizes = {"tp": tp, "dp": dp_size, "zero": dp_size, "zero_replicas": 1}
        collectives = [dict(op=c.kind, kind=c.kind, phase=c.phase, group=c.group, bytes=c.bytes,
                            group_size=sizes.get(c.group, world)) for c in report.collectives()]
        plans = {id(plan): plan for p in model.parameters() if (tag := dynshard.runtime.sharding.get_tag(p))
                 for ref in tag.plans if (plan := ref()) is not None}
        extra = dict(fallbacks=[f for p in report.programs for f in p.fallbacks], programs=len(report.programs),
                     plan_compile_s=[p.compile_seconds for p in report.programs],
                     pass_s=[dict(plan.pass_timings) for plan in plans.values()])
        explain_text = str(report)
    else:
        counter = CollectiveCounter()
        with counter:
            step(args.warmup + args.steps, fn=eager)
        collectives = [dict(r, kind=kind_of(r["op"])) for r in counter.records if kind_of(r["op"])]
        extra, explain_text = {}, ""
    for c in collectives:
        c["wire_bytes"] = wire_bytes(c["kind"], c["bytes"], c["group_size"])

    from torch._dynamo.utils import compile_times, counters

    extra["compile_times"] = compile_times(repr="str") if rank == 0 else ""
    extra["cache_counters"] = {k: v for k, v in counters["inductor"].items() if "cache" in k} if rank == 0 else {}
    extra["graphs_compiled"] = counters["stats"].get("unique_graphs", 0) if rank == 0 else 0
    mine = dict(first_step_s=first, step_s=statistics.median(times), setup_s=setup_s, memory=memory,
                loss=float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()))
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        result = dict(
            system=args.system, world=world, plan_ngpus=tp, config=vars(args), torch=torch.__version__,
            first_step_s=max(r["first_step_s"] for r in everyone),
            step_s=max(r["step_s"] for r in everyone),
            setup_s=max(r["setup_s"] for r in everyone),
            state_bytes=max(sum(r["memory"].values()) for r in everyone),
            state_bytes_by_rank=[r["memory"] for r in everyone],
            losses=[r["loss"] for r in everyone],
            comm_bytes=sum(c["bytes"] for c in collectives),
            comm_wire_bytes=sum(c["wire_bytes"] for c in collectives),
            comm_count=len(collectives), collectives=collectives,
            explain=explain_text, **extra)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

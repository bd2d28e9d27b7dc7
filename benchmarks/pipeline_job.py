"""One pipeline benchmark job: one system in its own process group (launched by bench_pipeline.py).

    torchrun --standalone --nproc-per-node 2 benchmarks/pipeline_job.py --system pp:dynshard:1f1b --out r.json
    torchrun --standalone --nproc-per-node 2 benchmarks/pipeline_job.py --system pp:torch:1f1b \\
        --stages "wte,wpe,blocks.0,blocks.1;blocks.2,blocks.3,ln_f,lm_head" --out r.json

Systems (``pp:<who>:<schedule>[:traced]``):

- ``pp:dynshard:<gpipe|1f1b|1f1b_interleaved>``: tests' EndToEndGPT (the GPT of tests/models.py, tied embedding
  and LM head, its forward returning the mean cross-entropy of one sample) compiled with
  ``policy="pp"``, ``plan_ngpus`` = world size, and trained with ``dynshard.train_step(model, samples)``;
  ``:traced`` adds ``Config(trace_dir=...)`` and reads the idle fraction of every steady step from the trace
  files. The stages' modules (``dynshard.explain(model).pipelines[0].stages[i].modules``) go into the JSON.
- ``pp:torch:1f1b``: torch.distributed.pipelining's ``Schedule1F1B`` over one ``PipelineStage`` per rank whose
  submodule is the same GPT's modules listed by ``--stages`` (the cut dynshard chose), ``torch.compile``d,
  with static ``input_args`` / ``output_args`` (meta tensors; activations ``requires_grad``) so that no eager
  shape inference runs. ``loss_fn`` is the mean cross-entropy of one micro-batch (torch.compile'd too).

The same work on both sides: m micro-batches of batch / m rows; gradient = the sum over the micro-batches of
d(mean cross-entropy of the micro-batch) (dynshard's train_step semantics; torch with ``scale_grads=False``);
the tied embedding / LM head's gradient summed over the two ranks that hold it after the last backward
(dynshard does that in reduce_gradients; for torch this job all-reduces it); then AdamW (lr 1e-4) on each
rank's parameters and zero_grad. One step = all of that, timed after a barrier, as in gpt_job.py.

Written by rank 0 (JSON): first_step_s and step_s (median of --steps after --warmup), max over ranks;
step_min_s (the fastest timed step, max over ranks: the least disturbed by other work on the machine);
step_cpu_s (CPU seconds of a step, time.process_time, median per rank summed over ranks: the work done,
whatever the load); the losses of every step; dynshard: explain's idle fraction after every timed step and
the stages; traced: every steady step of every rank's trace file (trace_steps).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from gpt_job import add_run_arguments  # noqa: E402
from models import GPT, GPTConfig, gpt_batch  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "1f1b_interleaved", "zb1p")
# not schedules: the same training step (train_step over --micro-batches samples) under another policy
POLICIES = {"autodist": "autodist", "tp": "tp", "data": "data"}
LR = 1e-4


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """The pipeline flags, shared with the driver (bench_pipeline.py)."""
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (pipeline_nmicros)")
    parser.add_argument("--chunks", type=int, default=2, help="stages per rank of 1f1b_interleaved")
    parser.add_argument("--device-profile", default=None, help="pp:dynshard:autodist: the dynshard.calibrate file")
    parser.add_argument("--compiler", default="inductor", choices=("inductor", "aot_eager"),
                        help="dynshard's Config.compiler and the backend of torch's torch.compile")


def parse_system(system: str) -> tuple[str, str, bool]:
    """'pp:dynshard:1f1b:traced' -> ('dynshard', '1f1b', True)."""
    parts = system.split(":")
    if len(parts) not in (3, 4) or parts[0] != "pp" or parts[1] not in ("dynshard", "torch") \
            or parts[2] not in SCHEDULES + tuple(POLICIES) or (len(parts) == 4 and parts[3] != "traced") \
            or (parts[1] == "torch" and (parts[2] != "1f1b" or len(parts) == 4)):
        raise SystemExit(f"unknown system {system!r}: pp:dynshard:<{'|'.join(SCHEDULES + tuple(POLICIES))}>[:traced] "
                         "or pp:torch:1f1b")
    return parts[1], parts[2], len(parts) == 4


def analytic_bubble(schedule: str, p: int, m: int, v: int) -> float:
    """Idle over total of a pipeline with p ranks, m micro-batches, v stages per rank (memo section 5)."""
    return (p - 1) / (v * m + p - 1) if schedule == "1f1b_interleaved" else (p - 1) / (m + p - 1)


# -- dynshard ----------------------------------------------------------------------------------------------
def build_dynshard(cfg: GPTConfig, schedule: str, args, world: int):
    import dynshard
    from workers_pipeline import EndToEndGPT

    torch.manual_seed(0)
    model = EndToEndGPT(cfg)
    pas = {"pipeline_nmicros": args.micro_batches, "pipeline_scheduler": schedule}
    if schedule == "1f1b_interleaved":
        pas["pipeline_nchunks"] = args.chunks
    policy = POLICIES.get(schedule, "pp")
    if policy == "autodist":
        pas = {"explore_pipeline": True, "update_freq": args.micro_batches}
        if args.device_profile:
            pas["device_profile"] = args.device_profile
    elif policy != "pp":
        pas = {}
    config = dynshard.Config(policy=policy, plan_ngpus=world, use_end2end=True, compiler=args.compiler,
                             pas_config=pas, trace_dir=args.trace_dir if policy == "pp" else None)
    compiled = torch.compile(model, backend="dynshard", options=config)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(samples):
        losses = dynshard.train_step(compiled, [{"idx": idx, "tgt": tgt} for idx, tgt in samples])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return [float(v) for v in losses]

    return compiled, step


def dynshard_report(compiled) -> dict:
    import dynshard

    explained = dynshard.explain(compiled)
    chosen = [p.predicted.autodist.chosen for p in explained.plans if p.predicted.autodist is not None]
    if not explained.pipelines:         # tp, data, or autodist's choice of either
        return dict(chosen=chosen[0] if chosen else None, explain=str(explained))
    report = explained.pipelines[0]
    return dict(stage_modules=[list(s.modules) for s in report.stages], stage_ranks=[list(s.ranks) for s in report.stages],
                stage_flops=[s.flops for s in report.stages], grid=report.grid, p2p_bytes=report.p2p_bytes,
                sent_bytes=report.sent_bytes, compile_seconds=report.compile_seconds, explain=str(report),
                chosen=chosen[0] if chosen else None)


# -- torch.distributed.pipelining ------------------------------------------------------------------------
class StageModule(nn.Module):
    """The GPT's modules ``names`` (consecutive in GPT.forward's order) as one pipeline stage."""

    def __init__(self, model: GPT, names: list[str]):
        super().__init__()
        self.names = list(names)
        self.parts = nn.ModuleList(model.get_submodule(n) for n in self.names if n != "wpe")
        self.wpe = model.wpe if "wpe" in self.names else None

    def forward(self, x):
        parts = iter(self.parts)
        for name in self.names:
            if name == "wpe":
                continue
            part = next(parts)
            if name == "wte":       # GPT.forward: x = wte(idx) + wpe(arange(T))
                x = part(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
            else:
                x = part(x)
        return x


def check_cut(cut: list[list[str]], layers: int) -> None:
    order = ["wte", "wpe"] + [f"blocks.{i}" for i in range(layers)] + ["ln_f", "lm_head"]
    if [n for stage in cut for n in stage] != order:
        raise SystemExit(f"--stages {cut} must list {order} in order (GPT.forward's)")


def default_cut(layers: int) -> list[list[str]]:
    half = layers // 2
    return [["wte", "wpe"] + [f"blocks.{i}" for i in range(half)],
            [f"blocks.{i}" for i in range(half, layers)] + ["ln_f", "lm_head"]]


def build_torch(cfg: GPTConfig, args, world: int, rank: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    cut = [s.split(",") for s in args.stages.split(";")] if args.stages else default_cut(cfg.layers)
    check_cut(cut, cfg.layers)
    if len(cut) != world:
        raise SystemExit(f"Schedule1F1B runs one stage per rank: {len(cut)} stages for {world} ranks")
    torch.manual_seed(0)
    model = GPT(cfg)
    module = StageModule(model, cut[rank])
    mb = args.batch // args.micro_batches
    act = torch.empty(mb, cfg.seq, cfg.d_model, device="meta", requires_grad=True)
    first, last = rank == 0, rank == world - 1
    inputs = torch.empty(mb, cfg.seq, dtype=torch.long, device="meta") if first else act
    outputs = torch.empty(mb, cfg.seq, cfg.vocab, device="meta", requires_grad=True) if last else act
    stage = PipelineStage(torch.compile(module, backend=args.compiler), rank, world, torch.device("cpu"),
                          input_args=(inputs,), output_args=(outputs,))

    def cross_entropy(logits, tgt):      # the mean over one micro-batch's tokens, as GPT.forward
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    schedule = Schedule1F1B(stage, n_microbatches=args.micro_batches,
                            loss_fn=torch.compile(cross_entropy, backend=args.compiler), scale_grads=False)
    params = list(module.parameters())
    # parameters two stages read (the tied wte / lm_head weight): their gradient is summed over the ranks
    # that hold them after the last backward, as dynshard's reduce_gradients does
    readers: dict[int, set[int]] = {}
    for s, names in enumerate(cut):
        for n in names:
            for p in model.get_submodule(n).parameters():
                readers.setdefault(id(p), set()).add(s)
    tied = []
    for p in model.parameters():
        owners = sorted(readers.get(id(p), ()))
        if len(owners) > 1:
            group = dist.group.WORLD if len(owners) == world else dist.new_group(owners)
            if rank in owners:
                tied.append((p, group))
    opt = torch.optim.AdamW(params, lr=LR)

    def step(samples):
        idx = torch.cat([i for i, _ in samples])
        tgt = torch.cat([t for _, t in samples])
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(idx, return_outputs=False)
        else:
            schedule.step(target=tgt, losses=losses, return_outputs=False)
        for p, group in tied:
            dist.all_reduce(p.grad, group=group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return [float(v.detach()) for v in losses] if last else None

    return cut, step, stage


# -- the trace files -----------------------------------------------------------------------------------
_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")
_STEP = re.compile(r"^step (\d+) ")


def trace_steps(path: str, first_step: int) -> list[dict]:
    """Per step >= first_step in one rank's trace: wall (the step event's dur), busy (forward + backward
    spans inside it), idle = 1 - busy / wall (dynshard's idle_fraction), recv wait (the "recv" spans; the
    executor waits for a receive inside the F or B that consumes it, so these lie inside compute spans),
    idle_net = 1 - (busy - recv) / wall, tail (the step's end after its last compute span: waiting for
    sends, the tied-gradient all-reduce, the loss broadcast) and the compute spans by kind and stage, each
    less the recv wait inside it."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    steps = []
    for e in events:
        if e["cat"] != "step" or int(_STEP.match(e["name"]).group(1)) < first_step:
            continue
        begin, end = e["ts"], e["ts"] + e["dur"]
        inside = [x for x in events if x["cat"] != "step" and begin <= x["ts"] and x["ts"] + x["dur"] <= end + 1]
        compute = [x for x in inside if x["cat"] in ("forward", "backward")]
        recvs = [x for x in inside if x["cat"] == "recv"]
        busy = sum(x["dur"] for x in compute)
        spans: dict[str, list[float]] = {}
        for x in compute:
            waited = sum(r["dur"] for r in recvs
                         if x["ts"] <= r["ts"] and r["ts"] + r["dur"] <= x["ts"] + x["dur"] + 1)
            kind_stage = _ACTION.match(x["name"])
            spans.setdefault(f"{kind_stage.group(2)}{kind_stage.group(1)}", []).append((x["dur"] - waited) / 1e6)
        recv = sum(x["dur"] for x in recvs)
        last_compute = max((x["ts"] + x["dur"] for x in compute), default=begin)
        steps.append(dict(step=int(_STEP.match(e["name"]).group(1)), name=e["name"], wall_s=e["dur"] / 1e6,
                          busy_s=busy / 1e6, idle=1.0 - busy / e["dur"], recv_s=recv / 1e6,
                          idle_net=1.0 - (busy - recv) / e["dur"], tail_s=(end - last_compute) / 1e6,
                          spans=spans))
    return steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", required=True)
    add_run_arguments(parser)
    add_pipeline_arguments(parser)
    parser.add_argument("--stages", default="", help="torch: the cut, module paths per stage: 'a,b;c,d'")
    parser.add_argument("--trace-dir", default=None, help="traced dynshard systems: where the traces go")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    who, schedule, traced = parse_system(args.system)
    if not traced:
        args.trace_dir = None
    elif not args.trace_dir:
        args.trace_dir = os.path.join(os.path.dirname(os.path.abspath(args.out)), "traces",
                                      args.system.replace(":", "_"))
    if args.batch % args.micro_batches:
        raise SystemExit(f"--batch {args.batch} must divide into --micro-batches {args.micro_batches}")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if traced and rank == 0:
        for r in range(world):          # a previous run's files
            path = os.path.join(args.trace_dir, f"dynshard_trace_rank{r}.json")
            if os.path.exists(path):
                os.remove(path)
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, heads=args.heads, layers=args.layers)
    mb = args.batch // args.micro_batches

    def samples(i):                     # the same micro-batches for every system
        idx, tgt = gpt_batch(cfg, args.batch, i)
        return [(idx[j * mb:(j + 1) * mb], tgt[j * mb:(j + 1) * mb]) for j in range(args.micro_batches)]

    setup_start = time.perf_counter()
    if who == "dynshard":
        compiled, step = build_dynshard(cfg, schedule, args, world)
        extra = {}
    else:
        cut, step, stage = build_torch(cfg, args, world, rank)
    setup_s = time.perf_counter() - setup_start

    dist.barrier()
    start = time.perf_counter()
    losses = [step(samples(0))]
    first = time.perf_counter() - start
    for i in range(1, args.warmup):
        losses.append(step(samples(i)))
    times, cpu, idle = [], [], []
    for i in range(args.steps):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        losses.append(step(samples(args.warmup + i)))
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        if who == "dynshard":           # the latest step's idle fraction, outside the timed window
            import dynshard

            pipelines = dynshard.explain(compiled).pipelines
            idle.append(pipelines[0].idle_fraction if pipelines else None)
    # dynshard: where it cut; torch: the cut it was given, and STATIC when no eager shape inference ran
    extra = dynshard_report(compiled) if who == "dynshard" else dict(
        stage_modules=cut, metadata_mode=str(getattr(stage, "_inference_mode", None)))

    mine = dict(first_step_s=first, step_s=statistics.median(times), step_times=times, cpu_times=cpu,
                setup_s=setup_s, losses=losses, explain_idle=idle)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    dist.barrier()                      # every rank's trace file is complete
    if rank == 0:
        per_step_losses = next(r["losses"] for r in reversed(everyone) if r["losses"][0] is not None)
        result = dict(
            system=args.system, who=who, schedule=schedule, traced=traced, world=world, config=vars(args),
            torch=torch.__version__, first_step_s=max(r["first_step_s"] for r in everyone),
            step_s=max(r["step_s"] for r in everyone), setup_s=max(r["setup_s"] for r in everyone),
            step_times_by_rank=[r["step_times"] for r in everyone],
            step_min_s=max(min(r["step_times"]) for r in everyone),
            cpu_times_by_rank=[r["cpu_times"] for r in everyone],
            step_cpu_s=sum(statistics.median(r["cpu_times"]) for r in everyone),
            losses=per_step_losses, final_loss=statistics.fmean(per_step_losses[-1]),
            explain_idle_by_rank=[r["explain_idle"] for r in everyone],
            stages_per_rank=args.chunks if schedule == "1f1b_interleaved" else 1,
            analytic_bubble=analytic_bubble(schedule, world, args.micro_batches,
                                            args.chunks if schedule == "1f1b_interleaved" else 1), **extra)
        if traced:
            result["trace_dir"] = args.trace_dir
            result["trace_by_rank"] = [trace_steps(os.path.join(args.trace_dir, f"dynshard_trace_rank{r}.json"),
                                                   args.warmup) for r in range(world)]
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

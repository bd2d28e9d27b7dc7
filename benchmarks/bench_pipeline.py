"""dynshard's pipeline policy on 2 CPU ranks (gloo): against torch.distributed.pipelining, and its bubbles
against the formulas. One job per system (own torchrun, own process group, empty Inductor caches: bench_gpt's
run_job), then two tables:

    python benchmarks/bench_pipeline.py                              # Inductor, the GPT below, 20 timed steps
    python benchmarks/bench_pipeline.py --repeat 2 --steps 40        # the compare pair twice, alternating
    python benchmarks/bench_pipeline.py --compiler aot_eager --steps 5 --warmup 2    # a quick look
    python benchmarks/bench_pipeline.py --parts bubbles --vocab 256 \\
        --out benchmarks/results/pipeline_cpu_vocab256.json         # stages of equal cost (a small LM head)

The GPT: 4 layers, d_model 256, 4 heads, seq 128, vocab 4096, batch 8 in 4 micro-batches of 2 (the flags
of bench_gpt's gpt_job.add_run_arguments and pipeline_job.add_pipeline_arguments).

1. compare: dynshard policy="pp", pipeline_scheduler "1f1b", driven by dynshard.train_step(model, samples),
   against torch's Schedule1F1B over one PipelineStage per rank, each a torch.compile'd submodule holding the
   modules dynshard put in that stage (read from the dynshard job's explain, passed to the torch job), with
   static input_args / output_args (no eager shape inference: the job records torch's metadata mode). Same
   GPT (tests/models.py: tied embedding / LM head), same micro-batches, same loss and gradient semantics
   (see pipeline_job.py), AdamW on both.
2. bubbles: dynshard's gpipe, 1f1b and 1f1b_interleaved (--chunks stages per rank) with Config(trace_dir=...):
   each rank's idle fraction of every steady step from its trace file, against the analytic bubble
   (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1); and dynshard.runtime.pipeline.simulate's prediction with the
   measured mean forward / backward span times as its cost model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_gpt import align, load_average, provenance, publish, run_job  # noqa: E402
from gpt_job import add_run_arguments  # noqa: E402
from pipeline_job import SCHEDULES, add_pipeline_arguments  # noqa: E402

RANKS = 2
COMPARE = ("pp:dynshard:1f1b", "pp:torch:1f1b")

NOTES = """\
compare: setup s: building the model wrapper (torch.compile / PipelineStage / Schedule1F1B, imports); first s:
  step 0 (all micro-batches' forward and backward, the tied gradient's all-reduce, AdamW) with empty Inductor
  caches, max over ranks; step s: median of the timed steps after warm-up (a barrier before each), max over
  ranks; min s: the fastest timed step (max over ranks), the least disturbed by other work on the machine;
  cpu s: CPU seconds of a step (process_time: compute, gloo's threads, Python), median per rank, summed over
  ranks: the work done, whatever the load. x: dynshard / torch of the same run (--repeat: the pair again,
  alternating). final loss: mean of the last step's micro-batch losses (both runs see the same data from the
  same initial weights, so they agree to rounding). cut: the modules of each stage (rank 0 | 1).
bubbles: one traced job per schedule. Per rank, over the steady steps (after warm-up): step s: the step's wall
  time in the trace (train_step's schedule, the tied-gradient all-reduce and the loss broadcast; not the
  optimizer); idle: 1 - (forward + backward spans) / step wall, what dynshard reports (explain's
  idle_fraction; "explain" is its mean over the same steps); idle net: the same with the time each F/B
  spends blocked in a receive (the "recv" spans inside it) counted as idle; x: idle / analytic; recv s: that
  blocked time; tail s: the step's end after the rank's last compute (sends, all-reduce, broadcast).
  sim: dynshard.runtime.pipeline.simulate.simulate(schedule, f, b) with f, b the mean net F and B spans of
  that job (all stages alike, no communication time): the bubble it predicts (all ranks), this rank's idle
  and the step's length. uneven idle (one stage per rank): this rank's idle if the step lasted exactly
  m * max_s(t_s) + the other stages' t_s, t_s = stage s's mean net F + B: the bubble the uneven cut implies.
  On 2 cores with 2 ranks, a span may include time the core was busy with the other rank's work."""


def pipeline_flags(args) -> tuple[str, ...]:
    return ("--micro-batches", str(args.micro_batches), "--chunks", str(args.chunks), "--compiler", args.compiler)


def compare_table(pairs: list[tuple[dict, dict]]) -> tuple[str, dict]:
    """One row per job (dynshard, then torch, for each repeat); ratios dynshard / torch of the same repeat."""
    header = ("run", "system", "cut", "setup s", "first s", "first x", "step s", "step x", "min s", "min x",
              "cpu s", "cpu x", "final loss", "load")
    lines = [header]
    ratios = []
    for run, (ours, peer) in enumerate(pairs):
        ok = "error" not in ours and "error" not in peer
        if ok:
            ratios.append(dict(first_ratio=ours["first_step_s"] / peer["first_step_s"],
                               step_ratio=ours["step_s"] / peer["step_s"],
                               min_ratio=ours["step_min_s"] / peer["step_min_s"],
                               cpu_ratio=ours["step_cpu_s"] / peer["step_cpu_s"],
                               final_loss_diff=ours["final_loss"] - peer["final_loss"]))
        for r, name in ((ours, "dynshard pp 1f1b + train_step"), (peer, "torch Schedule1F1B + compiled stages")):
            if "error" in r:
                lines.append((str(run), name, "failed: " + r["error"]) + ("",) * (len(header) - 3))
                continue
            mine = r is ours and ok
            lines.append((str(run), name, " | ".join(",".join(s) for s in r["stage_modules"]), f"{r['setup_s']:.1f}",
                          f"{r['first_step_s']:.1f}", f"{ratios[-1]['first_ratio']:.2f}" if mine else "-",
                          f"{r['step_s']:.3f}", f"{ratios[-1]['step_ratio']:.2f}" if mine else "-",
                          f"{r['step_min_s']:.3f}", f"{ratios[-1]['min_ratio']:.2f}" if mine else "-",
                          f"{r['step_cpu_s']:.3f}", f"{ratios[-1]['cpu_ratio']:.2f}" if mine else "-",
                          f"{r['final_loss']:.6f}", f"{r['load_before'][0]:.1f}/{r['load_after'][0]:.1f}"))
    summary = dict(runs=ratios)
    if ratios:
        summary.update({k: statistics.median(r[k] for r in ratios)
                        for k in ("first_ratio", "step_ratio", "min_ratio", "cpu_ratio")},
                       final_loss_diff=max(abs(r["final_loss_diff"]) for r in ratios))
    return align(lines), summary


def bubble_rows(result: dict) -> list[dict]:
    """Per rank of one traced job: the measured idle fractions, the formula, and simulate's prediction."""
    from dynshard.runtime.pipeline.schedules import build_schedule
    from dynshard.runtime.pipeline.simulate import simulate

    schedule, p, v = result["schedule"], result["world"], result["stages_per_rank"]
    m = result["config"]["micro_batches"]
    spans = {"F": [], "B": []}
    for steps in result["trace_by_rank"]:
        for step in steps:
            for key, values in step["spans"].items():
                spans[key[0]] += values
    f, b = statistics.fmean(spans["F"]), statistics.fmean(spans["B"])
    sim = simulate(build_schedule(schedule, p * v, m, p), f=f, b=b)
    analytic = result["analytic_bubble"]
    # one stage per rank: with each stage's measured F + B (t_s, per micro-batch) and no overhead, the step
    # lasts m * max(t) + the other stages' t (fill and drain), and rank r idles 1 - m t_r / that
    per_stage = [0.0] * (p * v)
    for steps in result["trace_by_rank"]:
        for key, values in {k: [x for s in steps for x in s["spans"].get(k, [])]
                            for k in {k for s in steps for k in s["spans"]}}.items():
            per_stage[int(key[1:])] += statistics.fmean(values)
    makespan = m * max(per_stage) + sum(per_stage) - max(per_stage)
    rows = []
    for rank, steps in enumerate(result["trace_by_rank"]):
        idle = [s["idle"] for s in steps]
        net = [s["idle_net"] for s in steps]
        explain = result["explain_idle_by_rank"][rank]
        rows.append(dict(
            schedule=schedule, rank=rank, p=p, v=v, m=m, steps=len(steps),
            step_s=statistics.median(s["wall_s"] for s in steps), idle=idle, idle_net=net, explain_idle=explain,
            idle_mean=statistics.fmean(idle), idle_net_mean=statistics.fmean(net), analytic=analytic,
            ratio=statistics.fmean(idle) / analytic, ratio_net=statistics.fmean(net) / analytic,
            recv_s=statistics.fmean(s["recv_s"] for s in steps), tail_s=statistics.fmean(s["tail_s"] for s in steps),
            f_mean_s=f, b_mean_s=b, sim_bubble=sim.bubble_fraction, sim_idle=sim.idle[rank] / sim.makespan,
            sim_makespan_s=sim.makespan, uneven_idle=1 - m * per_stage[rank] / makespan if v == 1 else None,
            spans_by_stage={key: statistics.fmean(x for s in steps for x in s["spans"].get(key, [])) for key in
                            sorted({k for s in steps for k in s["spans"]}, key=lambda k: (int(k[1:]), k[0]))}))
    return rows


def bubble_table(rows: list[dict]) -> str:
    header = ("schedule", "p", "v", "m", "rank", "step s", "idle", "(min-max)", "explain", "idle net", "analytic",
              "x", "x net", "recv s", "tail s", "f s", "b s", "sim bubble", "sim idle", "sim step s",
              "uneven idle")
    lines = [header]
    for r in rows:
        lines.append((r["schedule"], str(r["p"]), str(r["v"]), str(r["m"]), str(r["rank"]), f"{r['step_s']:.3f}",
                      f"{r['idle_mean']:.1%}", f"{min(r['idle']):.1%}-{max(r['idle']):.1%}",
                      f"{statistics.fmean(r['explain_idle']):.1%}" if r["explain_idle"] else "-",
                      f"{r['idle_net_mean']:.1%}", f"{r['analytic']:.1%}", f"{r['ratio']:.2f}",
                      f"{r['ratio_net']:.2f}", f"{r['recv_s']:.3f}", f"{r['tail_s']:.3f}", f"{r['f_mean_s']:.3f}",
                      f"{r['b_mean_s']:.3f}", f"{r['sim_bubble']:.1%}", f"{r['sim_idle']:.1%}",
                      f"{r['sim_makespan_s']:.3f}",
                      f"{r['uneven_idle']:.1%}" if r["uneven_idle"] is not None else "-"))
    return align(lines)


def span_table(rows: list[dict]) -> str:
    """Mean net compute span per stage (F, B), seconds: how even the stages are."""
    lines = [("schedule", "rank", "mean span s per stage (recv wait taken out)")]
    for r in rows:
        lines.append((r["schedule"], str(r["rank"]),
                      "  ".join(f"{k}={v:.4f}" for k, v in r["spans_by_stage"].items())))
    return align(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="compare,bubbles", help="comma-separated: compare, bubbles")
    add_run_arguments(parser)
    add_pipeline_arguments(parser)
    parser.add_argument("--repeat", type=int, default=1, help="compare: run the dynshard / torch pair this often")
    parser.add_argument("--job-timeout", type=float, default=1800, help="seconds per job")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "pipeline_cpu.json"),
                        help="the results (JSON); the tables are written beside it (.txt), the jobs under its "
                             "folder's jobs/ and logs/, the traces under traces/")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - {"compare", "bubbles"}:
        raise SystemExit(f"unknown part(s) in --parts {args.parts!r}; choose from compare, bubbles")
    results_dir = os.path.dirname(os.path.abspath(args.out))
    load_start = load_average()
    flags = pipeline_flags(args)
    out: dict = {"config": vars(args), **provenance(), "load_start": load_start}
    texts = []
    if "compare" in parts:
        pairs, cut = [], None
        for _ in range(args.repeat):        # alternate the two, so that both see the machine's load alike
            ours = run_job(COMPARE[0], RANKS, args, results_dir, job="pipeline_job.py", extra=flags)
            cut = cut or ours.get("stage_modules")
            if cut is None:
                print("    the dynshard job failed: torch gets pipeline_job.default_cut", flush=True)
            peer = run_job(COMPARE[1], RANKS, args, results_dir, job="pipeline_job.py",
                           extra=flags + (("--stages", ";".join(",".join(s) for s in cut)) if cut else ()))
            pairs.append((ours, peer))
        text, summary = compare_table(pairs)
        out["compare"] = dict(pairs=pairs, **summary)
        texts.append("compare (dynshard / torch.distributed.pipelining, both 1f1b):\n" + text)
        if "step_ratio" in summary:
            texts[-1] += (f"\nmedian over runs: step x {summary['step_ratio']:.2f}, min x {summary['min_ratio']:.2f}, "
                          f"cpu x {summary['cpu_ratio']:.2f}, first x {summary['first_ratio']:.2f}; largest |final "
                          "loss difference| "
                          f"{summary['final_loss_diff']:.2e}")
        modes = sorted({p.get("metadata_mode") for _, p in pairs if "metadata_mode" in p})
        if modes:
            texts[-1] += f"\ntorch's PipelineStage metadata mode: {', '.join(modes)}"
    if "bubbles" in parts:
        jobs = [run_job(f"pp:dynshard:{s}:traced", RANKS, args, results_dir, job="pipeline_job.py",
                        extra=flags + ("--trace-dir", os.path.join(results_dir, "traces", f"pp_dynshard_{s}")))
                for s in SCHEDULES]
        rows = [row for job in jobs if "error" not in job for row in bubble_rows(job)]
        failed = [job["system"] for job in jobs if "error" in job]
        out["bubbles"] = dict(rows=rows, jobs=jobs, failed=failed)
        if rows:
            texts.append("bubbles (dynshard, traced):\n" + bubble_table(rows) + "\n\n" + span_table(rows))
        if failed:
            texts.append(f"failed: {', '.join(failed)} (logs under {results_dir}/logs)")
    load_end = load_average()
    footer = (f"load average (1 min) at start {load_start[0]:.1f}, at end {load_end[0]:.1f}; compiler {args.compiler}; "
              f"model: {args.layers} layers, d_model {args.d_model}, seq {args.seq}, vocab {args.vocab}, batch "
              f"{args.batch} in {args.micro_batches} micro-batches, {RANKS} ranks; {args.steps} timed steps after "
              f"{args.warmup}")
    text = "\n\n".join(texts)
    out.update(load_end=load_end, table=text)
    publish(args.out, out, text, NOTES, footer)


if __name__ == "__main__":
    main()

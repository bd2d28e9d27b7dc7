"""dynshard.checkpoint on 2 CPU ranks (gloo): save and load times, and the bytes each rank writes, under each plan,
against a plain torch.save / torch.load of the same model on one process. One job per plan (own torchrun, own
process group: bench_gpt's run_job, checkpoint_job.py), then two tables:

    python benchmarks/bench_checkpoint.py                        # aot_eager, the GPT below, 3 saves / loads each
    python benchmarks/bench_checkpoint.py --compiler inductor    # the same programs compiled by Inductor
    python benchmarks/bench_checkpoint.py --plans dp,tp --cross tp:dp --layers 2 --d-model 64   # a quick look

The GPT of bench_gpt (tests/models.py, tied embedding / LM head; 4 layers, d_model 256, 4 heads, seq 128,
vocab 4096, global batch 8: gpt_job.add_run_arguments' flags) as tests/workers_pipeline.py's EndToEndGPT,
AdamW (lr 1e-4), 2 training steps (--steps) before the saves. Plans (dynshard.Config, compiler aot_eager
unless --compiler):

plan   Config
dp     policy "dp", plan_ngpus 1
tp     policy "tp", plan_ngpus 2
zero3  policy "dp", plan_ngpus 1, use_zero 3
pp     policy "pp", plan_ngpus 2, use_end2end True, pas_config {"pipeline_nmicros": 2} (dynshard.train_step)

Each plan's job saves its checkpoint, then a new model of that plan loads it and the checkpoints of the
plans --cross names for it (source:target pairs; the jobs run sources first), each load checked bitwise
against what the saving job held (see checkpoint_job.py): a broken load fails the job and the benchmark.
"""

from __future__ import annotations

import argparse
import graphlib
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_gpt import align, load_average, provenance, publish, run_job  # noqa: E402
from checkpoint_job import PLANS, add_checkpoint_arguments  # noqa: E402

RANKS = 2
DEFAULT_CROSS = "tp:dp,zero3:tp,pp:dp,zero3:pp"
MB = 1e6

NOTES = """\
save: save s: median over --repeat saves (each to a new path, a barrier before it) of the wall time of
  dynshard.checkpoint.save(path, model, opt, extra=...), max over ranks; (min-max): the fastest and slowest of
  those; x torch: save s / the torch row's (torch.save of model.state_dict() + optimizer.state_dict() to one
  file, flushed and fsync'd, one process). written MB/rank: the size of each rank's __<rank>_0.distcp file
  (torch: its one file); held MB/rank: what the rank stores after its steps (its parameter pieces, the tied
  embedding / LM head once, and its AdamW exp_avg, exp_avg_sq and step tensors); written/held: their ratio
  per rank; data/held: the same with only the tensor data the rank's file holds (DCP's metadata), framing
  left out (dp: each rank holds everything and DCP writes each replicated tensor once, so ideally 1/2 each;
  tp, zero3: ~1; pp: ~1, less on the rank whose copy of the tied weight the other writes); total MB: all
  ranks' files (not .metadata); x full: total / the model's full state (parameters, the tied weight once,
  + exp_avg + exp_avg_sq in fp32 + one fp32 step per parameter; the footer gives it); tied copy MB: bytes of
  state-dict keys that alias another key's tensor (lm_head.weight is wte.weight) written again (0: dynshard
  points the alias key's entries at its target's bytes, as torch.save keeps a shared storage once); framing
  MB: file bytes that are no tensor's data (each DCP item is its own
  torch.save record; pickled extra, param groups; torch: the file less the full state); items: DCP write
  items per rank; meta KB: the .metadata file.
load: a new model of the plan (another seed) after its own first step (--warmup) loads the checkpoint with
  dynshard.checkpoint.load(path, model, opt) --repeat times (its parameters and AdamW state overwritten
  before each); load s: the median of the per-load wall time, max over ranks; x torch: / the torch row's
  (torch.load + model.load_state_dict + optimizer.load_state_dict). checked: tensors (whole parameters from
  dynshard.collect_state_dict, AdamW state gathered over tp, ZeRO and stages) equal bitwise to the saving
  job's after every load. The files are in the page cache (just written): loads read memory, not the disk."""


def schedule(plans: list[str], cross: list[tuple[str, str]]) -> list[str]:
    """The plans, each after the sources it loads (in --plans' order where free)."""
    sorter = graphlib.TopologicalSorter({p: [s for s, t in cross if t == p] for p in plans})
    try:
        sorter.prepare()
    except graphlib.CycleError as e:
        raise SystemExit(f"--cross has a cycle {e.args[1]}: a plan's job loads only checkpoints saved before it")
    order = []
    while sorter.is_active():
        ready = sorted(sorter.get_ready(), key=plans.index)
        order += ready
        sorter.done(*ready)
    return order


def mbs(values) -> str:
    return " / ".join(f"{v / MB:.2f}" for v in values)


def save_table(jobs: dict[str, dict], torch_job: dict) -> str:
    header = ("checkpoint", "ranks", "save s", "(min-max)", "x torch", "written MB/rank", "held MB/rank",
              "written/held", "data/held", "total MB", "x full", "tied copy MB", "framing MB", "items", "meta KB")
    lines = [header]
    base = torch_job.get("save_s")
    for name, r in [("torch", torch_job), *jobs.items()]:
        if "error" in r:
            lines.append((name, str(r["world"]), "failed: " + r["error"]) + ("",) * (len(header) - 3))
            continue
        held = [h["params"] + h["optimizer"] for h in r["held_by_rank"]]
        written = r["written_by_rank"]
        total = sum(written)
        parts = r.get("breakdown_by_rank")
        data = sum(p["tensor_bytes"] for p in parts) if parts else r["full"]      # torch: the full state
        lines.append((
            name, str(r["world"]), f"{r['save_s']:.3f}", f"{min(r['save_times']):.3f}-{max(r['save_times']):.3f}",
            f"{r['save_s'] / base:.2f}" if base and name != "torch" else "-", mbs(written), mbs(held),
            " / ".join(f"{w / h:.2f}" for w, h in zip(written, held)),
            " / ".join(f"{p['tensor_bytes'] / h:.2f}" for p, h in zip(parts, held)) if parts else "-",
            f"{total / MB:.2f}", f"{total / r['full']:.3f}",
            f"{sum(p['alias_bytes'] for p in parts) / MB:.2f}" if parts else "0", f"{(total - data) / MB:.2f}",
            " / ".join(str(p["items"]) for p in parts) if parts else "1", f"{r['metadata_bytes'] / 1e3:.1f}"))
    return align(lines)


def load_table(jobs: dict[str, dict], torch_job: dict, cross: list[tuple[str, str]]) -> str:
    header = ("checkpoint", "into", "load s", "(min-max)", "x torch", "checked")
    lines = [header]
    base = torch_job.get("loads", {}).get("torch", {}).get("load_s")
    pairs = [("torch", "torch")] + [(p, p) for p in jobs] + [(s, t) for s, t in cross if t in jobs]
    for source, target in pairs:
        job = torch_job if target == "torch" else jobs[target]
        load = job.get("loads", {}).get(source)
        if load is None:
            why = job.get("error") or (jobs.get(source) or {}).get("error") or "not run"
            lines.append((source, target, "failed: " + why) + ("",) * (len(header) - 3))
            continue
        t = load["times"]
        lines.append((source, target, f"{load['load_s']:.3f}", f"{min(t):.3f}-{max(t):.3f}",
                      f"{load['load_s'] / base:.2f}" if base and target != "torch" else "-",
                      f"{load['tensors_checked']} bitwise"))
    return align(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated subset of {','.join(PLANS)}")
    parser.add_argument("--cross", default=DEFAULT_CROSS,
                        help="comma-separated source:target: the target plan's job loads the source's checkpoint")
    add_checkpoint_arguments(parser)
    parser.add_argument("--job-timeout", type=float, default=900, help="seconds per job")
    parser.add_argument("--ckpt-dir", default=None, help="where the checkpoints go (default: checkpoints/ beside "
                                                          "--out, removed at the end unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "checkpoint_cpu.json"),
                        help="the results (JSON); the tables are written beside it (.txt), the jobs under its "
                             "folder's jobs/ and logs/")
    args = parser.parse_args()
    plans = [p for p in args.plans.split(",") if p]
    cross = [tuple(pair.split(":")) for pair in args.cross.split(",") if pair]
    bad = [p for p in plans if p not in PLANS] + [":".join(pair) for pair in cross if len(pair) != 2
                                                  or not set(pair) <= set(plans) or pair[0] == pair[1]]
    if bad:
        raise SystemExit(f"unknown plan(s) or pair(s) {bad}: plans {', '.join(PLANS)}, pairs source:target of "
                         "two different plans in --plans")
    results_dir = os.path.dirname(os.path.abspath(args.out))
    ckpt_dir = os.path.abspath(args.ckpt_dir or os.path.join(results_dir, "checkpoints"))
    load_start = load_average()
    flags = ("--repeat", str(args.repeat), "--compiler", args.compiler, "--ckpt-dir", ckpt_dir)

    torch_job = run_job("ckpt:torch", 1, args, results_dir, job="checkpoint_job.py", extra=flags)
    jobs: dict[str, dict] = {}
    for plan in schedule(plans, cross):
        sources = [s for s, t in cross if t == plan and "error" not in jobs[s]]
        jobs[plan] = run_job(f"ckpt:{plan}", RANKS, args, results_dir, job="checkpoint_job.py",
                             extra=flags + (("--load-from", ",".join(sources)) if sources else ()))
    jobs = {p: jobs[p] for p in plans}
    if not args.keep:
        shutil.rmtree(ckpt_dir, ignore_errors=True)

    text = ("save (after the training steps):\n" + save_table(jobs, torch_job) + "\n\nload (into a new model after "
            "its first step):\n" + load_table(jobs, torch_job, cross))
    failed = [j["system"] for j in (torch_job, *jobs.values()) if "error" in j]
    if failed:
        text += f"\n\nFAILED: {', '.join(failed)} (logs under {results_dir}/logs)"
    load_end = load_average()
    full = next((j for j in (torch_job, *jobs.values()) if "full" in j), {})
    footer = (f"load average (1 min) at start {load_start[0]:.1f}, at end {load_end[0]:.1f}; compiler {args.compiler}; "
              f"model: {args.layers} layers, d_model {args.d_model}, seq {args.seq}, vocab {args.vocab}, global batch "
              f"{args.batch}, AdamW, {args.steps} steps before the saves; {RANKS} ranks (gloo); median of "
              f"{args.repeat}; parameters {full.get('params', 0) / MB:.2f} MB, full state "
              f"{full.get('full', 0) / MB:.2f} MB")
    publish(args.out, {"config": vars(args), **provenance(), "load_start": load_start, "load_end": load_end,
                       "cross": cross, "torch": torch_job, "jobs": jobs, "table": text}, text, NOTES, footer)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

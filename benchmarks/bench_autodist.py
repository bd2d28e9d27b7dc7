"""autodist against the hand plans on the benchmark GPT, 2 ranks: each plan's measured steady step (its own
torchrun job, as bench_gpt.py runs them) beside the step autodist's cost model predicts for it, with the
machine's calibrated device profile; then how well the predictions rank the plans, and how autodist's own
choice (plan_ngpus 2, and plan_ngpus 1) measures against the fastest hand plan.

    python benchmarks/bench_autodist.py --out benchmarks/results/autodist_cpu.json
    python benchmarks/bench_autodist.py --search-only      # the search-time table alone
    python benchmarks/bench_autodist.py --pipelines-only   # train_step: the pp schedules, tp, data, autodist

Also: the search's time (offline, ``dynshard.plan`` on the meta device) by layers and ranks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from bench_gpt import run_job, torchrun_env  # noqa: E402
from gpt_job import MODELS, add_run_arguments  # noqa: E402

# hand plan -> (system of gpt_job.py, plan_ngpus, autodist's name for the same plan)
HAND = {
    "dp": ("dynshard:dp", 1, "dp"),
    "ZeRO-1": ("dynshard:zero1", 1, "dp + ZeRO-1"),
    "ZeRO-2": ("dynshard:zero2", 1, "dp + ZeRO-2"),
    "ZeRO-3": ("dynshard:zero3", 1, "dp + ZeRO-3"),
    "dp + recompute": ("dynshard:dp-recompute", 1, "dp + recompute Block"),
    "ZeRO-3 + recompute": ("dynshard:zero3-recompute", 1, "dp + ZeRO-3 + recompute Block"),
    "tp": ("dynshard:tp", 2, "tp"),
    "tp + sp": ("dynshard:tpsp", 2, "tp + sequence parallel"),
    "tp + batch parallel": ("dynshard:tp-batch", 2, "tp + batch parallel"),
    "data": ("dynshard:data", 2, "data"),
    "tp + recompute": ("dynshard:tp-recompute", 2, "tp + recompute Block"),
    "tp + sp + recompute": ("dynshard:tpsp-recompute", 2, "tp + sequence parallel + recompute Block"),
}
HAND_GPT = {     # (the GPT's module names)
    "tp, wte whole": ("dynshard:tp-wte-whole", 2, "tp, wte whole"),
    "tp, attention whole": ("dynshard:tp-attn-whole", 2, "tp, blocks.*.attn.{k,proj,q,v} whole"),
    "tp, fc1/fc2 whole": ("dynshard:tp-fc-whole", 2, "tp, blocks.*.{fc1,fc2} whole"),
    "tp, attention on batch shards": ("dynshard:tp-attn-batch", 2, "tp, blocks.*.attn.{k,proj,q,v} on batch shards"),
    "tp, fc1/fc2 on batch shards": ("dynshard:tp-fc-batch", 2, "tp, blocks.*.{fc1,fc2} on batch shards"),
    "tp, placed per op (ILP)": ("dynshard:plan-file", 2, "tp, placed per op"),     # (its plan file: per_op_plan)
}
AUTODIST = {"autodist (plan_ngpus 2)": ("dynshard:autodist", 2), "autodist (plan_ngpus 1)": ("dynshard:autodist-dp", 1)}


def calibrate(path: str) -> None:
    env = torchrun_env()
    env["OMP_NUM_THREADS"] = "1"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                    "dynshard.calibrate", "--out", path], env=env, check=True, capture_output=True)


def predictions(args, profile: str) -> dict:
    """autodist's offline search for 2 ranks at plan_ngpus 1 and 2: its ``Plan.predicted`` by plan_ngpus."""
    import torch

    import dynshard
    from models import GPTConfig, gpt_batch

    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, heads=args.heads, layers=args.layers)
    with torch.device("meta"):
        model = MODELS[args.model][0](cfg)
    out = {}
    for n in (1, 2):
        plan, = dynshard.plan(model, gpt_batch(cfg, args.batch * n // 2, 0), dynshard.Config(
            policy="autodist", plan_ngpus=n, pas_config={"device_profile": profile}), world_size=2)
        out[n] = plan.predicted
    return out


def per_op_plan(args, profile: str, path: str) -> str:
    """The per-op placement ILP's plan of the model at plan_ngpus 2 (an autodist candidate), into ``path``."""
    import torch

    from models import GPTConfig, gpt_batch
    from workers_op_placement import per_op_plan_json

    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, heads=args.heads, layers=args.layers)
    with torch.device("meta"):
        model = MODELS[args.model][0](cfg)
    with open(path, "w") as f:
        f.write(per_op_plan_json(model, gpt_batch(cfg, args.batch, 0), profile))
    return path


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        r = [0.0] * len(values)
        for position, i in enumerate(order):
            r[i] = position
        return r
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


class _Timings(logging.Handler):
    """What dynshard logs of one call: the search's own seconds, and the seconds its passes spent lowering
    graphs to ATen (the SPMD graph once; a hybrid pipeline's each stage graph)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.search = self.lowering = 0.0

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("pass lower_to_aten:"):
            self.lowering += float(message.split()[2].rstrip("s,"))
        elif message.startswith("autodist:") and " ILPs in " in message:
            self.search += float(message.split(" ILPs in ")[1].split("s,")[0])


def search_times(layer_counts=(8, 32), worlds=(8, 64, 512)) -> list[dict]:
    """Offline autodist on the meta device, pipelines explored: a d 1024, seq 1024, vocab 50k GPT (an end-to-end
    module: a sample in, the loss out), plan_ngpus 8, 8 micro-batches a step, the built-in H100 constants. Each
    row: the whole call, the search (everything after Dynamo's capture), and of that the lowering to ATen."""
    import torch

    import dynshard
    from models import GPTConfig, gpt_batch
    from workers_pipeline import EndToEndGPT

    log = logging.getLogger("dynshard")
    rows = []
    for layers in layer_counts:
        cfg = GPTConfig(vocab=50304, seq=1024, d_model=1024, heads=16, layers=layers)
        with torch.device("meta"):
            model = EndToEndGPT(cfg)
        sample = dict(zip(("idx", "tgt"), gpt_batch(cfg, 8, 0)))
        for world in worlds:
            timings, level = _Timings(), log.level
            log.addHandler(timings)
            log.setLevel(logging.DEBUG)
            start = time.perf_counter()
            try:
                plan, = dynshard.plan(model, (sample,), dynshard.Config(
                    policy="autodist", plan_ngpus=8, use_end2end=True, pas_config={
                        "device_profile": "cuda", "mem_constraint": 70, "explore_pipeline": True, "update_freq": 8}),
                    world_size=world)
            finally:
                log.removeHandler(timings)
                log.setLevel(level)
            rows.append(dict(layers=layers, world=world, seconds=round(time.perf_counter() - start, 2),
                             search=round(timings.search, 2), lowering=round(timings.lowering, 2),
                             candidates=len(plan.predicted.autodist.candidates),
                             chosen=plan.predicted.autodist.chosen))
            print(rows[-1], flush=True)
    return rows


PIPELINE_SYSTEMS = {"pp 1f1b": "pp:dynshard:1f1b", "pp gpipe": "pp:dynshard:gpipe", "pp zb1p": "pp:dynshard:zb1p",
                    "tp": "pp:dynshard:tp", "data": "pp:dynshard:data"}


def pipelines(args, results_dir: str, profile: str) -> str:
    """The end-to-end GPT trained by train_step over 4 micro-batches on 2 ranks: the pp schedules, tp and data
    measured beside their predictions, and autodist exploring pipelines."""
    import torch

    import dynshard
    from models import GPTConfig, gpt_batch
    from workers_pipeline import EndToEndGPT

    m = 4
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, heads=args.heads, layers=args.layers)
    with torch.device("meta"):
        model = EndToEndGPT(cfg)
    sample = dict(zip(("idx", "tgt"), gpt_batch(cfg, args.batch // m, 0)))
    plan, = dynshard.plan(model, (sample,), dynshard.Config(policy="autodist", plan_ngpus=2, use_end2end=True, pas_config={
        "explore_pipeline": True, "update_freq": m, "device_profile": profile}), world_size=2)
    predicted = {c.plan: c.step_seconds for c in plan.predicted.autodist.candidates}
    extra = ("--micro-batches", str(m), "--device-profile", profile)
    rows = [("plan (train_step, 4 micro-batches)", "measured s", "predicted s", "chose")]
    measured = {}
    for name, system in PIPELINE_SYSTEMS.items():
        job = run_job(system, 2, args, results_dir, job="pipeline_job.py", extra=extra)
        measured[name] = job.get("step_s")
        rows.append((name, f"{measured[name]:.3f}" if measured[name] else "failed", f"{predicted[name]:.3f}", ""))
    job = run_job("pp:dynshard:autodist", 2, args, results_dir, job="pipeline_job.py", extra=extra)
    rows.append(("autodist (explore_pipeline)", f"{job['step_s']:.3f}" if job.get("step_s") else "failed",
                 f"{plan.predicted.cost.step_seconds:.3f}", plan.predicted.autodist.chosen))
    names = [n for n in PIPELINE_SYSTEMS if measured[n]]
    rho = spearman([predicted[n] for n in names], [measured[n] for n in names])
    fastest = min(measured[n] for n in names)
    lines = [table(rows), f"Spearman ({len(names)} plans): {rho:.2f}"]
    if job.get("step_s"):
        lines.append(f"autodist / fastest of these ({fastest:.3f}s): {job['step_s'] / fastest:.2f}x")
    return "\n".join(lines)


def table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    parser.add_argument("--out", default=None, help="default: results/autodist_cpu.json (llama: autodist_cpu_llama.json)")
    parser.add_argument("--job-timeout", type=int, default=900)
    parser.add_argument("--search-only", action="store_true")
    parser.add_argument("--rounds", type=int, default=1, help="run every job this many times, in turn (alternating "
                        "order); a plan's measured step is the median of its runs")
    parser.add_argument("--pipelines-only", action="store_true", help="the train_step table alone")
    args = parser.parse_args()
    if args.search_only:
        print(table([("layers", "ranks", "whole call s", "search s", "of it lowering s", "candidates", "chosen")] + [
            (r["layers"], r["world"], r["seconds"], r["search"], r["lowering"], r["candidates"], r["chosen"])
            for r in search_times()]))
        return
    results_dir = tempfile.mkdtemp(prefix="bench_autodist_")
    profile = os.path.join(results_dir, "profile.json")
    calibrate(profile)
    if args.pipelines_only:
        print(pipelines(args, results_dir, profile))
        return
    args.out = args.out or os.path.join(HERE, "results", "autodist_cpu.json" if args.model == "gpt" else
                                        f"autodist_cpu_{args.model}.json")
    block = MODELS[args.model][1]
    predicted = predictions(args, profile)
    environ = {"DYNSHARD_PAS_CONFIG": json.dumps({"device_profile": profile})}
    hand_plans = {**HAND, **(HAND_GPT if args.model == "gpt" else {})}
    plan_file = {"BENCH_PLAN_FILE": per_op_plan(args, profile, os.path.join(results_dir, "per_op.json"))} \
        if args.model == "gpt" else {}
    jobs = [(name, system, plan_file if system == "dynshard:plan-file" else {})
            for name, (system, _, _) in hand_plans.items()] + [
        (name, system, environ) for name, (system, _) in AUTODIST.items()]
    runs: dict[str, list[float]] = {name: [] for name, _, _ in jobs}
    memory: dict[str, dict] = {}
    for round_ in range(args.rounds):      # (every job once per round, in turn: the machine's drift spreads)
        for name, system, env in jobs if round_ % 2 == 0 else jobs[::-1]:
            job = run_job(system, 2, args, results_dir, environ=env)
            if job.get("step_s") is not None:
                runs[name].append(job["step_s"])
                memory[name] = job.get("memory", {})
    rows = []
    for name, (system, n, candidate) in hand_plans.items():
        row = next(c for c in predicted[n].autodist.candidates if c.plan == candidate.replace("Block", block))
        rows.append(dict(plan=name, measured_s=_median(runs[name]), runs=runs[name], predicted_s=row.step_seconds,
                         predicted_peak=row.peak_bytes, state_bytes=memory.get(name, {})))
    for name, (system, n) in AUTODIST.items():
        rows.append(dict(plan=name, chose=predicted[n].autodist.chosen, measured_s=_median(runs[name]),
                         runs=runs[name], predicted_s=predicted[n].cost.step_seconds,
                         predicted_peak=predicted[n].cost.bytes_per_rank.peak))
    hand = [r for r in rows if r["plan"] in hand_plans and r["measured_s"] is not None]
    rho = spearman([r["predicted_s"] for r in hand], [r["measured_s"] for r in hand])
    wrong = [(a["plan"], b["plan"]) for a in hand for b in hand
             if a["measured_s"] > 1.2 * b["measured_s"] and a["predicted_s"] <= b["predicted_s"]]
    fastest = min(r["measured_s"] for r in hand)
    lines = [table([("plan", "measured s", "runs", "predicted s", "predicted/measured", "predicted peak MB", "chose")] + [
        (r["plan"], f"{r['measured_s']:.3f}" if r["measured_s"] else "failed", "/".join(f"{t:.3f}" for t in r["runs"]),
         f"{r['predicted_s']:.3f}",
         f"{r['predicted_s'] / r['measured_s']:.2f}" if r["measured_s"] else "-",
         f"{r['predicted_peak'] / 2 ** 20:.1f}", r.get("chose", "")) for r in rows]),
        f"Spearman (predicted vs measured step, {len(hand)} hand plans): {rho:.2f}",
        f"pairs more than 20% apart ordered wrong: {wrong or 'none'}"]
    for name in AUTODIST:
        mine = next(r for r in rows if r["plan"] == name)
        if mine["measured_s"]:
            lines.append(f"{name} / fastest hand plan ({fastest:.3f}s): {mine['measured_s'] / fastest:.2f}x")
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(config=vars(args), rows=rows, spearman=rho, wrong_pairs=wrong, table=text), f, indent=1)


if __name__ == "__main__":
    main()

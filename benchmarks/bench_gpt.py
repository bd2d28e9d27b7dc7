"""dynshard against its peers on the GPT model; one job (own torchrun, own process group, empty Inductor
and Triton caches) per system, then one table:

    python benchmarks/bench_gpt.py                      # or: torchrun --nproc-per-node 2 benchmarks/bench_gpt.py
    python benchmarks/bench_gpt.py --cases zero3 --steps 3 --warmup 1 --layers 2 --d-model 64   # a quick look

case     dynshard                                 peer
tp       policy "tp", plan_ngpus 2                DTensor parallelize_module (Colwise/Rowwise) + torch.compile
tpvocab  the same dynshard job                    the same plus the vocabulary: wte RowwiseParallel, the tied
                                                  lm_head ColwiseParallel(Shard(-1) logits), cross-entropy
                                                  under loss_parallel() + torch.compile
tpsp     "tp", plan_ngpus 2, pas_config           that plus sequence parallelism (torchtitan's plan):
         {"sequence_parallel": True}              SequenceParallel norms, PrepareModuleInput on attn, proj/fc2
                                                  output Shard(1), fc1 input Shard(1), wte output Shard(1)
dp       policy "dp"                              DDP + torch.compile
zero1    "dp", use_zero 1                         DDP + torch.compile + ZeroRedundancyOptimizer(AdamW)
zero1rs  "dp", use_zero 1, zero_use_reduce_scatter  the same peer
zero2    "dp", use_zero 2                         FSDP2 (fully_shard per block and root,
                                                  reshard_after_forward=False) + compile
zero3    "dp", use_zero 3                         FSDP2 (fully_shard per block and root) + torch.compile
zero2blk zero2 with compile_scope "blocks"        the zero2 peer: both compile the blocks only with Inductor
zero3blk zero3 with compile_scope "blocks"        the zero3 peer (FSDP2's hooks break the graph around blocks)
tpzero1  "tp", plan_ngpus 2, use_zero 1, 4 ranks  DTensor TP (tp mesh dim) x FSDP2 (dp mesh dim) + torch.compile
tpzero3  "tp", plan_ngpus 2, use_zero 3, 4 ranks  the same peer

Every system trains with torch.optim.AdamW (fp32, the ZeRO peer wraps it) and Inductor. A peer job is run
once and shared by the cases that name it. What each column means is in gpt_job.py and in NOTES below.

dynshard's tp policy splits the tied embedding / LM head along the vocabulary (vocab-parallel embedding,
head and a cross-entropy that never gathers the logits), so its row in case tp sends the vocabulary's
collectives that the tp peer (vocabulary replicated) does not, and holds less of the parameters; case
tpvocab compares it with the DTensor plan that splits the vocabulary too. tpvocab and tpsp are not in the
default cases:

    python benchmarks/bench_gpt.py --cases tp,tpvocab,tpsp --out benchmarks/results/gpt_cpu_tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_job import add_run_arguments  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

# case -> (ranks, dynshard system, peer system, peer's name in the table)
CASES = {
    "tp": (2, "dynshard:tp", "dtensor_tp", "DTensor TP + compile"),
    "tpvocab": (2, "dynshard:tp", "dtensor_tp_vocab", "DTensor TP vocab + loss_parallel + compile"),
    "tpsp": (2, "dynshard:tpsp", "dtensor_tp_sp", "DTensor TP vocab + SP + loss_parallel + compile"),
    "dp": (2, "dynshard:dp", "ddp", "DDP + compile"),
    "zero1": (2, "dynshard:zero1", "ddp_zero", "DDP + ZeroRedundancyOpt + compile"),
    "zero1rs": (2, "dynshard:zero1rs", "ddp_zero", "DDP + ZeroRedundancyOpt + compile"),
    "zero2": (2, "dynshard:zero2", "fsdp2_noreshard", "FSDP2 no reshard + compile"),
    "zero3": (2, "dynshard:zero3", "fsdp2", "FSDP2 + compile"),
    "zero2blk": (2, "dynshard:zero2-blocks", "fsdp2_noreshard", "FSDP2 no reshard + compile"),
    "zero3blk": (2, "dynshard:zero3-blocks", "fsdp2", "FSDP2 + compile"),
    "tpzero1": (4, "dynshard:tpzero1", "tp_fsdp2", "DTensor TP x FSDP2 + compile"),
    "tpzero3": (4, "dynshard:tpzero3", "tp_fsdp2", "DTensor TP x FSDP2 + compile"),
}
DEFAULT_CASES = "tp,dp,zero1,zero2,zero3,zero2blk,zero3blk,tpzero3"
VOCAB_CASES = ("tpvocab", "tpsp")        # minima with the tied embedding / LM head split along the vocabulary
MODEL_ARGS = ("steps", "warmup", "layers", "d_model", "heads", "seq", "vocab", "batch", "model")

NOTES = """\
first s: step 0 (forward, backward, AdamW step) of a job with empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR,
  max over ranks; setup s: building the model wrapper before it (DDP / fully_shard / parallelize_module, imports).
step s: median of the timed steps after warm-up, max over ranks. ratios: dynshard / peer.
comm MB: collectives of one training step, each counted at its full size (the larger of input and output);
  dynshard: dynshard.explain (traced graphs); peers: one eager step under a dispatch mode that records every c10d
  op. wire MB: bytes one rank sends with ring algorithms (all-reduce 2(N-1)/N, others (N-1)/N of the full size).
min: the analytic minimum in the same units (research/zero.md section 7): dp AR(P); zero1/2 RS(P)+AG(P);
  zero3 AG(P)+AG(weights read by a backward formula)+RS(P); tp 4 all-reduces of B*T*C per layer (the
  vocabulary replicated, as the tp peer has it); tpvocab that + AR(B*T*C) of the embedding (forward) + AR(B*T*C)
  of the LM head's input gradient (backward) + 3 AR(B*T) of the cross-entropy (max, sum of exponentials,
  target logit); tpsp each of those B*T*C all-reduces as a reduce-scatter + an all-gather (twice the full-size
  bytes, the same wire bytes) + AR of the LayerNorms' weight and bias gradients (their tokens are split).
param MB/rank: parameters on one rank (DTensors by their local shard), max over ranks.
state MB/rank: parameters + gradients + optimizer tensors (m, v; scalar steps left out) after a step, max over
  ranks, DTensors by their local shard; x total/N: over (4 * parameter bytes) / world size.
load: 1-minute load average of the machine (2 cores) when the job started / ended."""


def torchrun_env() -> dict[str, str]:
    """The environment for a child torchrun: without the outer torchrun's and dynshard's variables."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS")
    return {k: v for k, v in os.environ.items()
            if k not in drop and not k.startswith(("DYNSHARD_", "TORCHINDUCTOR_", "TRITON_"))}


def load_average() -> list[float]:
    return list(os.getloadavg())


def run_job(system: str, ranks: int, args, results_dir: str, job: str = "gpt_job.py",
            extra: tuple[str, ...] = (), environ: dict[str, str] | None = None) -> dict:
    """Run ``job`` (a script beside this one) for ``system`` under a fresh torchrun with empty Inductor and
    Triton caches, with the model flags of ``args`` and ``extra``; its JSON, with the job's wall time and
    the load average added."""
    out = os.path.join(results_dir, "jobs", system.replace(":", "_") + ".json")
    log = os.path.join(results_dir, "logs", system.replace(":", "_") + ".log")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    os.makedirs(os.path.dirname(log), exist_ok=True)
    if os.path.exists(out):
        os.remove(out)
    cache = tempfile.mkdtemp(prefix="bench_gpt_cache_")
    env = torchrun_env()
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    env["OMP_NUM_THREADS"] = "1"
    env.update(environ or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           os.path.join(HERE, job), "--system", system, "--out", out, *extra]
    for name in MODEL_ARGS:
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    load_before = load_average()
    start = time.perf_counter()
    print(f"[{time.strftime('%H:%M:%S')}] {system} on {ranks} ranks (load {load_before[0]:.1f}) ...", flush=True)
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.job_timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    shutil.rmtree(cache, ignore_errors=True)
    wall = time.perf_counter() - start
    if rc != 0 or not os.path.exists(out):
        print(f"    failed ({rc}) after {wall:.0f}s, see {log}", flush=True)
        return dict(system=system, world=ranks, error=f"exit {rc}, log {log}", job_wall_s=wall)
    with open(out) as f:
        result = json.load(f)
    result.update(job_wall_s=wall, load_before=load_before, load_after=load_average())
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"    first step {result['first_step_s']:.1f}s, step {result['step_s']:.3f}s, job {wall:.0f}s", flush=True)
    return result


def reusable(system: str, args, results_dir: str) -> dict | None:
    if not args.reuse or system in args.rerun.split(","):
        return None
    path = os.path.join(results_dir, "jobs", system.replace(":", "_") + ".json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        result = json.load(f)
    same = all(result["config"].get(name) == getattr(args, name) for name in MODEL_ARGS)
    if "job_wall_s" not in result and os.path.exists(args.out):      # written before the driver kept it there
        with open(args.out) as f:
            rows = [r for r in json.load(f)["rows"] if r["system"] == system and "job_wall_s" in r]
        if rows:
            result.update({k: rows[0][k] for k in ("job_wall_s", "load_before", "load_after")})
    if not same or "job_wall_s" not in result:
        return None
    print(f"reusing {path} (load {result['load_before'][0]:.1f} at its start)", flush=True)
    return result


def minima(case: str, ranks: int, args) -> dict[str, float]:
    """Analytic minimum communication (full-size and wire bytes per step) and model-state bytes."""
    from models import GPT, GPTConfig

    import torch

    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, heads=args.heads, layers=args.layers)
    with torch.device("meta"):
        model = GPT(cfg)
    tp = 2 if case.startswith("tp") else 1
    dp = ranks // tp
    colwise = (".attn.q.", ".attn.k.", ".attn.v.", ".fc1.")
    rowwise_weights = (".attn.proj.weight", ".fc2.weight")

    vocab = case in VOCAB_CASES

    def local_bytes(name, p):          # bytes on one tensor-parallel rank (Megatron split of the layers)
        split = tp if any(s in name for s in colwise) or name.endswith(rowwise_weights) else 1
        if vocab and name == "wte.weight":          # vocab-parallel: the tied table split along its rows
            split = tp
        return p.numel() * p.element_size() // split

    named = list(model.named_parameters())                     # the tied lm_head weight counted once
    full = sum(p.numel() * p.element_size() for _, p in named)
    local = sum(local_bytes(n, p) for n, p in named)
    # weights a backward formula reads (matmul weights with an input that needs grad, LayerNorm weights,
    # the tied wte/lm_head); biases and the position embedding need no backward gather
    needed = sum(local_bytes(n, p) for n, p in named if n.endswith(".weight") and n != "wpe.weight")
    rows = (args.batch // dp) * args.seq
    act = rows * args.d_model * 4
    # Megatron's layers: 2 all-reduces of B*T*C forward, 2 backward; vocab parallel adds the embedding's
    # all-reduce (forward), the LM head's input gradient (backward) and the cross-entropy's 3 all-reduces
    # of one value per row (max, sum of exponentials, target logit; forward)
    reduced = (4 * args.layers + (2 if vocab else 0)) * act if tp > 1 else 0
    loss_rows = 3 * rows * 4 if vocab and tp > 1 else 0
    if case == "tpsp":
        # each all-reduce of B*T*C replaced by a reduce-scatter and an all-gather of the same full size
        # (the same wire bytes); the LayerNorms then see 1/tp of the tokens, so their weight and bias
        # gradients are partial sums: one all-reduce of their bytes (the row-split biases and wpe can be
        # added before the reduce-scatter, where their gradients are whole on every rank)
        norms = sum(p.numel() * p.element_size() for n, p in named if ".ln" in n or n.startswith("ln_"))
        tp_traced = 2 * reduced + loss_rows + norms
        tp_wire = (tp - 1) / tp * 2 * reduced + 2 * (tp - 1) / tp * (loss_rows + norms)
    else:
        tp_traced = reduced + loss_rows
        tp_wire = 2 * (tp - 1) / tp * tp_traced
    ring = (dp - 1) / dp
    level = {"dp": 0, "tp": 0, "tpvocab": 0, "tpsp": 0, "zero1": 1, "zero1rs": 1, "zero2": 2, "zero3": 3,
             "zero2blk": 2, "zero3blk": 3, "tpzero1": 1, "tpzero3": 3}[case]
    if dp == 1:
        traced, wire = 0, 0.0
    elif level == 0:
        traced, wire = local, 2 * ring * local
    elif level in (1, 2):
        traced, wire = 2 * local, 2 * ring * local
    else:
        traced, wire = 2 * local + needed, ring * (2 * local + needed)
    return dict(comm_min_bytes=tp_traced + traced, comm_min_wire_bytes=tp_wire + wire,
                state_total_bytes=4 * full, state_target_bytes=4 * full / ranks, param_bytes=full)


def provenance() -> dict:
    """torch's version, the git HEAD and dynshard's uncommitted files, for a results JSON."""
    import torch

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=HERE, capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""

    return {"torch": torch.__version__, "git_head": git("rev-parse", "HEAD"),
            "dynshard_uncommitted": git("status", "--short", "--", "../dynshard").splitlines()}


def table(rows: list[dict]) -> str:
    header = ("case", "system", "ranks", "setup s", "first s", "first x", "step s", "step x", "comm MB", "min MB",
              "wire MB", "min wire", "colls", "param MB/rank", "state MB/rank", "x total/N", "load")
    lines = [header]
    for r in rows:
        if "error" in r:
            lines.append((r["case"], r["name"], str(r["world"])) + ("failed",) + ("",) * (len(header) - 4))
            continue
        lines.append((r["case"], r["name"], str(r["world"]), f"{r['setup_s']:.1f}", f"{r['first_step_s']:.1f}",
                      f"{r['first_ratio']:.2f}" if r.get("first_ratio") is not None else "-",
                      f"{r['step_s']:.3f}", f"{r['step_ratio']:.2f}" if r.get("step_ratio") is not None else "-",
                      f"{r['comm_bytes'] / 1e6:.2f}", f"{r['comm_min_bytes'] / 1e6:.2f}",
                      f"{r['comm_wire_bytes'] / 1e6:.2f}", f"{r['comm_min_wire_bytes'] / 1e6:.2f}",
                      str(r["comm_count"]), f"{max(m['params'] for m in r['state_bytes_by_rank']) / 1e6:.2f}",
                      f"{r['state_bytes'] / 1e6:.2f}",
                      f"{r['state_bytes'] / r['state_target_bytes']:.3f}",
                      f"{r['load_before'][0]:.1f}/{r['load_after'][0]:.1f}"))
    return align(lines)


def align(lines: list[tuple[str, ...]]) -> str:
    """Rows of cells (the header first) as left-aligned columns."""
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated subset of {','.join(CASES)}")
    add_run_arguments(parser)
    parser.add_argument("--reuse", action="store_true",
                        help="reuse the job results already under results/jobs/ (same model flags) except --rerun")
    parser.add_argument("--rerun", default="", help="comma-separated systems to run again with --reuse")
    parser.add_argument("--job-timeout", type=float, default=1800, help="seconds per job")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "gpt_cpu.json"),
                        help="the results (JSON); the table is written beside it (.txt), the jobs under its "
                             "folder's jobs/ and logs/")
    args = parser.parse_args()

    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    results_dir = os.path.dirname(os.path.abspath(args.out))
    load_start = load_average()
    jobs: dict[str, dict] = {}
    for case in cases:
        ranks, ours, peer, _ = CASES[case]
        for system in (ours, peer):
            if system not in jobs:
                old = reusable(system, args, results_dir)
                jobs[system] = old if old is not None else run_job(system, ranks, args, results_dir)
    rows = []
    for case in cases:
        ranks, ours, peer, peer_name = CASES[case]
        limits = minima(case, ranks, args)
        name = "dynshard compile_scope=blocks" if ours.endswith("-blocks") else "dynshard"
        pair = [dict(jobs[ours], case=case, name=name, **limits), dict(jobs[peer], case=case, name=peer_name,
                                                                           **limits)]
        if all("error" not in r for r in pair):
            pair[0]["first_ratio"] = pair[0]["first_step_s"] / pair[1]["first_step_s"]
            pair[0]["step_ratio"] = pair[0]["step_s"] / pair[1]["step_s"]
        rows += pair
    text = table(rows)
    load_end = load_average()
    footer = (f"load average (1 min) at start {load_start[0]:.1f}, at end {load_end[0]:.1f}; "
              f"model: {args.layers} layers, d_model {args.d_model}, seq {args.seq}, vocab {args.vocab}, global batch "
              f"{args.batch}, {args.steps} timed steps after {args.warmup}; "
              f"parameters {rows[0]['param_bytes'] / 1e6:.2f} MB in all")
    publish(args.out, {"config": vars(args), **provenance(), "load_start": load_start, "load_end": load_end,
                       "rows": rows, "table": text}, text, NOTES, footer)


def publish(path: str, payload: dict, text: str, notes: str, footer: str) -> None:
    """Print the table(s), the notes and the footer; write ``payload`` to ``path`` (JSON) and the text beside
    it (.txt)."""
    print()
    print(text)
    print()
    print(notes)
    print(footer)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    with open(os.path.splitext(path)[0] + ".txt", "w") as f:
        f.write(text + "\n\n" + notes + "\n" + footer + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:          # launched as before, under torchrun: rank 0 drives, the others leave
        if os.environ.get("RANK", "0") != "0":
            sys.exit(0)
    main()

"""Two ranks on one GPU: tests/test_random_ops.py's dropout parity on CUDA tensors, over gloo (NCCL refuses two
ranks on one device; gloo reduces CUDA tensors through the host). What it checks is the CUDA side of
``passes/random_draws`` (a shard drawn whole from the CUDA generator and sliced) and of the generator-state
check (``torch.cuda.get_rng_state``), not the speed of anything.

    PYTHONPATH=.:tests python benchmarks/cuda_ranks_check.py --out DIR

Each case prints PASS, FAIL (what differed) or ERROR (the traceback's end); DIR/cuda_ranks_check.json holds them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (os.path.join(ROOT, "tests"), ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def on_cuda(rank: int, world: int, worker: str, *args, **kwargs):
    """A worker of tests/workers_random_ops.py on this rank, with the dynshard backend registered."""
    import torch
    import torch.distributed as dist

    import workers_random_ops
    from gpu_check import ensure_dynshard_backend

    torch.cuda.set_device(0)
    dist.init_process_group("gloo")     # (dynshard would start NCCL, which refuses two ranks on one GPU)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    ensure_dynshard_backend()
    return getattr(workers_random_ops, worker)(rank, world, *args, **kwargs)


def _attention_math_only(rank: int, world: int, *args, **kwargs):
    """The attention case with SDPA's math path (dropout as ``bernoulli_`` on the probabilities, as on CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return on_cuda(rank, world, "dropout_parity", *args, **kwargs)


CASES = {
    # name: (function, arguments, what PASS means)
    "dropout kinds, tp, aot_eager": (on_cuda, ("dropout_parity", "dropout kinds", "tp", "aot_eager", None, 3, False,
                                               "cuda"), "parity"),
    "dropout kinds, data, aot_eager": (on_cuda, ("dropout_parity", "dropout kinds", "data", "aot_eager", None, 3,
                                                 False, "cuda"), "parity"),
    "dropout kinds, data, inductor vs one process compiled": (
        on_cuda, ("dropout_parity", "dropout kinds", "data", "inductor", None, 3, True, "cuda"), "parity"),
    "attention (SDPA math) dropout, tp, aot_eager": (
        _attention_math_only, ("attention", "tp", "aot_eager", None, 3, False, "cuda"), "parity"),
    "attention (SDPA's CUDA kernel) dropout, tp, aot_eager": (
        on_cuda, ("dropout_parity", "attention", "tp", "aot_eager", None, 3, False, "cuda"), "report"),
    "dropout kinds, tp, inductor vs one process compiled": (
        on_cuda, ("dropout_parity", "dropout kinds", "tp", "inductor", None, 3, True, "cuda"), "parity"),
    "transformers GPT-2 at its dropouts, tp, aot_eager": (
        on_cuda, ("dropout_parity", "gpt2", "tp", "aot_eager", None, 3, False, "cuda"), "report"),
    "ranks seeded apart, tp": (on_cuda, ("seeded_per_rank", 2, "rank", True, 2, "cuda"), "error at call 0"),
}


def judge(results: list, expect: str) -> tuple[str, str]:
    from parity import assert_trains_like_one_process

    if expect == "error at call 0":
        ok = all(r["error"] and r["call"] == 0 for r in results)
        return ("PASS" if ok else "FAIL"), "; ".join(f"call {r['call']}: {(r['error'] or '')[:120]}" for r in results)
    detail = f"same draws {[r['same_draws'] for r in results]}, losses {results[0]['losses']} vs one process " \
             f"{results[0]['ref_losses']}"
    try:
        for r in results:
            assert r["same_draws"] == [True] * len(r["same_draws"]), "drew a different count of numbers"
            assert_trains_like_one_process(r, "cuda")
    except AssertionError as error:
        return ("FAIL" if expect == "parity" else "DIFFERS"), f"{detail}; {str(error)[:600]}"
    return "PASS", detail


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--case", action="append", help="run only these (by name)")
    args = parser.parse_args()
    from distributed import run_ranks

    out = {}
    for name, (fn, arguments, expect) in CASES.items():
        if args.case and name not in args.case:
            continue
        start = time.perf_counter()
        try:
            verdict, detail = judge(run_ranks(fn, 2, *arguments, timeout=300), expect)
        except Exception as error:      # noqa: BLE001 - one case's failure is reported, the next runs
            verdict, detail = "ERROR", "".join(traceback.format_exception(error))[-3000:]
        out[name] = {"verdict": verdict, "detail": detail, "seconds": round(time.perf_counter() - start, 1)}
        print(f"{verdict:7s} {name} ({out[name]['seconds']} s): {detail}", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "cuda_ranks_check.json"), "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

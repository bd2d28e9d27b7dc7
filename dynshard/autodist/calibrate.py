"""``python -m dynshard.calibrate --out profile.json``: the device profile autodist's cost model reads
(``pas_config={"device_profile": "profile.json"}``), measured on this machine.

Launch it as the job is launched (``torchrun --nproc-per-node N -m dynshard.calibrate --out ...``): every rank
measures at once, so compute is timed under the contention the job runs in (ranks sharing a CPU's cores,
or one GPU each), and the collectives over the job's backend (gloo on CPU, NCCL on CUDA):
- ``flops_per_s``: fp32 square matmuls (``--dtype`` for another); on a GPU also each dtype's (``rates``: bf16
  and fp16, fp32), at ``SUSTAINED`` of the rate measured alone as the built-in GPU profiles are, the rest
  (flash attention's rate, the network, how collectives overlap) from the built-in profile the GPU's name
  gives (``h100-sxm``, ``h200``, ``a100-80gb``; else ``cuda``);
- ``bytes_per_s``: copies of a 64 MB tensor (read + write);
- ``launch_s``: what a kernel costs beyond its work, 200 adds of one element issued in turn (on a GPU the
  host's issue rate: the kernels run faster than they are launched);
- per collective kind, the seconds of a call at each size from 4 KB to 16 MB (``table``, used for groups of
  the job's size: interpolated, extrapolated beyond 16 MB by the last segment's slope), and ``alpha_s`` and
  ``bandwidth`` fitted to ``t = alpha + ring * bytes / bandwidth`` by relative least squares over them (ring:
  2(p-1)/p for an all-reduce, (p-1)/p otherwise; for other group sizes), each size's time the median over
  rounds (every kind and size in turn) of the fastest call of a burst, averaged over the ranks;
- ``skew``: how long a collective waits for the slowest rank after every rank ran the same compute, beyond its
  idle latency: a 4 KB all-reduce after about 3 ms and 12 ms of matmuls on each rank, the mean wait's excess
  over ``sqrt(compute seconds)`` (the cost model's ``meeting_seconds``).
One process alone measures compute only and keeps the built-in collective constants. Takes well under 60 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist

from .device_profile import DEFAULT_PROFILES, KINDS, SUSTAINED, DeviceProfile

SIZES = [4096 * 4 ** k for k in range(7)]        # 4 KB ... 16 MB per rank's payload, x p for gathers
REPEATS, WARMUP = 7, 3
ROUNDS, BURST = 3, 5        # rounds of every collective kind and size in turn; calls of one, back to back


def _timed(fn, device: torch.device, repeats: int = REPEATS, warmup: int = WARMUP, reduce=statistics.median) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return reduce(times)


def compute_rates(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    rates = []
    for n in (512, 1024) + ((2048, 4096) if device.type == "cuda" else ()):   # (a GPU's small matmuls wait on launches)
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        rates.append(2 * n ** 3 / _timed(lambda: torch.mm(a, b), device))
    x = torch.empty(16 * 1024 ** 2, device=device)       # 64 MB of fp32
    y = torch.empty_like(x)
    bandwidth = 2 * x.numel() * x.element_size() / _timed(lambda: y.copy_(x), device)
    return max(rates), bandwidth


def launch_seconds(device: torch.device, kernels: int = 200) -> float:
    x, y = torch.zeros(1, device=device), torch.empty(1, device=device)

    def issue():
        for _ in range(kernels):
            torch.add(x, 1, out=y)
    return _timed(issue, device) / kernels


def _numel(nbytes: int, world: int) -> int:
    numel = max(nbytes // 4, world)
    return numel - numel % world


def _payload(kind: str, nbytes: int, world: int) -> int:
    """The whole buffer a call of ``kind`` moves for a per-rank payload of ``nbytes`` (a gather's output)."""
    return _numel(nbytes, world) * 4 * (world if kind == "all_gather" else 1)


def _collective(kind: str, nbytes: int, world: int, device: torch.device):
    numel = _numel(nbytes, world)
    x = torch.ones(numel, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x)
    if kind == "all_gather":
        out = torch.empty(numel * world, device=device)
        return lambda: dist.all_gather_into_tensor(out, x)
    if kind == "reduce_scatter":
        out = torch.empty(numel // world, device=device)
        return lambda: dist.reduce_scatter_tensor(out, x)
    out = torch.empty_like(x)
    return lambda: dist.all_to_all_single(out, x)


def collective_times(device: torch.device, rounds: int = ROUNDS) -> dict[str, list[float]]:
    """Seconds of one call of each collective kind at each of ``SIZES``: per kind and size, the median over
    ``rounds`` of the fastest of ``BURST`` calls back to back, the rounds calling every kind and size in turn;
    averaged over the ranks.

    On a machine whose ranks share cores a call either runs at once or waits for the scheduler (about 3 ms
    here), and the median of a few calls lands on one or the other: measured one kind after another with the
    median of 7, gloo's reduce-scatter read 0.45 to 1.02 GB/s in three calibrations of one hour, and the
    order of ZeRO-1 and ZeRO-2 moved with it. The fastest of a burst is the call that did not wait (the
    cost model prices waiting apart, as the meeting ``skew``), and taking the kinds in turn spreads what the
    machine does meanwhile over all of them: three calibrations then read within 5-14% (all-reduce 2.34-2.47
    GB/s, reduce-scatter 0.62-0.71)."""
    world = dist.get_world_size()
    calls = {(kind, size): _collective(kind, size, world, device) for kind in KINDS for size in SIZES}
    for _ in range(WARMUP):
        for fn in calls.values():
            fn()
    times: dict[tuple[str, int], list[float]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, fn in calls.items():
            times[key].append(_timed(fn, device, repeats=BURST, warmup=1, reduce=min))
    medians = torch.tensor([statistics.median(times[key]) for key in calls], dtype=torch.float64, device=device)
    dist.all_reduce(medians)
    mean = (medians / world).tolist()
    return {kind: [mean[i * len(SIZES) + j] for j in range(len(SIZES))] for i, kind in enumerate(KINDS)}


def collective_fit(kind: str, times: list[float], world: int) -> tuple[float, float, float]:
    """(alpha seconds, bandwidth bytes/s, largest relative error of the fit) for ``kind`` over ``world`` ranks,
    from the seconds of one call at each of ``SIZES``."""
    ring = 2 * (world - 1) / world if kind == "all_reduce" else (world - 1) / world
    xs, ts = [ring * _payload(kind, size, world) for size in SIZES], times
    # relative least squares: minimise sum(((alpha + slope * x - t) / t) ** 2), small and large sizes alike
    w = [1 / t ** 2 for t in ts]
    s0, s1, s2 = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * x * x for wi, x in zip(w, xs))
    b0, b1 = sum(wi * t for wi, t in zip(w, ts)), sum(wi * x * t for wi, x, t in zip(w, xs, ts))
    det = s0 * s2 - s1 * s1
    alpha, slope = (b0 * s2 - s1 * b1) / det, (s0 * b1 - s1 * b0) / det
    slope = max(slope, 1e-13)             # (no slower than 10 TB/s: a fit that found none)
    alpha = max(alpha, 1e-6)
    error = max(abs(alpha + slope * x - t) / t for x, t in zip(xs, ts))
    return alpha, 1 / slope, error


def meeting_skew(device: torch.device, repeats: int = 5, meetings: int = 16) -> float:
    """``skew``: what a collective waits for the slowest rank beyond its idle latency, after ``t`` seconds of the
    same compute on every rank, over sqrt(t).

    A step's collectives are many and each waits a little, so the wait is measured the same way: ``meetings``
    segments of 1, 4 or 16 ms of a step's mix of work (a matmul and a memory-bound add; matmuls alone jitter
    less), each followed by a 4 KB all-reduce, against the same work without them, run in turn so that both
    see the same machine. Per segment length, the median over ``repeats`` of the excess per meeting, averaged
    over the ranks (a step waits on all of them), fitted by least squares to ``skew * sqrt(segment)``. One wait
    varies from nothing to several milliseconds; docs/design.md has the spread of this mean."""
    x = torch.ones(1024, device=device)
    a, b = torch.randn(256, 256, device=device), torch.randn(256, 256, device=device)
    u, v, w = (torch.randn(1 << 20, device=device) for _ in range(3))

    def work():         # a step's mix: a matmul and a memory-bound op (the jitter grows with memory traffic)
        torch.mm(a, b)
        torch.add(u, v, out=w)

    unit = torch.tensor(_timed(work, device), dtype=torch.float64, device=device)
    dist.broadcast(unit, 0)        # (every rank must run as many all-reduces)
    unit = unit.item()
    idle = _timed(lambda: dist.all_reduce(x), device, repeats=50)      # (one outlier is a millisecond)

    def segments(count: int, per: int, meet: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(count):
            for _ in range(per):
                work()
            if meet:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    lengths, excess = [], []
    for seconds in (1e-3, 4e-3, 16e-3):
        per = max(round(seconds / unit), 1)
        segments(meetings, per, True)
        runs = [(segments(meetings, per, True) - segments(meetings, per, False)) / meetings - idle
                for _ in range(repeats)]
        lengths.append(per * unit)
        excess.append(statistics.median(runs))
    mean = torch.tensor(excess, dtype=torch.float64, device=device)
    dist.all_reduce(mean)
    excess = (mean / dist.get_world_size()).tolist()
    roots = [t ** 0.5 for t in lengths]
    return max(sum(e * r for e, r in zip(excess, roots)) / sum(r * r for r in roots), 0.0)


__all__ = ["calibrate", "main"]


def gpu_profile_name(device: torch.device) -> str:
    """The built-in profile a GPU's calibration starts from (its links, how it runs attention and collectives),
    by the device's name; the generic ``"cuda"`` for a GPU without one."""
    name = torch.cuda.get_device_name(device).upper()
    for marker, profile in (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb")):
        if marker in name:
            return profile
    return "cuda"


def calibrate(device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[DeviceProfile, dict]:
    """This machine's profile, and the fit errors per collective kind."""
    flops, bandwidth = compute_rates(device, dtype)
    base = DEFAULT_PROFILES[gpu_profile_name(device) if device.type == "cuda" else "cpu"]
    rates = dict(base.rates)
    if device.type == "cuda":      # (each dtype's matmuls measured; kept in a step at SUSTAINED of that, as the
        rates["float32"] = SUSTAINED * compute_rates(device, torch.float32)[0]      # built-in profiles say)
        rates["bfloat16"] = rates["float16"] = SUSTAINED * compute_rates(device, torch.bfloat16)[0]
        rates = {k: float(f"{v:.4g}") for k, v in rates.items()}
        flops = rates.get(str(dtype).removeprefix("torch."), flops)
    alpha, links, errors, skew = dict(base.alpha_s), dict(base.bandwidth), {}, base.skew
    table, table_ranks = {}, 0
    if dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        for kind, times in collective_times(device).items():
            alpha[kind], links[kind], errors[kind] = collective_fit(kind, times, world)
            table[kind] = tuple((_payload(kind, size, world), float(f"{t:.4g}")) for size, t in zip(SIZES, times))
        table_ranks = world
        skew = statistics.median(meeting_skew(device) for _ in range(3))     # (one in twenty reads 0)
    world = dist.get_world_size() if dist.is_initialized() else 1
    backend = dist.get_backend() if dist.is_initialized() else "none"
    name = f"calibrated {device.type}/{backend}, {world} rank(s), {str(dtype).replace('torch.', '')}"
    return dataclasses.replace(base, name=name, flops_per_s=float(f"{flops:.4g}"), rates=rates,
                               bytes_per_s=float(f"{bandwidth:.4g}"), launch_s=float(f"{launch_seconds(device):.3g}"),
                               alpha_s={k: float(f"{v:.4g}") for k, v in alpha.items()},
                               bandwidth={k: float(f"{v:.4g}") for k, v in links.items()},
                               skew=float(f"{skew:.4g}"), table=table, table_ranks=table_ranks), errors


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dynshard.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the profile file to write (JSON)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    start = time.perf_counter()
    profile, errors = calibrate(device, getattr(torch, args.dtype))
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(args.out, "w") as f:
            f.write(profile.to_json() + "\n")
        fits = ", ".join(f"{k} {v:.0%}" for k, v in errors.items()) or "none (one process)"
        print(f"dynshard.calibrate: wrote {args.out} in {time.perf_counter() - start:.1f}s; largest fit error per "
              f"collective: {fits}\n{profile.to_json()}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

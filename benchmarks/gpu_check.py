"""One-GPU check: dynshard on one CUDA device against eager and Inductor, and autodist's cost model against
the step it predicts. Self-contained (dynshard need not be installed: the repository root and tests/ are put
on sys.path here, and the "dynshard" backend is registered with Dynamo when no entry point provides it).

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_check.py --out DIR
    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_check.py --device cpu --out /tmp/gpucheck --small

Sections (each timed; one that raises is printed with its traceback and the next one runs; DIR/gpu_check.json
is rewritten after every section, so a partial run keeps what it measured):

1. environment: Python, torch, CUDA, cuDNN, Triton, numpy, scipy, the device, the repository's commit, and
   whether ``import dynshard`` works;
2. calibration: ``dynshard.autodist.calibrate.compute_rates`` (square matmuls, a 64 MB copy) in fp32 (TF32 off, as the
   training runs), fp32 with TF32 on (CUDA), and bf16, beside the built-in profiles of
   ``dynshard.autodist.device_profile.DEFAULT_PROFILES``; and the profile ``python -m dynshard.calibrate`` writes
   for one process (fp32 compute measured, the built-in collective constants) as DIR/<device>_profile.json;
3. prediction: ``dynshard.plan`` on the meta device for each case (world size 1, no process group: it must
   run before the training's group exists): the dp plan's ``Plan.predicted`` under the calibrated profile and
   under the built-in one, and autodist (plan_ngpus 1) under the calibrated profile;
4. training: the bench GPT (tests/models.py) per case, the same initial weights and batches, SGD with
   momentum, ``--steps`` steps, under eager, ``torch.compile(backend="inductor")`` and
   ``torch.compile(backend="dynshard", options=dynshard.Config(policy="dp"))``: the first step (compile
   included), the median steady step (after ``--warmup`` steps, synchronized), peak memory, the ratio
   dynshard / inductor, and parity against eager (losses, final parameters; the tests' SGD standard is
   rtol 1e-4 / atol 1e-6 element by element). Where dynshard fails, ``Config(policy="dp", compiler="aot_eager")``
   runs in its place as "dynshard-aot_eager" (its planning and runtime without Inductor; ``--no-fallback``);
5. predicted vs measured: section 3's step and compute seconds against section 4's measured steps.

fp32 throughout: TF32 is switched off for matmuls and cuDNN, so parity is fp32's.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (os.path.join(ROOT, "tests"), ROOT):       # ROOT first: this checkout's dynshard, not an install
    if _path in sys.path:
        sys.path.remove(_path)
    sys.path.insert(0, _path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from models import GPT, GPTConfig, gpt_batch  # noqa: E402

CASES = {       # name -> GPTConfig fields and batch
    "bench": dict(d_model=256, layers=4, heads=4, seq=128, vocab=4096, batch=8),     # bench_autodist's defaults
    "large": dict(d_model=1024, layers=8, heads=16, seq=1024, vocab=32768, batch=8),
}
SMALL_CASES = {
    "bench": dict(d_model=64, layers=2, heads=4, seq=32, vocab=512, batch=4),
    "large": dict(d_model=128, layers=2, heads=4, seq=64, vocab=1024, batch=4),
}
SYSTEMS = ("eager", "inductor", "dynshard")
FALLBACK = "dynshard-aot_eager"     # run when "dynshard" fails: dynshard's planning and runtime, no Inductor
RTOL, ATOL = 1e-4, 1e-6         # tests/parity.py's SGD standard

RESULTS: dict = {"sections": {}}
OUT_DIR = "."


# ---------------------------------------------------------------------------------------------------------- utils

def plain(value):
    """JSON-ready: mappings (mappingproxy too) to dicts, tuples to lists, tensors and numbers to floats."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def dump() -> None:
    path = os.path.join(OUT_DIR, "gpu_check.json")
    with open(path + ".tmp", "w") as f:
        json.dump(plain(RESULTS), f, indent=1)
    os.replace(path + ".tmp", path)


def table(rows: list[tuple]) -> str:
    rows = [tuple("-" if c is None else str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt(value, spec: str = ".4g", scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def say(text: str = "") -> None:
    print(text, flush=True)


def run_section(key: str, title: str, fn, *args):
    """Run one section: its output, its seconds, and its exception (printed, recorded, not raised)."""
    say(f"\n{'=' * 100}\n{title}\n{'=' * 100}")
    record = RESULTS["sections"].setdefault(key, {})
    start = time.perf_counter()
    try:
        value = fn(record, *args)
        record["ok"] = True
    except Exception as error:      # noqa: BLE001 - report it and go on with the next section
        value = None
        record["ok"] = False
        record["error"] = f"{type(error).__name__}: {error}"
        record["traceback"] = traceback.format_exc()
        say(f"!! section {key!r} failed: {record['error']}\n{record['traceback']}")
    record["seconds"] = round(time.perf_counter() - start, 2)
    say(f"-- section {key!r}: {record['seconds']:.1f}s")
    dump()
    return value


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def environ_without(*names: str):
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def ensure_dynshard_backend() -> str:
    """``backend="dynshard"`` resolves through the package's entry point when it is installed; here it may not
    be: register this checkout's backend function under that name (dynshard's runtime recognises its programs
    by looking the name up in the same registry)."""
    import dynshard.backend
    from torch._dynamo.backends.registry import lookup_backend, register_backend

    try:
        found = lookup_backend("dynshard")
    except Exception:       # noqa: BLE001 - InvalidBackend: no entry point
        register_backend(compiler_fn=dynshard.backend.dynshard_backend, name="dynshard")
        return "registered here (no entry point)"
    if found is dynshard.backend.dynshard_backend:
        return "entry point (this checkout)"
    return f"entry point resolves to {getattr(found, '__module__', '?')} (not this checkout's function)"


def case_config(name: str, args) -> tuple[GPTConfig, int]:
    fields = dict((SMALL_CASES if args.small else CASES)[name])
    for spec in args.case or ():
        case, _, assignments = spec.partition(":")
        if case == name:
            for item in filter(None, assignments.split(",")):
                key, _, value = item.partition("=")
                fields[key.strip()] = int(value)
    batch = fields.pop("batch")
    return GPTConfig(**fields), batch


def describe_case(cfg: GPTConfig, batch: int) -> str:
    return (f"d_model {cfg.d_model}, layers {cfg.layers}, heads {cfg.heads}, seq {cfg.seq}, vocab {cfg.vocab}, "
            f"batch {batch}")


def parameter_count(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def model_flops(cfg: GPTConfig, batch: int) -> float:
    """Analytic FLOPs of one training step (forward + backward = 3 forwards): the matmuls of the blocks and the
    LM head, and attention's two batched matmuls (the whole T x T square, as SDPA's math path counts it)."""
    d, tokens = cfg.d_model, batch * cfg.seq
    per_layer = 2 * tokens * (4 * d * d + 2 * 4 * d * d) + 2 * 2 * batch * cfg.seq * cfg.seq * d
    return 3 * (cfg.layers * per_layer + 2 * tokens * d * cfg.vocab)


# ---------------------------------------------------------------------------------------------------- sections

def section_environment(record: dict, device: torch.device) -> None:
    info = dict(python=platform.python_version(), platform=platform.platform(), torch=torch.__version__,
                cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(), device=str(device),
                cpu_count=os.cpu_count(), world_size=int(os.environ.get("WORLD_SIZE", 1)))
    if torch.backends.cudnn.is_available():
        info["cudnn"] = torch.backends.cudnn.version()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=torch.cuda.get_device_name(device), capability=f"{props.major}.{props.minor}",
                    device_memory_gib=round(props.total_memory / 2 ** 30, 1), multiprocessors=props.multi_processor_count,
                    allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32, allow_tf32_cudnn=torch.backends.cudnn.allow_tf32)
    else:
        info["device_name"] = platform.processor() or platform.machine()
    for module in ("triton", "numpy", "scipy", "sympy"):
        try:
            info[module] = __import__(module).__version__
        except Exception as error:      # noqa: BLE001
            info[module] = f"missing ({type(error).__name__})"
    try:
        info["commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except Exception:       # noqa: BLE001
        info["commit"] = None
    try:
        import dynshard

        info["dynshard"] = os.path.dirname(dynshard.__file__)
        info["dynshard_backend"] = ensure_dynshard_backend()
    except Exception as error:      # noqa: BLE001
        info["dynshard"] = f"import failed: {type(error).__name__}: {error}"
    record.update(info)
    say(table([("what", "value")] + [(k, v) for k, v in info.items()]))


def section_calibration(record: dict, device: torch.device, args) -> str:
    from dynshard.autodist import calibrate as calibration
    from dynshard.autodist.device_profile import DEFAULT_PROFILES, DeviceProfile

    rows = []
    measured = {}
    dtypes = [("float32", torch.float32, False)]
    if device.type == "cuda":
        dtypes.append(("float32 (TF32 on)", torch.float32, True))
    if not args.skip_bf16:
        dtypes.append(("bfloat16", torch.bfloat16, False))
    for label, dtype, tf32 in dtypes:
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            start = time.perf_counter()
            flops, bandwidth = calibration.compute_rates(device, dtype)
            measured[label] = dict(flops_per_s=flops, bytes_per_s=bandwidth, seconds=time.perf_counter() - start)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
    record["compute_rates"] = measured
    builtin = {name: DEFAULT_PROFILES[name] for name in ("cuda", "cpu")}
    record["builtin_profiles"] = {name: json.loads(p.to_json()) for name, p in builtin.items()}
    cuda = builtin["cuda"]
    for label, m in measured.items():
        rows.append((f"measured {label}", fmt(m["flops_per_s"], ".3f", 1e-12), fmt(m["bytes_per_s"], ".1f", 1e-9),
                     fmt(m["flops_per_s"] / cuda.flops_per_s, ".3f"), fmt(m["bytes_per_s"] / cuda.bytes_per_s, ".3f"),
                     f"{m['seconds']:.1f}"))
    for name, p in builtin.items():
        rows.append((f"built-in {name!r} ({p.name})", fmt(p.flops_per_s, ".3f", 1e-12), fmt(p.bytes_per_s, ".1f", 1e-9),
                     fmt(p.flops_per_s / cuda.flops_per_s, ".3f"), fmt(p.bytes_per_s / cuda.bytes_per_s, ".3f"), ""))
    say(table([("rates", "TFLOP/s", "GB/s (copy r+w)", "flops / built-in cuda", "bytes / built-in cuda", "took s")]
              + rows))

    # the profile file, as `python -m dynshard.calibrate --out PATH` writes it for one process
    path = os.path.join(OUT_DIR, f"{device.type}_profile.json")
    if not dist.is_initialized() and (device.type == "cuda") == torch.cuda.is_available():
        # its main() picks the device itself (CUDA when there is one) and, under torchrun, would make a process
        # group and destroy it: hide WORLD_SIZE so it measures as the one process it is
        say(f"\ncalling dynshard.calibrate.main(['--out', {path!r}]) (one process: compute measured, "
            "collectives built in):")
        with environ_without("WORLD_SIZE"):
            calibration.main(["--out", path])
        record["profile_written_by"] = "dynshard.calibrate.main"
    else:
        profile, _ = calibration.calibrate(device, torch.float32)
        with open(path, "w") as f:
            f.write(profile.to_json() + "\n")
        record["profile_written_by"] = "dynshard.calibrate.calibrate"
        say(f"\nwrote {path} with dynshard.calibrate.calibrate():\n{profile.to_json()}")
    with open(path) as f:
        profile = DeviceProfile.from_json(f.read())
    record["profile_path"] = path
    record["profile"] = json.loads(profile.to_json())
    base = builtin["cuda" if device.type == "cuda" else "cpu"]
    say(f"\nprofile {path}: {profile.name}: flops_per_s {profile.flops_per_s:.4g} "
        f"({profile.flops_per_s / base.flops_per_s:.2f}x built-in {device.type}), bytes_per_s {profile.bytes_per_s:.4g} "
        f"({profile.bytes_per_s / base.bytes_per_s:.2f}x)")
    return path


def section_prediction(record: dict, device: torch.device, args, profile_path: str | None) -> dict:
    """dynshard.plan on the meta device (world size 1): the dp plan's predicted step under the calibrated and
    the built-in profiles, and autodist's choice under the calibrated one."""
    import dynshard

    builtin = "cuda" if device.type == "cuda" else "cpu"
    profiles = ([("calibrated", profile_path)] if profile_path else []) + [(f"built-in {builtin}", builtin)]
    rows, out = [], {}
    for case in args.cases:
        cfg, batch = case_config(case, args)
        with torch.device("meta"):
            model = GPT(cfg)
        sample = gpt_batch(cfg, batch, 0)
        mine = out.setdefault(case, {})
        for label, profile in profiles:
            key = f"dp / {label}"
            try:
                start = time.perf_counter()
                plan, = dynshard.plan(model, sample, dynshard.Config(policy="dp"), world_size=1,
                                      device_profile=profile)
                mine[key] = dict(plain(plan.predicted.to_dict()), plan_seconds=round(time.perf_counter() - start, 2))
            except Exception as error:      # noqa: BLE001
                mine[key] = dict(error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
        if profile_path:
            key = "autodist plan_ngpus 1 / calibrated"
            try:
                start = time.perf_counter()
                plan, = dynshard.plan(model, sample, dynshard.Config(
                    policy="autodist", plan_ngpus=1, pas_config={"device_profile": profile_path}), world_size=1)
                predicted = plain(plan.predicted.to_dict())
                mine[key] = dict(predicted, plan_seconds=round(time.perf_counter() - start, 2))
            except Exception as error:      # noqa: BLE001
                mine[key] = dict(error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
        for key, p in mine.items():
            if "error" in p:
                say(f"!! {case} {key}: {p['error']}\n{p['traceback']}")
                rows.append((case, key, "failed", "", "", "", "", ""))
                continue
            chose = (p.get("autodist") or {}).get("chosen", "")
            peak = (p.get("bytes_per_rank") or {}).get("peak")
            rows.append((case, key, fmt(p.get("step_seconds"), ".4g"), fmt(p.get("compute_seconds"), ".4g"),
                         fmt(p.get("communication_seconds"), ".3g"), fmt(peak, ".1f", 2 ** -20), chose,
                         f"{p['plan_seconds']:.1f}"))
    record["cases"] = out
    say(table([("case", "plan / profile", "predicted step s", "compute s", "comm s", "peak MiB", "autodist chose",
                "planned in s")] + rows))
    say("(the cost model prices forward + backward as 3 forwards of FLOPs and memory-bound bytes; not the "
        "optimizer step; its peak counts Adam's two moments, the training here keeps SGD's one)")
    return out


def train_system(system: str, base: GPT, batches, device: torch.device, args) -> dict:
    model = copy.deepcopy(base).to(device)
    if system == "eager":
        fn = model
    elif system == "inductor":
        torch._dynamo.reset()
        fn = torch.compile(model, backend="inductor")
    else:
        import dynshard

        ensure_dynshard_backend()
        torch._dynamo.reset()
        compiler = "aot_eager" if system == FALLBACK else "inductor"
        fn = torch.compile(model, backend="dynshard", options=dynshard.Config(policy="dp", compiler=compiler))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for x, y in batches:
        synchronize(device)
        start = time.perf_counter()
        loss = fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.detach())
    steady = times[args.warmup:] or times[-1:]
    result = dict(first_step_s=times[0], step_s=statistics.median(steady), min_step_s=min(steady), times=times,
                  losses=[float(v) for v in losses])
    if device.type == "cuda":
        result["peak_bytes"] = torch.cuda.max_memory_allocated(device)
    if system.startswith("dynshard"):
        try:
            import dynshard

            report = dynshard.explain(fn)
            result["programs"] = len(report.programs)
            result["collectives"] = len(report.collectives())
            result["explain"] = str(report)
        except Exception as error:      # noqa: BLE001
            result["explain_error"] = f"{type(error).__name__}: {error}"
    params = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
    del fn, model, opt, loss, losses
    free_memory(device)
    return result, params


def compare(params: dict, ref: dict, losses: list[float], ref_losses: list[float]) -> dict:
    loss_rel = max((abs(a - b) / abs(b) if b else abs(a - b)) for a, b in zip(losses, ref_losses))
    worst_rel, worst_name, max_abs, failing, total = 0.0, None, 0.0, 0, 0
    for name, want in ref.items():
        have = params[name]
        diff = (have - want).abs()
        rel = float(diff.max() / want.abs().max().clamp_min(1e-30))
        if rel > worst_rel:
            worst_rel, worst_name = rel, name
        max_abs = max(max_abs, float(diff.max()))
        failing += int((diff > ATOL + RTOL * want.abs()).sum())
        total += want.numel()
    return dict(loss_max_rel=loss_rel, param_max_rel=worst_rel, param_worst=worst_name, param_max_abs=max_abs,
                elements_outside_rtol=failing, elements=total, within_standard=failing == 0)


def section_training(record: dict, device: torch.device, args) -> dict:
    out = {}
    for case in args.cases:
        cfg, batch = case_config(case, args)
        say(f"\n[{case}] GPT {describe_case(cfg, batch)}; {parameter_count(cfg) / 1e6:.2f}M parameters; "
            f"{args.steps} steps, median of the last {max(args.steps - args.warmup, 1)}; SGD lr {args.lr} momentum 0.9")
        torch.manual_seed(args.seed)
        base = GPT(cfg)             # on the CPU: the same initial weights on every device
        batches = [tuple(t.to(device) for t in gpt_batch(cfg, batch, i)) for i in range(args.steps)]
        mine = out.setdefault(case, dict(config=dict(vars(cfg), batch=batch), systems={}, parity={}))
        record["cases"] = out
        params = {}
        systems = list(SYSTEMS)
        for system in systems:
            start = time.perf_counter()
            try:
                result, params[system] = train_system(system, base, batches, device, args)
            except Exception as error:      # noqa: BLE001
                result = dict(error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
                say(f"!! {case} {system} failed: {result['error']}\n{result['traceback']}")
                free_memory(device)
                if system == "dynshard" and not args.no_fallback:
                    say(f"   (then {FALLBACK}: Config(policy='dp', compiler='aot_eager'), to separate planning and "
                        "runtime from dynshard's Inductor compile)")
                    systems.append(FALLBACK)
            result["wall_s"] = round(time.perf_counter() - start, 2)
            mine["systems"][system] = result
            say(f"   {system}: {result['wall_s']:.1f}s" + (" (failed)" if "error" in result else ""))
            dump()
        flops = model_flops(cfg, batch)
        rows = []
        for system, r in mine["systems"].items():
            if "error" in r:
                rows.append((system, "failed", "", "", "", "", "", ""))
                continue
            rows.append((system, f"{r['first_step_s']:.2f}", f"{r['step_s'] * 1e3:.2f}", f"{r['min_step_s'] * 1e3:.2f}",
                         fmt(flops / r["step_s"], ".2f", 1e-12), fmt(r.get("peak_bytes"), ".0f", 2 ** -20),
                         f"{r['losses'][0]:.6f}", f"{r['losses'][-1]:.6f}"))
        say(table([("system", "first step s", "median step ms", "min step ms", "model TFLOP/s", "peak MiB",
                    "loss 0", "last loss")] + rows))
        steps = {s: r.get("step_s") for s, r in mine["systems"].items()}
        if steps.get("dynshard") and steps.get("inductor"):
            mine["dynshard_over_inductor"] = steps["dynshard"] / steps["inductor"]
            say(f"dynshard / inductor median step: {mine['dynshard_over_inductor']:.3f}x")
        if steps.get("inductor") and steps.get("eager"):
            mine["inductor_over_eager"] = steps["inductor"] / steps["eager"]
            say(f"inductor / eager median step:    {mine['inductor_over_eager']:.3f}x")
        rows = []
        for system in ("inductor", "dynshard", FALLBACK):
            if system in params and "eager" in params:
                c = compare(params[system], params["eager"], mine["systems"][system]["losses"],
                            mine["systems"]["eager"]["losses"])
                mine["parity"][f"{system} vs eager"] = c
                rows.append((f"{system} vs eager", f"{c['loss_max_rel']:.2e}", f"{c['param_max_rel']:.2e}",
                             f"{c['param_max_abs']:.2e}", f"{c['elements_outside_rtol']}/{c['elements']}",
                             c["param_worst"]))
        if "inductor" in params and "dynshard" in params:
            c = compare(params["dynshard"], params["inductor"], mine["systems"]["dynshard"]["losses"],
                        mine["systems"]["inductor"]["losses"])
            mine["parity"]["dynshard vs inductor"] = c
            rows.append(("dynshard vs inductor", f"{c['loss_max_rel']:.2e}", f"{c['param_max_rel']:.2e}",
                         f"{c['param_max_abs']:.2e}", f"{c['elements_outside_rtol']}/{c['elements']}", c["param_worst"]))
        if rows:
            say(table([("parity", "loss max rel", "param max rel (per tensor, inf-norm)", "param max abs",
                        f"elements outside rtol {RTOL:g} / atol {ATOL:g}", "worst tensor")] + rows))
        del params, base, batches
        free_memory(device)
        dump()
    return out


def section_versus(record: dict, predicted: dict | None, measured: dict | None) -> None:
    if not predicted or not measured:
        raise RuntimeError("needs both the prediction (section 3) and the training (section 4)")
    rows = []
    for case, plans in predicted.items():
        systems = (measured.get(case) or {}).get("systems", {})
        dyn, ind = systems.get("dynshard", {}).get("step_s"), systems.get("inductor", {}).get("step_s")
        peak = systems.get("dynshard", {}).get("peak_bytes")
        for key, p in plans.items():
            if "error" in p:
                continue
            step, compute = p.get("step_seconds"), p.get("compute_seconds")
            predicted_peak = (p.get("bytes_per_rank") or {}).get("peak")
            row = dict(case=case, plan=key, predicted_step_s=step, predicted_compute_s=compute, measured_dynshard_s=dyn,
                       measured_inductor_s=ind, predicted_over_measured=step / dyn if step and dyn else None,
                       compute_over_measured=compute / dyn if compute and dyn else None,
                       predicted_peak_bytes=predicted_peak, measured_peak_bytes=peak)
            record.setdefault("rows", []).append(row)
            rows.append((case, key, fmt(step, ".4g", 1e3), fmt(compute, ".4g", 1e3), fmt(dyn, ".4g", 1e3),
                         fmt(row["predicted_over_measured"], ".3f"), fmt(row["compute_over_measured"], ".3f"),
                         fmt(step / ind if step and ind else None, ".3f"),
                         fmt(predicted_peak, ".0f", 2 ** -20), fmt(peak, ".0f", 2 ** -20)))
    say(table([("case", "plan / profile", "predicted step ms", "predicted compute ms", "measured dynshard ms",
                "predicted/measured", "compute/measured", "predicted/inductor", "predicted peak MiB",
                "measured peak MiB")] + rows))


# -------------------------------------------------------------------------------------------------------- main

def main() -> None:
    global OUT_DIR
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for gpu_check.json and <device>_profile.json")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--small", action="store_true", help="tiny cases (a CPU smoke test)")
    parser.add_argument("--cases", default="bench,large", help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--case", action="append", metavar="NAME:key=value,...",
                        help="override a case's sizes, e.g. large:layers=4,batch=4 (keys: d_model, layers, heads, "
                             "seq, vocab, batch); repeatable")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones (the first compiles)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-bf16", action="store_true", help="no bf16 compute rate (slow on some CPUs)")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--no-fallback", action="store_true",
                        help=f"when dynshard (Inductor) fails, do not run {FALLBACK} in its place")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU runs on a busy machine)")
    args = parser.parse_args()
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {list(CASES)}")
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    if int(os.environ.get("WORLD_SIZE", 1)) != 1:
        raise SystemExit("gpu_check.py is a one-process check: torchrun --standalone --nproc-per-node 1 ...")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    # fp32 as fp32: no TF32 in matmuls or convolutions (parity, and the rate the profile records)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.threads:
        torch.set_num_threads(args.threads)
    OUT_DIR = args.out
    os.makedirs(OUT_DIR, exist_ok=True)
    RESULTS["args"] = vars(args)
    RESULTS["started"] = time.strftime("%Y-%m-%d %H:%M:%S")
    total = time.perf_counter()
    say(f"gpu_check: device {device}, cases {args.cases} ({'small' if args.small else 'full'} sizes), "
        f"writing {os.path.join(OUT_DIR, 'gpu_check.json')}")

    run_section("environment", "1. environment", section_environment, device)
    profile_path = run_section("calibration", "2. calibration: dynshard.calibrate.compute_rates vs the built-in profiles",
                               section_calibration, device, args)
    # dynshard.plan stands in a process group of its own: before the training's group exists
    predicted = run_section("prediction", "3. cost model: dynshard.plan (meta device, world size 1), Plan.predicted",
                            section_prediction, device, args, profile_path)
    measured = None
    if not args.skip_training:
        if not dist.is_initialized() and "WORLD_SIZE" in os.environ:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        measured = run_section("training", "4. single-rank training: eager vs inductor vs dynshard (dp), fp32",
                               section_training, device, args)
        run_section("versus", "5. predicted (section 3) vs measured (section 4) step", section_versus, predicted,
                    measured)
    RESULTS["total_seconds"] = round(time.perf_counter() - total, 1)
    say(f"\n{'=' * 100}\nsection seconds: " + ", ".join(
        f"{k} {v.get('seconds', 0):.1f}" + ("" if v.get("ok") else " (FAILED)") for k, v in RESULTS["sections"].items())
        + f"; total {RESULTS['total_seconds']:.1f}s\nwrote {os.path.join(OUT_DIR, 'gpu_check.json')}")
    dump()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One checkpoint benchmark job: one plan (or the plain torch baseline) in its own process group (launched by
bench_checkpoint.py).

    torchrun --standalone --nproc-per-node 2 benchmarks/checkpoint_job.py --system ckpt:tp \\
        --ckpt-dir /tmp/ckpt --out r.json
    torchrun --standalone --nproc-per-node 2 benchmarks/checkpoint_job.py --system ckpt:dp \\
        --ckpt-dir /tmp/ckpt --load-from tp --out r.json                  # tp's checkpoint must be there
    torchrun --standalone --nproc-per-node 1 benchmarks/checkpoint_job.py --system ckpt:torch \\
        --ckpt-dir /tmp/ckpt --out r.json

Every system trains tests/workers_pipeline.py's EndToEndGPT (tests/models.py's GPT, a dict batch in, the loss
out, so that the pipeline plan runs the same module) with torch.optim.AdamW, --steps steps on the same global
batches (split over the data-parallel units; pp: train_step over pipeline_nmicros micro-batches, the gradient
of their mean loss, as tests/workers_checkpoint_matrix.py's Run). Then, on every rank:

- save: --repeat times dynshard.checkpoint.save(<ckpt-dir>/<plan>/save<i>, model, opt, extra=...) to a new
  path, a barrier before each; each rank's wall time (the result keeps the max over ranks of each repeat);
- bytes: the size of each ``__<rank>_0.distcp`` file and of ``.metadata`` of the first save, and per file
  (from DCP's metadata) its write items, their tensor bytes and those of keys aliasing another key's tensor
  (lm_head.weight, tied to wte.weight); what each rank holds (its parameter pieces, tied ones once, and its
  AdamW state tensors, the scalar steps included);
- load: a new model of the same plan (another seed, Dynamo reset) takes its first step on another batch, then
  loads its own plan's checkpoint and each --load-from plan's, --repeat times each, a barrier before each,
  wall time per rank. Before every load the model's parameters and AdamW state are overwritten with other
  values, and after it the whole parameters (dynshard.collect_state_dict) and AdamW state (gathered over tp,
  ZeRO and stages) must equal, bitwise, what the saving job had when it saved (its reference.pt), and load
  must return the saved extra: the job fails otherwise.

ckpt:torch (one process, eager): the same model and steps, then torch.save({"model": model.state_dict(),
"optim": opt.state_dict()}) to one file, flushed and fsync'd (DCP's FileSystemWriter fsyncs its files too),
--repeat times; load: torch.load + load_state_dict of both into a new model after its first step, checked the
same way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))              # dynshard itself, when it is not installed
from gpt_job import add_run_arguments  # noqa: E402
from models import GPTConfig, gpt_batch  # noqa: E402

LR = 1e-4
NMICROS = 2
# plan -> Config options (the job adds compiler=)
PLANS = {
    "dp": dict(policy="dp", plan_ngpus=1),
    "tp": dict(policy="tp", plan_ngpus=2),
    "zero3": dict(policy="dp", plan_ngpus=1, use_zero=3),
    "pp": dict(policy="pp", plan_ngpus=2, use_end2end=True, pas_config={"pipeline_nmicros": NMICROS}),
}
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """The model flags of gpt_job (--steps: training steps before the save; --warmup: the loading model's
    steps before its loads) and the checkpoint flags, shared with the driver (bench_checkpoint.py)."""
    add_run_arguments(parser)
    parser.set_defaults(steps=2, warmup=1)
    parser.add_argument("--repeat", type=int, default=3, help="saves and loads of each checkpoint (median)")
    parser.add_argument("--compiler", default="aot_eager", choices=("aot_eager", "inductor"),
                        help="dynshard's Config.compiler")


def system_plan(system: str) -> str:
    name = system.partition(":")[2]
    if not system.startswith("ckpt:") or name not in (*PLANS, "torch"):
        raise SystemExit(f"unknown system {system!r}: ckpt:<{'|'.join([*PLANS, 'torch'])}>")
    return name


def checkpoint_path(root: str, plan: str) -> str:
    """The checkpoint a plan's job leaves for the others (its first save)."""
    return os.path.join(root, plan, "save0")


def reference_path(root: str, plan: str) -> str:
    return os.path.join(root, plan, "reference.pt")


def _rows(sample: dict, start: int, size: int) -> dict:
    return {k: v[start:start + size] for k, v in sample.items()}


class Run:
    """One plan's model, compiled program and AdamW on this rank (a new job in effect: Dynamo reset);
    plan "torch": the eager model on one process."""

    def __init__(self, plan: str, cfg: GPTConfig, args, seed: int):
        from workers_pipeline import EndToEndGPT

        torch._dynamo.reset()
        torch.manual_seed(seed)
        self.plan, self.cfg, self.batch = plan, cfg, args.batch
        self.model = EndToEndGPT(cfg)
        self.options = PLANS.get(plan)
        if self.options is None:
            self.compiled = self.model
        else:
            import dynshard

            self.compiled = torch.compile(self.model, backend="dynshard",
                                          options=dynshard.Config(compiler=args.compiler, **self.options))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def step(self, step: int) -> None:
        """One AdamW step on global batch ``step`` (this rank's data-parallel unit's rows of it)."""
        import dynshard

        idx, tgt = gpt_batch(self.cfg, self.batch, step)
        dp_rank, dp_size = dynshard.data_parallel_rank(self.options["plan_ngpus"] if self.options else 1)
        rows = self.batch // dp_size
        mine = _rows({"idx": idx, "tgt": tgt}, dp_rank * rows, rows)
        if self.options is not None and self.options["policy"] == "pp":
            samples = [_rows(mine, i * (rows // NMICROS), rows // NMICROS) for i in range(NMICROS)]
            dynshard.train_step(self.compiled, samples, scale_fn=lambda loss: loss / NMICROS)
        else:
            self.compiled(mine).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def full(self) -> dict[str, torch.Tensor]:
        """Whole parameters ("model.<key>") and AdamW state ("optim.<name>.<key>"); every rank takes part."""
        import dynshard
        from workers_checkpoint_matrix import full_optimizer_state

        if self.options is None:
            out = {f"model.{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        else:
            out = {f"model.{k}": v.detach().clone() for k, v in dynshard.collect_state_dict(self.compiled).items()}
        out.update({f"optim.{k}": v for k, v in full_optimizer_state(self.model, self.opt, STATE_KEYS).items()})
        return out

    def held_bytes(self) -> dict[str, int]:
        """What this rank stores: its parameter pieces (tied ones once) and its AdamW state tensors."""
        params = list({id(p): p for p in self.model.parameters()}.values())
        state = [v for p in params for v in self.opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        return dict(params=sum(p.numel() * p.element_size() for p in params),
                    optimizer=sum(v.numel() * v.element_size() for v in state))

    @torch.no_grad()
    def scramble(self, value: float) -> None:
        """Other parameters and AdamW state (a load must overwrite every one of them)."""
        for param in self.model.parameters():
            param.fill_(value)
            for entry in self.opt.state.get(param, {}).values():
                if isinstance(entry, torch.Tensor):
                    entry.fill_(value)


def full_state_bytes(cfg: GPTConfig) -> dict[str, int]:
    """The model's whole state: parameters (the tied embedding / LM head once), AdamW exp_avg and exp_avg_sq
    of their size, and one fp32 step scalar per parameter."""
    from workers_pipeline import EndToEndGPT

    with torch.device("meta"):
        model = EndToEndGPT(cfg)
    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return dict(params=nbytes, full=3 * nbytes + 4 * len(params), tensors=len(params))


def aliases(cfg: GPTConfig) -> set[str]:
    """Checkpoint keys of state-dict entries that are another entry's tensor (the tied LM head)."""
    from workers_pipeline import EndToEndGPT

    with torch.device("meta"):
        model = EndToEndGPT(cfg)
    seen, out = set(), set()
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            out.add(f"model.{key}")
        seen.add(id(value))
    return out


def file_breakdown(path: str, world: int, alias_keys: set[str]) -> list[dict[str, int]]:
    """Per rank's ``__<rank>_0.distcp`` (from DCP's metadata): items written, their tensor bytes, and the
    tensor bytes of keys in ``alias_keys``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(path).read_metadata()
    out = {f"__{r}_0.distcp": dict(items=0, tensor_bytes=0, alias_bytes=0) for r in range(world)}
    written = set()
    for index, where in metadata.storage_data.items():
        if (where.relative_path, where.offset, where.length) in written:
            continue        # a key whose entry points at bytes another key wrote (dynshard writes a tie once)
        written.add((where.relative_path, where.offset, where.length))
        entry = out.setdefault(where.relative_path, dict(items=0, tensor_bytes=0, alias_bytes=0))
        entry["items"] += 1
        meta = metadata.state_dict_metadata[index.fqn]
        if isinstance(meta, TensorStorageMetadata):
            chunk = next(c for c in meta.chunks if tuple(c.offsets) == tuple(index.offset))
            nbytes = math.prod(chunk.sizes) * meta.properties.dtype.itemsize
            entry["tensor_bytes"] += nbytes
            entry["alias_bytes"] += nbytes if index.fqn in alias_keys else 0
    return [out[f"__{r}_0.distcp"] for r in range(world)]


def check(loaded: dict, saved: dict, what: str) -> int:
    """Raise unless ``loaded`` equals ``saved`` bitwise, key by key; the number of tensors compared."""
    if set(loaded) != set(saved):
        raise SystemExit(f"{what}: keys differ: {sorted(set(loaded) ^ set(saved))[:5]}")
    wrong = [k for k in saved if loaded[k].shape != saved[k].shape or not torch.equal(loaded[k], saved[k])]
    if wrong:
        k = wrong[0]
        diff = ((loaded[k].float() - saved[k].float()).abs().max().item()
                if loaded[k].shape == saved[k].shape else f"shape {tuple(loaded[k].shape)} != {tuple(saved[k].shape)}")
        raise SystemExit(f"{what}: {len(wrong)} of {len(saved)} tensors differ from the saved ones, "
                         f"e.g. {k} (max |diff| {diff})")
    return len(saved)


def timed(fn) -> float:
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def torch_save(path: str, run: Run) -> None:
    with open(path, "wb") as f:
        torch.save({"model": run.model.state_dict(), "optim": run.opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load(path: str, run: Run) -> None:
    state = torch.load(path, weights_only=True)
    run.model.load_state_dict(state["model"])
    run.opt.load_state_dict(state["optim"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", required=True)
    add_checkpoint_arguments(parser)
    parser.add_argument("--ckpt-dir", required=True, help="where the checkpoints go (<dir>/<plan>/save<i>)")
    parser.add_argument("--load-from", default="", help="comma-separated plans whose checkpoints (already under "
                                                        "--ckpt-dir) this plan loads too")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    plan = system_plan(args.system)
    sources = [plan] + [s for s in args.load_from.split(",") if s]

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, heads=args.heads, layers=args.layers)
    root = os.path.join(args.ckpt_dir, plan)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()

    setup_start = time.perf_counter()
    run = Run(plan, cfg, args, seed=0)
    setup_s = time.perf_counter() - setup_start
    step_times = [timed(lambda i=i: run.step(i)) for i in range(args.steps)]
    saved = run.full()
    if rank == 0:
        torch.save(saved, reference_path(args.ckpt_dir, plan))
    held = run.held_bytes()
    extra = {"step": args.steps, "plan": plan}

    def save(i):
        if plan == "torch":
            os.makedirs(os.path.join(root, f"save{i}"), exist_ok=True)
            torch_save(os.path.join(root, f"save{i}", "state.pt"), run)
        else:
            import dynshard

            dynshard.checkpoint.save(os.path.join(root, f"save{i}"), run.compiled, run.opt, extra=extra)

    save_times = [timed(lambda i=i: save(i)) for i in range(args.repeat)]
    dist.barrier()
    first = checkpoint_path(args.ckpt_dir, plan)
    files = {name: os.path.getsize(os.path.join(first, name)) for name in sorted(os.listdir(first))}
    dist.barrier()
    if rank == 0:                       # keep the first save for the loads (here and in later jobs)
        for i in range(1, args.repeat):
            shutil.rmtree(os.path.join(root, f"save{i}"), ignore_errors=True)
    del run, saved

    new = Run(plan, cfg, args, seed=1)
    for i in range(args.warmup):
        new.step(1000 + i)
    loads = {}
    for source in sources:
        path = checkpoint_path(args.ckpt_dir, source)
        reference = torch.load(reference_path(args.ckpt_dir, source), weights_only=True)
        times, checked = [], 0
        for i in range(args.repeat):
            new.scramble(float(i + 1))
            got = [None]

            def load(path=path, got=got):
                if plan == "torch":
                    torch_load(os.path.join(path, "state.pt"), new)
                else:
                    import dynshard

                    got[0] = dynshard.checkpoint.load(path, new.compiled, new.opt)

            times.append(timed(load))
            what = f"rank {rank}: {source} -> {plan}, load {i}"
            if plan != "torch" and got[0] != {"step": args.steps, "plan": source}:
                raise SystemExit(f"{what}: load returned extra {got[0]!r}")
            checked = check(new.full(), reference, what)
        loads[source] = dict(times=times, tensors_checked=checked)

    mine = dict(step_times=step_times, setup_s=setup_s, save_times=save_times, held=held, loads=loads)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        save_max = [max(r["save_times"][i] for r in everyone) for i in range(args.repeat)]
        result = dict(
            system=args.system, plan=plan, world=world, config=vars(args), torch=torch.__version__,
            options=PLANS.get(plan), setup_s=max(r["setup_s"] for r in everyone),
            first_step_s=max(r["step_times"][0] for r in everyone),
            step_s=max(statistics.median(r["step_times"][1:] or r["step_times"]) for r in everyone),
            save_times=save_max, save_s=statistics.median(save_max),
            save_times_by_rank=[r["save_times"] for r in everyone],
            files=files, written_by_rank=[files.get(f"__{r}_0.distcp", 0) for r in range(world)],
            metadata_bytes=files.get(".metadata", 0), held_by_rank=[r["held"] for r in everyone],
            **full_state_bytes(cfg),
            loads={s: dict(times=(t := [max(r["loads"][s]["times"][i] for r in everyone)
                                       for i in range(args.repeat)]), load_s=statistics.median(t),
                           times_by_rank=[r["loads"][s]["times"] for r in everyone],
                           tensors_checked=everyone[0]["loads"][s]["tensors_checked"]) for s in sources})
        if plan == "torch":
            result["written_by_rank"] = [files["state.pt"]]
        else:
            result["breakdown_by_rank"] = file_breakdown(first, world, aliases(cfg))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

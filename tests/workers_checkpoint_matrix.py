"""What each rank runs in tests/test_checkpoint_matrix.py (module level, so spawned processes can import it).

Every plan trains the same end-to-end GPT (a dict batch in, the loss out; tied embedding and LM head; fused
``c_attn``, so tp holds ``_StridedShard`` pieces; 15 position rows, so ZeRO over 2 ranks pads a row) on the
same global batches: ``BATCH`` rows per step, split over the data-parallel units, and under a pipeline over
``pipeline_nmicros`` micro-batches (``train_step`` with ``scale_fn=loss / m``: the gradient of the unit's
mean loss). The test compares what each plan reports with one process continuing from the checkpoint.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import dynshard
from dynshard.runtime.sharding import TAG_ATTR, full_tensor, get_tag
from models import GPTConfig, gpt_batch
from workers_pipeline import EndToEndGPT, _short_timeouts

CFG = GPTConfig(layers=2, fused_qkv=True, seq=15)
BATCH = 8
SGD = ("sgd", {"lr": 0.05, "momentum": 0.9})
ADAMW = ("adamw", {"lr": 0.01, "weight_decay": 0.01})
STATE_KEYS = {"sgd": ("momentum_buffer",), "adamw": ("step", "exp_avg", "exp_avg_sq")}
PP = {"pipeline_nmicros": 2}

# the plans of the matrix: Config options (Run adds compiler="aot_eager")
PLANS = {
    "tp2": dict(policy="tp", plan_ngpus=2),
    "pp2": dict(policy="pp", plan_ngpus=2, use_end2end=True, pas_config=PP),
    "hybrid4": dict(policy="hybrid", plan_ngpus=4, use_end2end=True,
                    pas_config={**PP, "pipeline_nstages": 2}),
    "dp": dict(policy="dp", plan_ngpus=1),
    "data2": dict(policy="data", plan_ngpus=2),
    "zero1": dict(policy="dp", plan_ngpus=1, use_zero=1),
    "zero2": dict(policy="dp", plan_ngpus=1, use_zero=2),
    "zero3": dict(policy="dp", plan_ngpus=1, use_zero=3),
    "tp2_dp2": dict(policy="tp", plan_ngpus=2),                       # on 4 ranks
    "zero1_ngroups2": dict(policy="dp", plan_ngpus=1, use_zero=1, zero_ngroups=2),   # on 4 ranks
    "pp2_zero1": dict(policy="pp", plan_ngpus=2, use_end2end=True, pas_config=PP, use_zero=1),   # on 4 ranks
}


def make_optimizer(kind: tuple[str, dict], params) -> torch.optim.Optimizer:
    name, kwargs = kind
    cls = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[name]
    return cls(params, **kwargs)


def batch(step: int) -> dict:
    return dict(zip(("idx", "tgt"), gpt_batch(CFG, BATCH, step)))


def _rows(sample: dict, start: int, size: int) -> dict:
    return {k: v[start:start + size] for k, v in sample.items()}


def full_optimizer_state(model, opt, keys) -> dict[str, torch.Tensor]:
    """``{"<param>.<key>": whole tensor}`` of the optimizer state, gathered over tp, ZeRO and stages (every
    rank takes part)."""
    state = {}
    for name, param in model.named_parameters():
        tag = get_tag(param)
        entries = opt.state.get(param, {})
        for key in keys:
            value = entries.get(key)
            if key == "step":       # a scalar on every rank holding the parameter (none elsewhere)
                if tag is not None and tag.owner is not None:
                    value = value.clone() if tag.owner.held else torch.zeros((), dtype=torch.float32)
                    dist.broadcast(value, src=tag.owner.src, group=tag.owner.group)
                state[f"{name}.{key}"] = value.clone()
                continue
            value = torch.empty(0) if value is None else value.detach().clone()   # another stage's
            if tag is not None:
                setattr(value, TAG_ATTR, tag)
            state[f"{name}.{key}"] = full_tensor(value).clone()
    return state


class Run:
    """One plan's model, compiled program and optimizer on this rank (a new job in effect: Dynamo reset)."""

    def __init__(self, plan: str, optimizer: tuple[str, dict], seed: int = 0, scaler: bool = False):
        torch._dynamo.reset()
        torch.manual_seed(seed)
        self.plan, self.options, self.kind = plan, PLANS[plan], optimizer[0]
        self.model = EndToEndGPT(CFG)
        self.compiled = torch.compile(self.model, backend="dynshard", options=dynshard.Config(
            compiler="aot_eager", **self.options))
        self.opt = make_optimizer(optimizer, self.model.parameters())
        self.scaler = dynshard.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1) if scaler else None

    @property
    def pipeline(self) -> bool:
        return self.options["policy"] in ("pp", "hybrid")

    def step(self, step: int) -> float:
        """One optimizer step on global batch ``step``; the global batch's mean loss (every rank)."""
        plan_ngpus = self.options["plan_ngpus"]
        dp_rank, dp_size = dynshard.data_parallel_rank(plan_ngpus)
        rows = BATCH // dp_size
        mine = _rows(batch(step), dp_rank * rows, rows)
        if self.pipeline:
            m = self.options["pas_config"]["pipeline_nmicros"]
            samples = [_rows(mine, i * (rows // m), rows // m) for i in range(m)]
            losses = dynshard.train_step(self.compiled, samples, scale_fn=lambda loss: loss / m)
            loss = torch.stack([torch.as_tensor(v) for v in losses]).mean()
        else:
            loss = self.compiled(mine)
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            loss = loss.detach()
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad()
        total = loss.clone()
        dist.all_reduce(total)
        return total.item() / dist.get_world_size()

    def save(self, path: str, step: int) -> None:
        dynshard.checkpoint.save(path, self.compiled, self.opt, extra={"step": step}, scaler=self.scaler)

    def load(self, path: str):
        return dynshard.checkpoint.load(path, self.compiled, self.opt, scaler=self.scaler)

    def full(self) -> dict:
        """Whole parameters and optimizer state (every rank takes part; gathered over tp, ZeRO, stages)."""
        params = {k: v.detach().clone() for k, v in dynshard.collect_state_dict(self.compiled).items()}
        state = full_optimizer_state(self.model, self.opt, STATE_KEYS[self.kind])
        return {"params": params, "state": state, "layout": self.layout()}

    def layout(self) -> dict:
        """How two parameters sit on this rank (the test checks each plan is the one it means to be)."""
        out = {}
        for name in ("wpe.weight", "blocks.0.attn.c_attn.weight"):
            param = self.model.get_parameter(name)
            tag = get_tag(param)
            zero = tag.zero if tag is not None else None
            out[name] = {"numel": param.numel(), "placements": str(tag.placements) if tag is not None else "",
                         "zero": (zero.group_size, zero.ngroups, zero.padded_rows - zero.rows) if zero else None}
        return out

    def local(self) -> dict:
        """What this rank holds: its pieces of the parameters and of the optimizer state (bitwise checks)."""
        params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        state = {f"{n}.{k}": v.clone() for n, p in self.model.named_parameters()
                 for k, v in self.opt.state.get(p, {}).items() if isinstance(v, torch.Tensor)}
        return {"params": params, "state": state,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}


def _path(root: str, name: str, step: int) -> str:
    return os.path.join(root, name, f"step{step}")


def _continue(run: Run, path: str, start: int, steps: int = 2, load_first: bool = False) -> dict:
    """Load ``path`` (before this plan's first step, or after one step of its own on another batch),
    train ``steps`` steps from global batch ``start``; what the test compares with one process."""
    if not load_first:
        run.step(100)
    extra = run.load(path)
    loaded = run.full()
    losses = [run.step(start + i) for i in range(steps)]
    return {"extra": extra, "losses": losses, "loaded": loaded, **run.full()}


def _train_and_save(run: Run, root: str, name: str, steps: int = 2) -> dict:
    losses = [run.step(i) for i in range(steps)]
    run.save(_path(root, name, steps), steps)
    return {"losses": losses, **run.full()}


def _straight(run: Run, root: str, name: str, steps: int = 4) -> dict:
    """``steps`` steps with a save halfway (what a resumed job must reproduce bit for bit)."""
    losses = [run.step(i) for i in range(steps // 2)]
    run.save(_path(root, name, steps // 2), steps // 2)
    saved = run.full()
    losses += [run.step(i) for i in range(steps // 2, steps)]
    return {f"saved {name}": saved, f"straight {name}": {"losses": losses, **run.local()}}


def two_rank_sources_and_pipeline(rank: int, world: int, root: str) -> dict:
    """The straight AdamW runs (4 steps, a save after 2) under tp2 (with a GradScaler) and ZeRO-2 that the
    other job resumes bit for bit; tp2 -> pp2 -> tp2 (AdamW, from the tp2 run's save); a data2 save (SGD)."""
    _short_timeouts()
    out = {}
    out.update(_straight(Run("tp2", ADAMW, scaler=True), root, "adamw_tp2"))
    out.update(_straight(Run("zero2", ADAMW), root, "adamw_zero2"))
    pp = Run("pp2", ADAMW, seed=1)
    out["tp2 -> pp2"] = _continue(pp, _path(root, "adamw_tp2", 2), 2)       # after a step of its own
    pp.save(_path(root, "pp2", 4), 4)
    out["saved pp2"] = pp.full()
    out["straight pp2"] = {"losses": [pp.step(i) for i in (4, 5)], **pp.local()}
    out["pp2 -> tp2"] = _continue(Run("tp2", ADAMW, seed=2), _path(root, "pp2", 4), 4, load_first=True)
    out["saved data2"] = _train_and_save(Run("data2", SGD), root, "data2")
    return out


def four_rank_sources(rank: int, world: int, root: str) -> dict:
    """Saved on 4 ranks: hybrid (2 stages x tp 2, AdamW), tp 2 x dp 2 (SGD), ZeRO-1 in 2 groups (AdamW)."""
    _short_timeouts()
    return {"saved hybrid4": _train_and_save(Run("hybrid4", ADAMW), root, "hybrid4"),
            "saved tp2_dp2": _train_and_save(Run("tp2_dp2", SGD), root, "tp2_dp2"),
            "saved zero1_ngroups2": _train_and_save(Run("zero1_ngroups2", ADAMW), root, "zero1_ngroups2")}


def two_rank_loads(rank: int, world: int, root: str) -> dict:
    """A new 2-rank job: the 4-rank saves under other plans, data2 -> zero3, and the bitwise resumes (AdamW
    under tp2 and ZeRO-2, and under pp2 from the pipeline's own save)."""
    _short_timeouts()
    out = {}
    out["hybrid4 -> dp"] = _continue(Run("dp", ADAMW, seed=3), _path(root, "hybrid4", 2), 2, load_first=True)
    out["tp2_dp2 -> data2"] = _continue(Run("data2", SGD, seed=4), _path(root, "tp2_dp2", 2), 2)
    out["zero1_ngroups2 -> tp2"] = _continue(Run("tp2", ADAMW, seed=5), _path(root, "zero1_ngroups2", 2), 2)
    out["data2 -> zero3"] = _continue(Run("zero3", SGD, seed=6), _path(root, "data2", 2), 2, load_first=True)
    for name, plan, optimizer, scaler, load_first, start in (
            ("adamw tp2", "tp2", ADAMW, True, False, 2), ("adamw zero2", "zero2", ADAMW, False, True, 2),
            ("pp2", "pp2", ADAMW, False, True, 4)):
        run = Run(plan, optimizer, seed=7, scaler=scaler)
        if not load_first:
            run.step(100)
        extra = run.load(_path(root, name.replace(" ", "_"), start))
        losses = [run.step(i) for i in range(start, start + 2)]
        out[f"resumed {name}"] = {"extra": extra, "losses": losses, **run.local()}
    return out


def pipeline_zero_save(rank: int, world: int, root: str) -> dict:
    """pp 2 x dp 2 with ZeRO-1 rows of each stage's parameters (4 ranks, AdamW)."""
    _short_timeouts()
    return {"saved pp2_zero1": _train_and_save(Run("pp2_zero1", ADAMW), root, "pp2_zero1")}


def pipeline_zero_load(rank: int, world: int, root: str) -> dict:
    """The pp x ZeRO save under pp on 2 ranks, loaded after a step of its own."""
    _short_timeouts()
    return {"pp2_zero1 -> pp2": _continue(Run("pp2", ADAMW, seed=3), _path(root, "pp2_zero1", 2), 2)}


def straight_runs(rank: int, world: int, root: str, plans: list[str]) -> dict:
    """Per plan: 4 AdamW steps with a save after 2 (what a new job must reproduce bit for bit)."""
    _short_timeouts()
    out = {}
    for plan in plans:
        out.update(_straight(Run(plan, ADAMW), root, f"bitwise_{plan}"))
    return out


def resumed_runs(rank: int, world: int, root: str, plans: list[str]) -> dict:
    """A new job per plan: load the halfway save before the first step, train the last 2 steps."""
    _short_timeouts()
    out = {}
    for plan in plans:
        run = Run(plan, ADAMW, seed=11)
        extra = run.load(_path(root, f"bitwise_{plan}", 2))
        losses = [run.step(i) for i in (2, 3)]
        out[f"resumed bitwise_{plan}"] = {"extra": extra, "losses": losses, **run.local()}
    return out

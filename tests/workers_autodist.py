"""What each process runs in the autodist tests (module level, so spawned processes can import it)."""

from __future__ import annotations

import contextlib
import json

import torch
import torch.distributed as dist

import dynshard
from dynshard.autodist import plan_search as autodist
from dynshard.autodist.plan_search import AutodistError, device_profile
from dynshard.backend import offline
from models import GPT, MLP, GPTConfig, LlamaLM, gpt_batch, mlp_batch
from workers import train_parity


@contextlib.contextmanager
def beside_the_search(also):
    """While it lasts, ``dynshard.plan``'s autodist search first calls ``also`` with its own arguments (the
    captured graph, its inputs, the config, the world, ...), so a test sees what the search starts from."""
    def search(*args):
        also(*args)
        return autodist.search(*args)

    offline.search = search
    try:
        yield
    finally:
        offline.search = autodist.search


def candidate_plans_beside_hand_plans(rank: int, world: int, world_size: int) -> list[tuple[str, str, str]]:
    """In a plain process: each candidate's plan JSON (as ``dynshard.plan`` with autodist searches them) and
    the plan its hand policy makes (``dynshard.plan`` with that policy)."""
    assert not dist.is_initialized()
    torch.manual_seed(0)
    model, batch = GPT(GPTConfig()), gpt_batch(GPTConfig(), 4, 0)
    config = dynshard.Config(policy="autodist", plan_ngpus=2, compiler="aot_eager")
    rows = []

    def hand(gm, inputs, config, world, made_for, device_type, graphs):
        units, _, estimated = autodist.planned_units(gm, inputs, config, world, made_for, device_type, graphs)
        units = [(p, *estimated[p.name]()) if p.name in estimated else (p, b, u) for p, b, u in units]   # (for real)
        rows.extend(autodist.hand_plans(units, config, world, device_profile(config, device_type)))

    with beside_the_search(hand):
        dynshard.plan(model, batch, config, world_size=world_size)
    out = []
    for candidate, plan, _ in rows:
        hand = candidate.placement.config(config, candidate.zero, ",".join(candidate.recompute))
        made, = dynshard.plan(model, batch, hand, world_size=world_size)
        out.append((candidate.name, plan.to_json(), made.to_json()))
    return out


def offline_autodist(rank: int, world: int, world_size: int, pas_config: dict) -> str:
    """``dynshard.plan`` with autodist: the plan's JSON, or the error's type and message."""
    torch.manual_seed(0)
    model, batch = GPT(GPTConfig()), gpt_batch(GPTConfig(), 4, 0)
    try:
        plan, = dynshard.plan(model, batch, dynshard.Config(policy="autodist", plan_ngpus=2, pas_config=pas_config),
                              world_size=world_size)
    except Exception as error:
        return _autodist_error(error)
    return plan.to_json()


def memory_budget_sweep(rank: int, world: int, world_size: int) -> list[str]:
    """autodist with no budget, then with budgets at a third, two thirds and all of the way down its candidates'
    peaks, then just under the smallest: each plan's JSON (or the error), in one process."""
    free = offline_autodist(rank, world, world_size, {})
    peaks = sorted({c["peak_bytes"] for c in json.loads(free)["predicted"]["autodist"]["candidates"]}, reverse=True)
    budgets = [peaks[len(peaks) // 3], peaks[2 * len(peaks) // 3], peaks[-1], peaks[-1] * 0.99]
    return [free] + [offline_autodist(rank, world, world_size, {"mem_constraint": b / 1024 ** 3}) for b in budgets]


def _autodist_error(error: BaseException) -> str:
    """The AutodistError inside what Dynamo raised (it wraps a backend's error), as text."""
    cause = error
    while not isinstance(cause, AutodistError) and (cause.__cause__ or getattr(cause, "inner_exception", None)):
        cause = cause.__cause__ or cause.inner_exception
    if not isinstance(cause, AutodistError):
        raise error
    return f"AutodistError: {cause}"


def train_with_autodist(rank: int, world: int, path: str, pas_config: dict | None = None) -> dict:
    result = train_parity(rank, world, "gpt", "autodist", 2, "aot_eager", 3,
                          options={"save_plan_path": path, "pas_config": pas_config or {}})
    dist.barrier()
    with open(path) as f:
        result["saved"] = f.read()
    return result


def nothing_fits(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy="autodist", plan_ngpus=2, compiler="aot_eager", pas_config={"mem_constraint": 1e-5}))
    try:
        compiled(*gpt_batch(GPTConfig(), 4, 0))
    except Exception as error:
        return _autodist_error(error)
    return "no error"




def planned_units_of(rank: int, world: int, model_name: str, world_size: int, plan_ngpus: int) -> list:
    """In a plain process: what autodist's search starts from for ``model_name`` (each placement's plan and
    per-rank costs), as ``dynshard.plan`` captures the graph."""
    torch.manual_seed(0)
    if model_name == "mlp":
        model, batch = MLP(layers=2), mlp_batch(4, 0)
    elif model_name == "gpt, 6 layers":
        model, batch = GPT(GPTConfig(layers=6)), gpt_batch(GPTConfig(layers=6), 4, 0)
    else:
        model, batch = GPT(GPTConfig()), gpt_batch(GPTConfig(), 4, 0)
    config = dynshard.Config(policy="autodist", plan_ngpus=plan_ngpus)
    found = []

    def units(gm, inputs, config, world, made_for, device_type, graphs):
        found.extend(autodist.planned_units(gm, inputs, config, world, made_for, device_type, graphs)[0])

    with beside_the_search(units):
        dynshard.plan(model, batch, config, world_size=world_size)
    return [(placement, plan.to_json(), unit) for placement, plan, unit in found]     # (a Plan holds mapping proxies)


def estimated_variants_beside_planned(rank: int, world: int, model_name: str) -> list[tuple]:
    """In a plain process, for each tp variant autodist prices from its parts (several kinds whole or on batch
    shards; ``model_name``'s 2-layer model, a unit of 2 ranks): its name, and for the estimate and for the
    plan as autodist plans it for real, the prediction (one micro-batch, no ZeRO, the CPU profile), the
    sorted forward collectives, the tensors' and the activations' placements."""
    from dynshard.autodist.cost_model import predict

    cfg = GPTConfig(layers=2)
    with torch.device("meta"):
        model = _COUNTED_MODELS[model_name](cfg)
    config = dynshard.Config(policy="autodist", plan_ngpus=2, pas_config={"device_profile": "cpu"})
    rows = []

    def described(plan, unit):
        predicted = predict(plan, unit, 1, device_profile(config, "cpu"), 1.0)
        collectives = sorted(json.dumps(c.to_dict(), sort_keys=True) for c in plan.predicted.collectives)
        return (predicted, collectives, {k: v.tp for k, v in plan.tensors.items()},
                {k: (v.tp, v.readers) for k, v in plan.activations.items()})

    def estimates(gm, inputs, config, world, made_for, device_type, graphs):
        units, _, estimated = autodist.planned_units(gm, inputs, config, world, made_for, device_type, graphs)
        for placement, plan, unit in units:
            if placement.name in estimated:
                rows.append((placement.name, described(plan, unit), described(*estimated[placement.name]())))

    with beside_the_search(estimates):
        dynshard.plan(model, gpt_batch(cfg, 4, 0), config, world_size=2)
    return rows


def train_step_without_pipeline(rank: int, world: int) -> dict:
    """autodist exploring pipelines with plan_ngpus 1 (pure data parallelism: no pipeline to choose), trained
    by train_step over 4 samples, beside one process summing the same micro-batches' gradients."""
    import copy

    from workers_pipeline import build

    model, make = build("gpt")
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy="autodist", use_end2end=True, compiler="aot_eager",
        pas_config={"explore_pipeline": True, "update_freq": 4}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    losses, ref_losses = [], []
    for step in range(2):
        samples = [make(2, 100 * step + 10 * unit + i) for unit in range(world) for i in range(4)]
        mine = samples[4 * rank:4 * rank + 4]
        losses.append([float(v) for v in dynshard.train_step(compiled, mine)])
        ref_losses.append([])
        for unit in range(world):
            for i, sample in enumerate(samples[4 * unit:4 * unit + 4]):
                loss = reference(sample)
                (loss / world).backward()
                if unit == rank:
                    ref_losses[-1].append(float(loss))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"losses": losses, "ref_losses": ref_losses, "params": dynshard.collect_state_dict(compiled),
            "ref_params": {k: v.detach() for k, v in reference.state_dict().items()}}


def pipeline_candidates_beside_hand_plans(rank: int, world: int, world_size: int,
                                          plan_ngpus: int = 2) -> list[tuple]:
    """In a plain process: each pipeline candidate's plan JSON (a hybrid priced from the tp plan: planned for
    real, as autodist plans it before choosing it), the plan the pp or hybrid policy makes with that schedule,
    ZeRO level and recompute, its predicted bytes, and for a hybrid priced from the tp plan whether that
    estimate placed every tensor as the policy does and put the same collectives in each stage (else None)."""
    from workers_pipeline import build

    model, make = build("gpt")
    sample = make(2, 0)
    config = dynshard.Config(policy="autodist", plan_ngpus=plan_ngpus, use_end2end=True,
                             pas_config={"explore_pipeline": True, "update_freq": 4})
    rows, exact = [], {}

    def pipelines(gm, inputs, config, world, made_for, device_type, graphs):
        units, whole, _ = autodist.planned_units(gm, inputs, config, world, made_for, device_type, graphs)
        tp_unit = next((base, unit) for placement, base, unit in units if placement.name == "tp")
        found, real = autodist.pipeline_plans(gm, inputs, config, world, made_for, device_type,
                                              device_profile(config, device_type), whole, tp_unit, graphs)
        rows.extend(found)
        exact.update({name: plan_for_real()[1] for name, plan_for_real in real.items()})

    with beside_the_search(pipelines):
        dynshard.plan(model, (sample,), config, world_size=world_size)
    out = []
    for candidate, plan, predicted in rows:
        hand = candidate.placement.config(config, candidate.zero, ",".join(candidate.recompute))
        made, = dynshard.plan(model, (sample,), hand, world_size=world_size)
        estimate = None
        if candidate.name in exact:
            estimate = {n: t.tp for n, t in plan.tensors.items()} == {n: t.tp for n, t in made.tensors.items()} \
                and _stage_collectives(plan) == _stage_collectives(made)
            plan = exact[candidate.name]
        out.append((candidate.name, plan.to_json(), made.to_json(), predicted.bytes_per_rank, estimate))
    return out


def _stage_collectives(plan) -> list[tuple]:
    return sorted((c.at.partition("/")[0], c.kind, c.dim, c.bytes) for c in plan.predicted.collectives)


def hand_predictions_beside_autodists(rank: int, world: int) -> dict:
    """autodist's record of the hand plans it priced, and ``dynshard.plan(..., device_profile="cpu")``'s
    prediction of three of them made by their own policies."""
    torch.manual_seed(0)
    model, batch = GPT(GPTConfig()), gpt_batch(GPTConfig(), 4, 0)
    chosen, = dynshard.plan(model, batch, dynshard.Config(policy="autodist", plan_ngpus=2), world_size=4)
    hand = {}
    for name, options in {"tp": {"policy": "tp"}, "data + ZeRO-1": {"policy": "data", "use_zero": 1},
                          "tp + recompute Block": {"policy": "tp", "recompute_modules": "Block"}}.items():
        plan, = dynshard.plan(model, batch, dynshard.Config(plan_ngpus=2, **options), world_size=4,
                              device_profile="cpu")
        hand[name] = plan.predicted
    return {"candidates": chosen.predicted.autodist.candidates, "hand": hand}


def why_not_pinned(rank: int, world: int, pins: dict, mem_constraint: float | None) -> str:
    """``dynshard.why_not`` for the test GPT under autodist over 4 ranks (2 units of 2)."""
    torch.manual_seed(0)
    model, batch = GPT(GPTConfig()), gpt_batch(GPTConfig(), 4, 0)
    pas = {} if mem_constraint is None else {"mem_constraint": mem_constraint}
    return dynshard.why_not(model, batch, dynshard.Config(policy="autodist", plan_ngpus=2, pas_config=pas), 4, pins)


def hybrid_candidates(rank: int, world: int) -> dict:
    """autodist exploring pipelines over units of 4 ranks (8 in all): the candidates it priced and its choice;
    and the hybrid policy's plan of 2 stages x tp 2 made offline with the built-in CPU profile."""
    from workers_pipeline import build

    model, make = build("gpt")
    plan, = dynshard.plan(model, (make(2, 0),), dynshard.Config(
        policy="autodist", plan_ngpus=4, use_end2end=True, pas_config={"explore_pipeline": True, "update_freq": 4}),
        world_size=8)
    hybrid, = dynshard.plan(model, (make(2, 0),), dynshard.Config(
        policy="hybrid", plan_ngpus=4, use_end2end=True, pas_config={"pipeline_nstages": 2, "pipeline_nmicros": 4}),
        world_size=8, device_profile="cpu")
    return {"candidates": plan.predicted.autodist.candidates, "plan": plan.to_json(), "hybrid": hybrid.predicted}


def within_partition_degree(rank: int, world: int) -> dict:
    """autodist over units of 4 with tensors split over at most 2 ranks (8 ranks in all)."""
    from workers_pipeline import build

    model, make = build("gpt")
    plan, = dynshard.plan(model, (make(2, 0),), dynshard.Config(
        policy="autodist", plan_ngpus=4, use_end2end=True,
        pas_config={"explore_pipeline": True, "update_freq": 4, "max_partition_degree": 2}), world_size=8)
    return {"candidates": [c.plan for c in plan.predicted.autodist.candidates], "plan": plan.to_json()}


def measured_peaks(rank: int, world: int, mem_constraint: float | None) -> dict:
    """Three Adam steps of the test GPT on autodist's plan under ``mem_constraint`` (2 ranks, one unit): each
    step's peak on this rank as ``dynshard.peak_memory`` measures it, beside the plan's predicted peak."""
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy="autodist", plan_ngpus=2, compiler="aot_eager",
        pas_config={} if mem_constraint is None else {"mem_constraint": mem_constraint}))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    peaks = []
    for step in range(3):
        batch = gpt_batch(cfg, 4, step)
        with dynshard.peak_memory(model, opt) as measured:
            compiled(*batch).backward()
            opt.step()
            opt.zero_grad()
        peaks.append((measured.at_start, measured.during))
    plan, = dynshard.explain(compiled).plans
    fastest = min(plan.predicted.autodist.candidates, key=lambda c: c.step_seconds)
    return {"peaks": peaks, "predicted": plan.predicted.cost.bytes_per_rank, "chosen": plan.predicted.autodist.chosen,
            "binds": not fastest.fits}


class CutGPT:
    """The end-to-end test GPT of ``layers`` layers with the user's ``pipe_split()`` before layer ``at`` (or
    each layer of a tuple): the pp policy's plan with that stage cut, made without autodist."""

    def __new__(cls, layers: int, at: int | tuple[int, ...]):
        from torch.distributed.pipelining import pipe_split
        from workers_pipeline import EndToEndGPT

        class Cut(EndToEndGPT):
            def forward(self, batch):
                idx = batch["idx"]
                x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
                for i, block in enumerate(self.blocks):
                    if i in (at if isinstance(at, tuple) else (at,)):
                        pipe_split()
                    x = block(x)
                logits = self.lm_head(self.ln_f(x))
                return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["tgt"].reshape(-1))

        torch.manual_seed(0)
        return Cut(GPTConfig(layers=layers))


def stage_cut_under_a_budget(rank: int, world: int, layers: int = 8) -> dict:
    """In a plain process, for 2 ranks, 1F1B over 4 micro-batches of 4 rows, no recompute: autodist's plan
    without a budget and one byte under its peak, and the pp policy's plan (priced by the same cost model)
    with the stage cut before each layer."""
    autodist_plan, every = _cuts_beside_autodist("gpt8" if layers == 8 else "gpt", layers, "pp", 2)
    free = autodist_plan()
    budget = free.predicted.cost.bytes_per_rank.peak - 1
    tight = autodist_plan(mem_constraint=budget / 1024 ** 3)
    return {"free": free.to_json(), "tight": tight.to_json(), "budget": budget, "every": every()}


def hybrid_stage_cut_under_a_budget(rank: int, world: int) -> dict:
    """In a plain process, for one unit of 4 ranks: the 8-layer GPT in 2 stages of tp 2 under 1F1B over 4
    micro-batches of 4 rows, no recompute. autodist's candidates with no budget and one byte under its hybrid
    candidate's peak, the plan it chooses then, and the hybrid policy's plan cut by ``pipe_split()`` before
    each layer (priced by the same cost model)."""
    autodist_plan, every = _cuts_beside_autodist("gpt8", 8, "hybrid", 4)
    free = {c.plan: c for c in autodist_plan().predicted.autodist.candidates}
    budget = free["hybrid pp 2 x tp 2 1f1b"].peak_bytes - 1
    tight = autodist_plan(mem_constraint=budget / 1024 ** 3)
    return {"free": free, "tight": tight.to_json(), "budget": budget, "every": every()}


def _cuts_beside_autodist(name: str, layers: int, policy: str, ranks: int, rows: int = 4):
    """For one unit of ``ranks`` in 2 stages (1F1B, 4 micro-batches of ``rows`` rows, no recompute):
    autodist's plan with more ``pas_config``, and ``policy``'s plans with ``pipe_split()`` before each layer:
    their (step, peak) by the stage's first layer."""
    from workers_pipeline import build

    model, make = build(name)
    batch = make(rows, 0)
    pas = {"explore_pipeline": True, "update_freq": 4, "max_partition_degree": ranks // 2,
           "pipeline_scheduler": "1f1b", "recompute_modules": ""}

    def autodist_plan(**more):
        plan, = dynshard.plan(model, (batch,), dynshard.Config(policy="autodist", plan_ngpus=ranks, use_end2end=True,
                                                              pas_config={**pas, **more}), world_size=ranks)
        return plan

    def every():
        found = {}
        for at in range(1, layers):
            plan, = dynshard.plan(CutGPT(layers, at), (batch,), dynshard.Config(
                policy=policy, plan_ngpus=ranks, use_end2end=True, pas_config={
                    "pipeline_nstages": 2, "pipeline_nmicros": 4, "pipeline_scheduler": "1f1b"}),
                world_size=ranks, device_profile="cpu")
            found[f"blocks.{at}"] = (plan.predicted.cost.step_seconds, plan.predicted.cost.bytes_per_rank.peak)
        return found

    return autodist_plan, every


def interleaved_stage_cut_under_a_budget(rank: int, world: int) -> dict:
    """In a plain process, for 2 ranks: the 8-layer GPT in 4 stages, 2 a rank (1F1B interleaved over 4
    micro-batches of 16 rows: activations outweigh the parameters), no recompute. autodist's plan one byte
    under its interleaved candidate's peak, and the pp policy's plan cut by ``pipe_split()`` where that plan's
    moved candidate cuts."""
    autodist_plan, _ = _cuts_beside_autodist("gpt8", 8, "pp", 2, rows=16)
    interleaved = {"pipeline_scheduler": "1f1b_interleaved"}
    free = {c.plan: c for c in autodist_plan(**interleaved).predicted.autodist.candidates}
    budget = free["pp 1f1b_interleaved"].peak_bytes - 1
    tight = autodist_plan(mem_constraint=budget / 1024 ** 3, **interleaved)
    rows = {c.plan: c for c in tight.predicted.autodist.candidates}
    moved = next(name for name in rows if name.startswith("pp 1f1b_interleaved, stages at "))
    starts = tuple(int(s.split(".")[1]) for s in moved.split(" at ")[1].split(" (")[0].split(", "))
    from workers_pipeline import build

    _, make = build("gpt8")
    cut, = dynshard.plan(CutGPT(8, starts), (make(16, 0),), dynshard.Config(
        policy="pp", plan_ngpus=2, use_end2end=True, pas_config={
            "pipeline_nstages": 4, "pipeline_nchunks": 2, "pipeline_nmicros": 4,
            "pipeline_scheduler": "1f1b_interleaved"}), world_size=2, device_profile="cpu")
    return {"free": free, "tight": tight.to_json(), "budget": budget, "moved": moved,
            "cut": [cut.predicted.cost.step_seconds, cut.predicted.cost.bytes_per_rank.peak]}


_COUNTED_MODELS = {"gpt": GPT, "llama": LlamaLM}
_ATTENTION = {"gpt": "blocks.*.attn", "llama": "model.model.layers.*.self_attn"}


def _split_placements(model_name: str) -> tuple[tuple[str, dict], ...]:
    return (("tp", dict(policy="tp")),
            ("tp + sequence parallel", dict(policy="tp", pas_config={"sequence_parallel": True})),
            ("data", dict(policy="data")),
            ("tp, attention on batch shards", dict(policy="tp", pas_config={"batch_parallel": True},
                                                   partition_constraints={_ATTENTION[model_name]: "R"})))


def predicted_tp_collectives(rank: int, world: int) -> dict:
    """Per model and placement splitting a unit of 2 ranks (the 2-layer test GPT and Llama), planned offline by
    its hand policy and priced: the tp collectives (count, bytes) it predicts for a micro-batch."""
    cfg = GPTConfig(layers=2)
    found = {}
    for model_name, model_class in _COUNTED_MODELS.items():
        for name, options in _split_placements(model_name):
            with torch.device("meta"):
                model = model_class(cfg)
            plan, = dynshard.plan(model, gpt_batch(cfg, 4, 0), dynshard.Config(plan_ngpus=2, **options),
                                  world_size=2, device_profile="cpu")
            predicted = plan.predicted.cost.tp_collectives_per_micro_batch
            found[f"{model_name}, {name}"] = (predicted.count, predicted.bytes)
    return found


def traced_tp_collectives(rank: int, world: int, compiler: str) -> dict:
    """The same placements compiled by ``compiler`` on 2 ranks: the tp collectives one step's program traced."""
    cfg = GPTConfig(layers=2)
    found = {}
    for model_name, model_class in _COUNTED_MODELS.items():
        for name, options in _split_placements(model_name):
            torch._dynamo.reset()
            torch.manual_seed(0)
            compiled = torch.compile(model_class(cfg), backend="dynshard",
                                     options=dynshard.Config(plan_ngpus=2, compiler=compiler, **options))
            compiled(*gpt_batch(cfg, 4, 0)).backward()
            traced = [c for c in dynshard.explain(compiled).collectives() if c.group == "tp"]
            found[f"{model_name}, {name}"] = (len(traced), sum(c.bytes for c in traced))
    return found


def llama_with_zero_faster_than_without(rank: int, world: int) -> str:
    """autodist over 64 ranks in units of 8 (the CUDA profile) for a 2-layer Llama with a long sequence, where
    ZeRO-2's rows are faster than no ZeRO (a placement's plain plan is not its fastest): the plan's JSON."""
    cfg = GPTConfig(vocab=32000, d_model=512, layers=2, heads=8, seq=1024)
    with torch.device("meta"):
        model = LlamaLM(cfg)
    config = dynshard.Config(policy="autodist", plan_ngpus=8, pas_config={"device_profile": "cuda"})
    plan, = dynshard.plan(model, gpt_batch(cfg, 1, 0), config, world_size=64)
    return plan.to_json()


def llama3_8b_over_64_ranks(rank: int, world: int) -> str:
    """Issue 49's job, planned offline: transformers' Llama-3-8B shapes on the meta device, sequence 8192, one
    row per unit, 64 ranks in units of 8, 80 GB, the CUDA profile. The plan's JSON."""
    import transformers

    class LM(transformers.LlamaForCausalLM):
        def forward(self, idx, tgt):
            logits = super().forward(input_ids=idx).logits
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))

    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                   max_position_embeddings=8192, use_cache=False)
    with torch.device("meta"):
        model = LM(cfg)
    idx = torch.zeros(1, 8192, dtype=torch.long, device="meta")
    config = dynshard.Config(policy="autodist", plan_ngpus=8,
                             pas_config={"mem_constraint": 80, "device_profile": "cuda"})
    plan, = dynshard.plan(model, (idx, idx.clone()), config, world_size=64)
    return plan.to_json()

"""What each process runs in the per-op placement tests (module level, so spawned processes can import it)."""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools

import torch
import torch.distributed as dist

import dynshard
from dynshard.backend import offline
from dynshard.backend.plan_graph import lower_graph, place_graph
from dynshard.passes.propagate_sharding import reduced_placements
from dynshard.autodist import op_placement
from dynshard.autodist.cost_model import predict
from dynshard.autodist.device_profile import DeviceProfile, load_profile
from dynshard.autodist.graph_costs import graph_costs, op_costs, repeated_blocks
from dynshard.autodist.space import placements
from dynshard.runtime.mesh import planning_layout
from models import GPT, GPTConfig, LlamaLM, gpt_batch

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# compute dear, collectives nearly free: the ILP splits every op it can
DEAR_COMPUTE = DeviceProfile("dear compute", 1e6, 1e6, {k: 1e-9 for k in KINDS}, {k: 1e15 for k in KINDS})


BENCH_GPT = GPTConfig(vocab=4096, seq=128, d_model=256, heads=4, layers=4)    # (benchmarks/gpt_job.py's sizes)


class GPT2LM(torch.nn.Module):
    """transformers' GPT2LMHeadModel (a fused ``c_attn`` in ``Conv1D``: its weight stored [in, out], the blocks on
    dim 1) called as GPT is, ``(idx, tgt) -> loss``, at GPTConfig's sizes."""

    def __init__(self, cfg: GPTConfig):
        import transformers

        super().__init__()
        self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=cfg.vocab, n_positions=cfg.seq, n_embd=cfg.d_model, n_layer=cfg.layers, n_head=cfg.heads,
            use_cache=False, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

    def forward(self, idx, tgt):
        logits = self.model(input_ids=idx).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))


class TwoLayerMLP(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = torch.nn.Linear(dim, 4 * dim, bias=False)
        self.down = torch.nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).square().mean()


def _model(name: str):
    torch.manual_seed(0)
    if name.startswith("mlp"):         # "mlpD" (8 rows) or "mlpDxR" (R rows)
        dim, _, rows = name[3:].partition("x")
        with torch.device("meta"):
            model = TwoLayerMLP(int(dim))
        return model, (torch.randn(int(rows or 8), int(dim)),)
    if name in ("gpt", "fused-gpt"):       # (fused: one c_attn projection split into q, k and v)
        return GPT(GPTConfig(fused_qkv=name == "fused-gpt")), gpt_batch(GPTConfig(), 4, 0)
    if name == "llama":
        return LlamaLM(GPTConfig()), gpt_batch(GPTConfig(), 4, 0)
    if name == "gpt2":
        return GPT2LM(GPTConfig()), gpt_batch(GPTConfig(), 4, 0)
    if name == "bench-gpt":
        cfg = BENCH_GPT
    else:                       # "wide-gptN": d 1024, seq 512, vocab 32k, N layers, on meta
        cfg = GPTConfig(vocab=32768, seq=512, d_model=1024, heads=16, layers=int(name.removeprefix("wide-gpt")))
    with torch.device("meta"):
        model = GPT(cfg)
    return model, gpt_batch(cfg, 8, 0)


class _Captured(Exception):
    pass


def _with_lowered(model, batch, world_size: int, look):
    """``look(lowered graph, its context, inputs, tp config, layout)`` on the graph ``dynshard.plan`` captures,
    planned for a ``world_size``-rank job with units of 2 (no search runs)."""
    found = {}

    def search(gm, inputs, config, world, made_for, device_type, graphs):
        config = config.resolve(world)
        layout = planning_layout(world, config.plan_ngpus, device_type)
        tp = next(p for p in placements(config) if p.name == "tp").config(config, 0, "")
        lowered, ctx = lower_graph(gm, inputs, tp, layout, made_for)
        found["result"] = look(lowered, ctx, inputs, tp, layout)
        raise _Captured

    offline.search = search
    try:
        dynshard.plan(model, batch, dynshard.Config(policy="autodist", plan_ngpus=2), world_size=world_size)
    except Exception:       # noqa: BLE001 - the capture ends the planning on purpose
        if "result" not in found:
            raise
    finally:
        offline.search = dynshard.autodist.search
    return found["result"]


def _tp_of(lowered, ctx, inputs, config, layout, profile):
    """The ops' costs, the repeated blocks, and the tp policy's plan, its context and its unit's costs."""
    ops = op_costs(lowered, inputs, ctx.fake_mode)
    blocks = repeated_blocks(lowered)
    tp_plan, tp_ctx, _ = place_graph(lowered, ctx, config)
    return ops, blocks, tp_plan, tp_ctx, graph_costs(lowered, inputs, ops, layout.tp_size, tp_ctx.propagation, blocks,
                                                     profile=profile)


def _per_op(lowered, ctx, inputs, config, layout, profile, tie: bool = True):
    """The per-op ILP's plan, its solve and what the plan cannot say; the tp policy's plan, context and costs;
    the per-op plan propagated, and its context."""
    ops, blocks, tp_plan, tp_ctx, tp_unit = _tp_of(lowered, ctx, inputs, config, layout, profile)
    plan, placed, unsaid = op_placement.per_op_plan(
        lowered.graph, inputs, ops, blocks[1] if tie else {}, tp_plan, tp_unit, tp_ctx.node_keys, layout, profile,
        1, config.partition_constraints)
    given, given_ctx, _ = place_graph(lowered, ctx, config, plan)
    return placed, unsaid, (tp_plan, tp_ctx), (given, given_ctx), (ops, blocks)


def per_op_report(rank: int, world: int, model_name: str, profile_name: str, tie: bool = True,
                  world_size: int = 2) -> dict:
    """The per-op ILP's plan of a model beside the tp policy's: its solve, whether propagation given the plan
    places every value as the ILP did, and both plans' predictions under the cost model."""
    profile = DEAR_COMPUTE if profile_name == "dear" else load_profile(profile_name, "cpu")
    model, batch = _model(model_name)

    def look(lowered, ctx, inputs, config, layout):
        placed, unsaid, (tp_plan, tp_ctx), (given, given_ctx), (ops, blocks) = _per_op(
            lowered, ctx, inputs, config, layout, profile, tie)
        mismatches = []
        for name, placement in placed.values.items():
            got = given_ctx.propagation.placements.get(name)
            if got is not None and tuple(reduced_placements(got)) != (placement,):
                mismatches.append(f"{name}: planned {placement}, propagated {got}")
        predicted = {}
        for label, made, made_ctx in (("tp", tp_plan, tp_ctx), ("per op", given, given_ctx)):
            unit = graph_costs(lowered, inputs, ops, layout.tp_size, made_ctx.propagation, blocks, profile=profile)
            predicted[label] = predict(made, unit, 1, profile, 2.0).step_seconds
        return {"objective": placed.solution.objective, "status": placed.solution.status,
                "lp_integral": placed.solution.lp_integral, "nodes": placed.nodes, "edges": placed.edges,
                "unsaid": unsaid, "mismatches": mismatches, "predicted": predicted, "plan": given.to_json(),
                "collectives": dict(collections.Counter(c.kind for c in given_ctx.propagation.collectives))}

    return _with_lowered(model, batch, world_size, look)


def per_op_plan_json(model, batch, profile_source) -> str:
    """The per-op ILP's plan of ``model`` called with ``batch`` in a 2-rank job, as a plan file holds it
    (``benchmarks/bench_autodist.py`` measures it)."""
    profile = load_profile(profile_source, "cpu")
    return _with_lowered(model, batch, 2, lambda *a: _per_op(*a, profile)[3][0].to_json())


def per_op_budget_sweep(rank: int, world: int, model_name: str, profile_name: str, fractions: tuple) -> list:
    """The per-op ILP under memory budgets, fractions of what its plan holds without one: for each, (the budget,
    what its plan holds, its objective, whether propagation places every value as planned), or the error."""
    profile = load_profile(profile_name, "cpu")
    model, batch = _model(model_name)

    def look(lowered, ctx, inputs, config, layout):
        ops, blocks, tp_plan, tp_ctx, tp_unit = _tp_of(lowered, ctx, inputs, config, layout, profile)
        rows, free = [], None
        for fraction in (None, *fractions):
            budget = None if fraction is None else fraction * free
            try:
                plan, placed, unsaid = op_placement.per_op_plan(
                    lowered.graph, inputs, ops, blocks[1], tp_plan, tp_unit, tp_ctx.node_keys, layout, profile, 1,
                    config.partition_constraints, budget)
            except ValueError as error:
                rows.append((budget, str(error)))
                continue
            free = free or placed.held
            given_ctx = place_graph(lowered, ctx, config, plan)[1]
            planned = all(tuple(reduced_placements(given_ctx.propagation.placements[n])) == (p,)
                          for n, p in placed.values.items() if n in given_ctx.propagation.placements)
            rows.append((budget, placed.held, placed.solution.objective, planned and not unsaid))
        return rows

    return _with_lowered(model, batch, 2, look)


def autodist_candidates(rank: int, world: int, model_name: str, pas_config: dict) -> tuple[str, dict, dict, str]:
    """``dynshard.plan`` with autodist on 2 ranks: the chosen candidate, each candidate's (step, peak, fits), the
    per-op ILP's solve the plan records (if it is its plan) and what ``explain`` says of the plan."""
    model, batch = _model(model_name)
    plan, = dynshard.plan(model, batch, dynshard.Config(policy="autodist", plan_ngpus=2, pas_config=pas_config),
                          world_size=2)
    record = plan.predicted.autodist
    candidates = {c.plan: (c.step_seconds, c.peak_bytes, c.fits) for c in record.candidates}
    return record.chosen, candidates, plan.predicted.op_placement, str(dynshard.explain([plan]))


def _padded(batch):
    idx, targets = batch
    targets = targets.clone()
    for row in range(targets.shape[0]):
        targets[row, targets.shape[1] - 9 * row:] = -100
    return idx, targets


def graph_left_as_it_was(rank: int, world: int, model_name: str) -> dict:
    """Each candidate a search places on one lowered graph (the tp policy with its trials, data, tp + sequence
    parallel, the per-op ILP's plan given): whether the graph's nodes, arguments and values are as before."""
    model, batch = _model(model_name)

    def state(graph):
        return [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs), sorted(n.meta),
                 str(n.meta.get("val"))) for n in graph.nodes]

    def look(lowered, ctx, inputs, config, layout):
        before, found = state(lowered.graph), {}
        placed = _per_op(lowered, ctx, inputs, config, layout, load_profile("cuda", "cpu"))
        found["per op"] = placed[3][0] is not None and state(lowered.graph) == before
        for name, options in (("data", dict(policy="data")), ("tp + sp", dict(policy="tp", pas_config={
                "sequence_parallel": True}))):
            place_graph(lowered, ctx, dynshard.Config(plan_ngpus=2, **options).resolve(2))
            found[name] = state(lowered.graph) == before
        return found

    return _with_lowered(model, batch, 2, look)


def unit_flops(rank: int, world: int, model_name: str) -> tuple[int, int]:
    """The FLOPs and the bytes written of the ops of a model's graph as lowered for a unit of 2 ranks (the cost
    model's figures)."""
    model, batch = _model(model_name)

    def look(lowered, ctx, inputs, config, layout):
        ops = op_costs(lowered, inputs, ctx.fake_mode)
        return sum(op.flops for op in ops), sum(op.out_bytes for op in ops if op.flops)

    return _with_lowered(model, batch, 2, look)


def ilp_beside_every_choice(rank: int, world: int, model_name: str, profile_name: str) -> dict:
    """The per-op ILP's objective, and the least objective found by trying every option of every node."""
    profile = DEAR_COMPUTE if profile_name == "dear" else load_profile(profile_name, "cpu")
    model, batch = _model(model_name)

    def look(lowered, ctx, inputs, config, layout):
        ops = op_costs(lowered, inputs, ctx.fake_mode)
        fixed = {n.name: torch.distributed.tensor.Replicate() for n, inp in
                 zip([n for n in lowered.graph.nodes if n.op == "placeholder"], inputs) if not inp.is_state}
        problem = op_placement.placement_problem(lowered.graph, inputs, ops, layout.tp_size, layout.tp_mesh, profile,
                                                 1, layout.world_size // layout.plan_ngpus, fixed)
        nodes = list(problem.options)
        best, tried = None, 0
        for combination in itertools.product(*(problem.options[n] for n in nodes)):
            seconds = problem.objective(dict(zip(nodes, combination)))
            tried += 1
            if seconds is not None and (best is None or seconds < best):
                best = seconds
        solved = problem.solve(30.0)
        chosen = {n: solved.options[n.name] for n in nodes}
        return {"ilp": solved.solution.objective, "ilp_checked": problem.objective(chosen), "best": best,
                "tried": tried, "split": any(o.split for o in solved.options.values())}

    return _with_lowered(model, batch, 2, look)


def train_on_plan(rank: int, world: int, path: str, model_name: str = "gpt", steps: int = 3) -> dict:
    """A test model ("gpt", "fused-gpt", "llama", "gpt2", or "bench-gpt" built for real, its targets padded with -100: a
    different count in each row) trained on a plan file beside one process, SGD with momentum."""
    torch.manual_seed(0)
    model = GPT(BENCH_GPT) if model_name == "bench-gpt" else _model(model_name)[0]
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        plan_ngpus=2, compiler="aot_eager", load_plan_path=path))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    losses, ref_losses = [], []
    for step in range(steps):
        batch = gpt_batch(GPTConfig(), 4, step) if model_name != "bench-gpt" else _padded(gpt_batch(BENCH_GPT, 8, step))
        loss, ref_loss = compiled(*batch), reference(*batch)
        loss.backward()
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    report = dynshard.explain(compiled)
    assert dist.get_world_size() == world
    return {"losses": losses, "ref_losses": ref_losses, "params": dynshard.collect_state_dict(compiled),
            "ref_params": {k: v.detach() for k, v in reference.state_dict().items()},
            "collectives": collections.Counter(c.kind for c in report.collectives() if c.phase == "forward")}


def _layered(name: str):
    """Three-layer test models, so that a propagation can replay two layers: "gpt", "fused-gpt", "llama"
    (grouped-query attention), "llama-mqa" (one key/value head), "gpt2-dropout" (transformers' GPT-2 at its
    default dropouts)."""
    cfg = GPTConfig(layers=3, fused_qkv=name == "fused-gpt", heads=2 if name == "llama-mqa" else 4)
    torch.manual_seed(0)
    if name in ("llama", "llama-mqa"):       # (2 query heads, 1 key/value head: sliced like the query's)
        return LlamaLM(cfg), gpt_batch(cfg, 4, 0)
    if name == "gpt2-dropout":
        model = GPT2LM(cfg)
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.1
        model.model.config.attn_pdrop = 0.1
        return model, gpt_batch(cfg, 4, 0)
    return GPT(cfg), gpt_batch(cfg, 4, 0)


def layers_replayed_as_run(rank: int, world: int, model_name: str) -> dict:
    """Each candidate of a search (tp, tp + sequence parallel, tp + batch parallel, data, the per-op ILP's plan
    given) propagated twice from its placements: replaying repeated layers, and running every op. Per candidate:
    whether the two records are equal, field by field, and how many layers the first replayed."""
    from dynshard.passes.propagate_sharding import propagate

    model, batch = _layered(model_name)

    def look(lowered, ctx, inputs, config, layout):
        tried = [("tp", dict(policy="tp")), ("data", dict(policy="data")),
                 ("tp + sp", dict(policy="tp", pas_config={"sequence_parallel": True})),
                 ("tp + batch parallel", dict(policy="tp", pas_config={"batch_parallel": True}))]
        candidates = {name: place_graph(lowered, ctx, dynshard.Config(plan_ngpus=2, **options).resolve(2))[1]
                      for name, options in tried}
        candidates["per op"] = _per_op(lowered, ctx, inputs, config, layout, load_profile("cuda", "cpu"))[3][1]
        found = {}
        for name, placed in candidates.items():
            placements = [placed.placements[inp.index] for inp in inputs]
            replayed, run = (propagate(lowered, placed, placements, replay_layers=replay) for replay in (True, False))
            differ = [f.name for f in dataclasses.fields(run) if f.compare and f.name not in ("env", "placed")
                      and getattr(replayed, f.name) != getattr(run, f.name)]
            found[name] = (differ, replayed.replayed_layers, {f: len(getattr(run, f)) for f in (
                "collectives", "local_reshards", "fallbacks", "reduced_partials", "drawn_whole", "matched_slices")})
        return found

    return _with_lowered(model, batch, 2, look)

"""What each rank runs in the plan-once tests: rank 0 plans, the others receive the plan (module level, so
spawned processes can import it)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dynshard import passes
from dynshard.backend import dynshard_backend, job_plans
from dynshard.policies import PlanError, tp
from models import GPT, MLP, GPTConfig, gpt_batch, mlp_batch
from workers import train_parity

CALLS = {"counted_tp": 0}


def counted_tp(plan, config) -> None:
    """The tp policy, counting its runs on this rank."""
    CALLS["counted_tp"] += 1
    tp(plan, config)


def failing_policy(plan, config) -> None:
    raise PlanError(f"no plan for this graph (raised on rank {dist.get_rank()})")


def tp_job(rank: int, world: int, steps: int) -> dict:
    """The test GPT trained under tp with a policy that counts its runs (``cache_dir`` comes from the
    environment): the parity report, the policy's runs on this rank, and the plan's pass timings."""
    result = train_parity(rank, world, "gpt", counted_tp, 2, "aot_eager", steps)
    result["policy_calls"] = CALLS["counted_tp"]
    result["pass_timings"] = [plan.pass_timings for plan in job_plans().programs()]   # this job's plans
    return result


def failures(rank: int, world: int) -> dict[str, dict]:
    """Compile-only scenarios, one after the other in one job: what each raised on this rank and when."""
    results = {"policy_raises": _compile(failing_policy, hidden=32)}
    # rank 1 fails before it gets to the policy pass: it still takes rank 0's plan, so the ranks stay in step
    at = passes.LOWER.index(passes.lower_to_aten)
    if rank == 1:
        passes.LOWER[at] = _broken_lowering
    try:
        results["lowering_fails_on_rank_1"] = _compile("tp", hidden=48)
    finally:
        passes.LOWER[at] = passes.lower_to_aten
    results["after"] = _compile("tp", hidden=64)
    # sequence parallelism: the activations the policy placed travel with the plan
    results["sequence_parallel"] = _compile("tp", model="gpt", pas_config={"sequence_parallel": True})
    dist.barrier()
    return results


def _broken_lowering(gm, ctx):
    raise RuntimeError("lowering broke on rank 1")


def _compile(policy, hidden: int = 32, model: str = "mlp", **options) -> dict:
    """Compile (no run: a rank that failed would leave the other's collectives waiting) an MLP or the GPT."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    if model == "gpt":
        module, batch = GPT(GPTConfig()), gpt_batch(GPTConfig(), 4, 0)
    else:
        module, batch = MLP(hidden=hidden), mlp_batch(4, 0)
    planned = []

    def backend(gm, example_inputs):
        planned.append(dynshard_backend(gm, example_inputs, options={"compiler": "aot_eager", "policy": policy,
                                                                      "plan_ngpus": 2, **options}).plan)
        return gm.forward

    start = time.monotonic()
    try:
        torch.compile(module, backend=backend, fullgraph=True)(*batch)
    except Exception as error:
        return {"error": _innermost(error), "seconds": time.monotonic() - start}
    plan = planned[0]
    return {"error": None, "seconds": time.monotonic() - start,
            "placements": {inp.name: str(plan.placements[inp.index]) for inp in plan.inputs},
            "collectives": [(c.phase, c.kind, c.group, tuple(c.shape)) for c in plan.program.collectives],
            "pass_timings": dict(plan.pass_timings)}


def _innermost(error: BaseException) -> tuple[str, str]:
    """The backend's own exception (Dynamo hands it on wrapped in BackendCompilerFailed): type and text."""
    while getattr(error, "inner_exception", None) is not None:
        error = error.inner_exception
    return type(error).__name__, str(error)


def pipeline_job(rank: int, world: int) -> dict:
    """The tied GPT under pp (2 stages, 1f1b) with the stage cut counted on this rank (``cache_dir`` from
    the environment): parity with one process, the cuts made here, the stages' modules."""
    from dynshard.passes import cut_stages
    from workers_pipeline import pipeline_parity

    calls = []
    choose = cut_stages._choose_cuts

    def counted(*args):
        calls.append(1)
        return choose(*args)

    cut_stages._choose_cuts = counted
    try:
        result = pipeline_parity(rank, world, "gpt", 2, {"pipeline_nmicros": 2}, "train_step", 2)
    finally:
        cut_stages._choose_cuts = choose
    result["cuts_made"] = len(calls)
    result["pass_timings"] = [dict(plan.pass_timings) for plan in job_plans().programs()]
    return result

"""What each rank runs in the agreement tests: ranks that compile different plans (module level, so
spawned processes can import it)."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

import dynshard
from dynshard.backend import agreement
from models import MLP, mlp_batch

TP = {"plan_ngpus": 2, "policy": "tp"}


def disagreements(rank: int, world: int) -> dict[str, dict]:
    """One job, one scenario after the other (a mismatch fails every rank at the same compile, so the
    ranks stay in step): what each scenario raised on this rank, and how long the failing step took."""
    results = {
        "config": _train_step({"plan_ngpus": 2, "policy": "tp" if rank == 0 else "data"}),
        "model": _train_step(TP, hidden=32 if rank == 0 else 64),
        "batch": _train_step(TP, batch=4 if rank == 0 else 2),
        "load_plan_path": _train_step({**TP, "load_plan_path": "/plans/mlp.json"} if rank == 1 else TP),
        "autodist": _train_step({**TP, "policy": "autodist"} if rank == 0 else TP),
        "agreeing": _train_step(TP),
    }
    agreement.TIMEOUT = datetime.timedelta(seconds=3)
    if rank == 0:     # (a model of its own: one of the agreed family's would compile alone, see backend.families)
        results["absent"] = _train_step(TP, hidden=48)
    dist.barrier()          # rank 1 skips the compile and waits here, on the default group
    return results


def _train_step(config: dict, hidden: int = 32, batch: int = 4) -> dict:
    """One training step of an MLP; the PlanMismatchError it raised, as text."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled = torch.compile(MLP(hidden=hidden), backend="dynshard", options={"compiler": "aot_eager", **config})
    start = time.monotonic()
    try:
        compiled(*mlp_batch(batch, 0)).backward()
    except Exception as error:
        mismatch = _plan_mismatch(error)
        if mismatch is None:
            raise
        return {"error": str(mismatch), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def _plan_mismatch(error: BaseException | None) -> dynshard.PlanMismatchError | None:
    """The PlanMismatchError the backend raised (Dynamo hands it on wrapped in BackendCompilerFailed)."""
    while error is not None and not isinstance(error, dynshard.PlanMismatchError):
        error = getattr(error, "inner_exception", None)
    return error

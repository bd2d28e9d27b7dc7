"""What each rank runs in tests/test_restart.py's killed-save test (module level, so spawned processes can
import it)."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dynshard
import dynshard.checkpoint.io as ckpt_io
from workers_checkpoint import _build, _full_momentum, _step

# where a save is killed (the rank that dies; the other one waits in a collective until the harness ends it)
KILL_POINTS = {
    "dcp_write": 1,        # rank 1 dies right after DCP wrote its data file: no .metadata yet
    "before_rename": 0,    # DCP finished (.metadata written), rank 0 dies before renaming the .tmp- dir
    "before_marker": 0,    # rank 0 renamed the directory to its final name and dies before writing COMPLETE
}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_during_save(where: str) -> None:
    """Make this process SIGKILL itself at ``where`` of the next ``dynshard.checkpoint.save``."""
    if where == "dcp_write":
        original = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            future = original(self, plan, planner)
            future.wait()                                  # this rank's __<rank>_0.distcp is on disk
            _die()
        dcp.FileSystemWriter.write_data = write_then_die
    elif where == "before_rename":
        ckpt_io.publish = lambda tmp, path: _die()
    elif where == "before_marker":
        replace = os.replace

        def replace_then_die(src, dst, *args, **kwargs):
            replace(src, dst, *args, **kwargs)
            if ckpt_io._TMP in os.fspath(src):              # the new checkpoint has its final name now
                _die()
        ckpt_io.os = type("os_with_a_dying_replace", (), {"replace": staticmethod(replace_then_die),
                                                          "__getattr__": lambda self, n: getattr(os, n)})()
    else:
        raise ValueError(where)


def _full(compiled, model, opt) -> dict:
    return {"params": {k: v.detach().clone() for k, v in dynshard.collect_state_dict(compiled).items()},
            "momentum": _full_momentum(model, opt)}


def train_then_die_saving(rank: int, world: int, root: str, where: str) -> None:
    """tp (plan 2): 2 steps, save step2 (complete), one more step, then a save of step3 killed at ``where``.
    Rank 0 leaves the full state at step 2 and at step 3 beside ``root`` for the test to compare with."""
    model, compiled, opt = _build("tp", 2)
    for step in range(2):
        _step(compiled, opt, step, 2)
    torch.manual_seed(100 + rank)                  # a per-rank RNG state to save
    torch.save(torch.get_rng_state(), f"{root}.rng{rank}.pt")
    dynshard.checkpoint.save(os.path.join(root, "step2"), compiled, opt, extra={"step": 2})
    at_save = _full(compiled, model, opt)
    _step(compiled, opt, 2, 2)
    after_step = _full(compiled, model, opt)
    if rank == 0:
        torch.save({"at_save": at_save, "after_step": after_step}, f"{root}.expected.pt")
    dist.barrier()
    if rank == KILL_POINTS[where]:
        _kill_during_save(where)
    dynshard.checkpoint.save(os.path.join(root, "step3"), compiled, opt, extra={"step": 3})
    raise AssertionError(f"the save killed at {where} returned on rank {rank}")


def resume_from_latest(rank: int, world: int, roots: list[str]) -> dict:
    """For each root a killed save left: load ``latest(root)``, run the step the killed job ran after its
    last complete save, and save step3 again (over the leftovers). One model for all: the first load comes
    before its first step (whole tensors, and before dynshard has created the process group), the others
    after steps (this rank's pieces, in place)."""
    model, compiled, opt = _build("tp", 2, seed=1)
    results = {}
    for root in roots:
        path = dynshard.checkpoint.latest(root)
        group_before_load = dist.is_initialized()
        extra = dynshard.checkpoint.load(path, compiled, opt)
        rng = torch.get_rng_state()
        loaded = _full(compiled, model, opt)
        _step(compiled, opt, extra["step"], 2)
        after_step = _full(compiled, model, opt)
        dynshard.checkpoint.save(os.path.join(root, "step3"), compiled, opt, extra={"step": 3})
        results[root] = {"latest": path, "extra": extra, "loaded": loaded, "after_step": after_step,
                         "rng": rng, "group_before_load": group_before_load,
                         "latest_after_save": dynshard.checkpoint.latest(root)}
    return results

"""What a process runs in the job-lifetime tests (module level, so spawned processes can import it)."""

from __future__ import annotations

import torch.distributed as dist

from dynshard import compat
from dynshard.backend import job_plans
from dynshard.runtime.accumulation import job_accumulation
from dynshard.runtime.job import current_job, new_job


def job_lifetimes(rank: int, world: int) -> dict:
    """One process through the lifetimes a job can have: begun without a group, bound to the first group,
    ended by destroying it, ended by hand."""
    seen = {}
    alone = current_job()
    job_accumulation().install_step_hook()          # as no_sync does before the first compiled call
    seen["stable_without_group"] = current_job() is alone
    compat.fake_process_group(2)
    seen["first_group_keeps_the_job"] = current_job() is alone and alone.world is dist.group.WORLD
    before = job_plans()
    accumulation = job_accumulation()
    dist.destroy_process_group()
    compat.fake_process_group(2)
    restarted = current_job()
    seen["new_group_new_job"] = restarted is not alone and job_plans() is not before
    seen["ended_parts_released"] = accumulation._step_hook is None
    new_job()
    seen["numbers"] = [alone.number, restarted.number, current_job().number]
    seen["new_job_same_group"] = current_job() is not restarted and current_job().world is dist.group.WORLD
    return seen

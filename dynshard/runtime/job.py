"""A job: what dynshard keeps while one default process group lives.

Compiled plans, the plan files read, the count of compiles the ranks agreed on, the meshes and process
groups dynshard made, and the gradients accumulated under ``no_sync`` all belong to the job that made
them: each refers to the job's process groups or counts its collectives, so none of it means anything
to another job. Each layer keeps its own state as a *part* of the current job (:meth:`Job.part`), and
the part goes when the job ends.

A job begins at its first use and is bound to the default process group it first sees (one begun
before any group, e.g. by ``no_sync`` or a reducer hook ahead of the first compile, which makes the
group, belongs to the group that comes next). It ends when that group is destroyed: the next use finds
another default group, or none, and begins a new job. So ``destroy_process_group()`` then
``init_process_group()`` starts afresh, as a restarted process does. A process that never makes a
group runs one job for its whole life. :func:`new_job` ends the current job by hand.
"""

from __future__ import annotations

import atexit
import itertools
from typing import Any, Callable, TypeVar

import torch.distributed as dist

T = TypeVar("T")


class Job:
    """The state of one job, by part (see the module docstring); a part with an ``end_job()`` method is
    told when the job ends (to release what it holds beyond Python objects: a gloo group, a hook)."""

    def __init__(self, number: int) -> None:
        self.world: Any = None      # the default process group this job runs on (None until it sees one)
        # this job's number in the process, the same on every rank: keys what it writes to a shared store
        self.number = number
        self._parts: dict[Callable[[], Any], Any] = {}

    def part(self, kind: Callable[[], T]) -> T:
        """This job's ``kind()``, made at its first use."""
        found = self._parts.get(kind)
        if found is None:
            found = self._parts[kind] = kind()
        return found

    def end(self) -> None:
        parts, self._parts = list(self._parts.values()), {}
        for part in reversed(parts):
            end = getattr(part, "end_job", None)
            if end is not None:
                end()


class _Jobs:
    """This process's jobs: one at a time, numbered in the order they begin."""

    def __init__(self) -> None:
        self.job: Job | None = None
        self._numbers = itertools.count()

    def current(self) -> Job:
        world = dist.group.WORLD if dist.is_initialized() else None
        if self.job is not None and self.job.world is not None and self.job.world is not world:
            self.end()          # its group was destroyed
        if self.job is None:
            self.job = Job(next(self._numbers))
        if self.job.world is None:
            self.job.world = world
        return self.job

    def end(self) -> None:
        job, self.job = self.job, None
        if job is not None:
            job.end()


_JOBS = _Jobs()


def current_job() -> Job:
    """The job this process runs now (begun here when there is none, or when its group is gone)."""
    return _JOBS.current()


def new_job() -> None:
    """End the current job: what dynshard kept for it (compiled plans in memory, plan files read, the
    agreement on compiles, its meshes and groups, gradients accumulated and not yet reduced) is dropped, as
    after a restart, and the next compile begins a new job on the current process group. Every rank must
    call it at the same point. Models compiled before keep their programs until ``torch._dynamo.reset()``."""
    _JOBS.end()


@atexit.register
def _end_at_exit() -> None:
    """End the job before interpreter shutdown: a gloo group destroyed during static destruction aborts the
    process from its threads ("terminate called without an active exception", seen once in CI)."""
    _JOBS.end()

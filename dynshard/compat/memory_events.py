"""Every CPU allocation and free torch makes inside a block, in order: the profiler's memory events
(``profile_memory=True``), read from its private kineto results (``prof.profiler.kineto_results``). CPU
tensors have no allocator statistics (``torch.cuda.max_memory_allocated`` has no CPU twin); these events
are what the profiler's own memory timeline is built from."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def cpu_allocations() -> Iterator[list[tuple[int, int]]]:
    """Yields a list that holds, once the block ends, (nanoseconds, bytes) per CPU allocation (bytes > 0)
    and free (bytes < 0) made inside it, in time order."""
    events: list[tuple[int, int]] = []
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    prof.__enter__()
    try:
        yield events
    finally:
        prof.__exit__(None, None, None)
        cpu = torch._C._autograd.DeviceType.CPU
        events.extend(sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                             if e.name() == "[memory]" and e.device_type() == cpu))

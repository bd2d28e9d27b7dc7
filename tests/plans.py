"""The plan dynshard's backend makes for a model's first graph, without running its program (in one process,
on a process group that never communicates: the ``fake_world`` fixture)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dynshard import compat
from dynshard.backend import dynshard_backend


def plan_for(model, inputs, **options):
    """The plan dynshard's backend makes for ``model(*inputs)``, without running the program."""
    options.setdefault("compiler", "aot_eager")
    plans = []

    def backend(gm, example_inputs):
        plans.append(dynshard_backend(gm, example_inputs, options=options).plan)
        return gm.forward

    torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    return plans[0]


def logged_pass_graphs(model, inputs, **options) -> list[str]:
    """The graphs ``plan_for(model, inputs, **options)`` logs after each pass (``TORCH_LOGS=+dynshard.passes``),
    as ``"graph after <pass>:\n<graph>"``, in order; in a new job, so that a plan made before is made again
    (not served from the job's plans) and its passes run."""
    import logging

    from dynshard.runtime.job import new_job

    new_job()
    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("dynshard.passes")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        plan_for(model, inputs, **options)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return records


def restart_fake_world() -> None:
    """This process as after a restart: a new process group of the same size, so a new dynshard job (the
    plans it keeps in memory gone)."""
    world = dist.get_world_size()
    dist.destroy_process_group()
    compat.fake_process_group(world)

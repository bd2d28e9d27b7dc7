"""The plan dynshard's backend makes for a model's first graph, without running its program (in one process,
on a process group that never communicates: the ``fake_world`` fixture)."""

from __future__ import annotations

import torch

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
